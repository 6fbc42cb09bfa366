//! The running process's side: hands every device to a new process (the control
//! method `handover`, which `rpc::methods` registers).

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bdev::BlockDevice;
use lifecycle::channel::{self, Op};
use lifecycle::Record;
use nix::sys::socket::{
    connect, getsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, UnixAddr,
};
use serde_json::{json, Value};

use super::snapshot::ServerSnapshot;
use super::CONFIG_KEY;
use crate::process::CLIENT_KEY;
use crate::server::{Server, State};

/// How long queues may take to finish the requests they have when a handover
/// starts (then it is abandoned and the devices resume).
const PAUSE_LIMIT: Duration = Duration::from_secs(5);
/// How long the new process may take from our last record to its confirmation;
/// past it, it is killed and we resume.
const CONFIRM_LIMIT: Duration = Duration::from_secs(60);

/// Hands every device to the process listening on `socket`. Returns once it
/// confirmed (this process then exits after the reply: see
/// `Process::exit_if_handed_over`), or fails having resumed everything.
pub fn handover(server: &Server, socket: &Path) -> Result<Value> {
    if server.process().is_supervised() {
        bail!(
            "this server runs under --supervise: a handover of a supervised server is not \
             supported; restart its child instead (SIGTERM stops the whole service)"
        );
    }
    // Said before a successor is even reached; checked again under the lock.
    refuse_what_cannot_move(&server.lock())?;
    let sock = connect_to(socket)?;
    check_peer(&sock)?;
    let mut st = server.lock();
    refuse_what_cannot_move(&st)?;
    // Jobs stop between two steps before the devices pause (a commit or
    // mirror writes guest writes through until then), and go on here if the
    // handover fails.
    let hold = Instant::now();
    crate::jobs::handover::hold_all(&st.jobs)?;
    crate::jobs::handover::flush_targets(&st);
    let t0 = Instant::now();
    let (paused, records) = match pause_and_save(&mut st) {
        Ok(r) => r,
        Err(e) => {
            crate::jobs::handover::release_all(&st.jobs);
            return Err(e);
        }
    };
    let pause_took = t0.elapsed();
    if let Err(e) = pause_backends(&st) {
        return Err(roll_back(&mut st, &[], e));
    }
    let pause_done = t0.elapsed();
    let mut successor = Successor::default();
    if let Err(e) = send_and_confirm(server, &st, &sock, records, &mut successor) {
        let dead = successor.dead_clients();
        return Err(roll_back(&mut st, &dead, e));
    }
    let total = t0.elapsed();
    server.process().set_handed_over();
    // The lock stays held: nothing may change here any more.
    std::mem::forget(st);
    tracing::info!(
        devices = paused,
        pause_us = pause_took.as_micros() as u64,
        backends_us = (pause_done - pause_took).as_micros() as u64,
        total_us = total.as_micros() as u64,
        jobs_hold_us = (t0 - hold).as_micros() as u64,
        "handover confirmed by the new process"
    );
    Ok(json!({
        "devices": paused,
        "pause_us": pause_done.as_micros() as u64,
        "handover_us": total.as_micros() as u64,
    }))
}

fn connect_to(path: &std::path::Path) -> Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .context("handover: cannot create a socket")?;
    let addr = UnixAddr::new(path).context("handover: bad socket path")?;
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr)
        .with_context(|| format!("handover: cannot connect to {}", path.display()))?;
    Ok(fd)
}

/// The fds we are about to send include the guests' memory: only a process of our
/// own user may get them (the control socket may be open to a group).
fn check_peer(sock: &OwnedFd) -> Result<()> {
    let cred = getsockopt(sock, sockopt::PeerCredentials)
        .context("handover: cannot tell who listens on the socket")?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() != me {
        bail!(
            "handover: the socket's owner process runs as uid {}, not as this server's uid {me}",
            cred.uid()
        );
    }
    Ok(())
}

/// After the devices paused: backends, devices and jobs go on here.
fn roll_back(st: &mut State, dead: &[String], e: anyhow::Error) -> anyhow::Error {
    resume_backends(st, dead);
    resume_all(st);
    crate::jobs::handover::release_all(&st.jobs);
    tracing::warn!("handover failed, devices resumed, block jobs go on: {e:#}");
    e.context("handover failed; this process serves on")
}

/// A backend whose kind refuses to be taken over fails the handover before
/// anything pauses.
fn refuse_what_cannot_move(st: &State) -> Result<()> {
    for d in &st.devices {
        for r in d.disks() {
            if let Some(why) = r.spec.kind.0.handover_refusal() {
                bail!("{} ({}): {why}", r.name, r.spec);
            }
        }
    }
    Ok(())
}

/// Pauses every device; on a failure resumes those paused and says which failed.
fn pause_all(st: &mut State) -> Result<usize> {
    for i in 0..st.devices.len() {
        if let Err(e) = st.devices[i].pause(PAUSE_LIMIT) {
            st.devices[..i].iter_mut().for_each(|d| d.resume());
            return Err(e);
        }
    }
    Ok(st.devices.len())
}

fn resume_all(st: &mut State) {
    st.devices.iter_mut().for_each(|d| d.resume());
}

/// After every device paused (no request in flight): each backend gives up what
/// would keep the new process from opening it by its spec (an RBD image's
/// exclusive lock, decision 0025).
fn pause_backends(st: &State) -> Result<()> {
    for d in &st.devices {
        for r in d.disks() {
            r.disk
                .pause()
                .with_context(|| format!("{}: cannot pause its backend", r.name))?;
        }
    }
    Ok(())
}

/// The handover failed: backends take back what they gave up. A failure is
/// logged: that backend's writes fail until it is fixed (it is not expected:
/// nobody else may hold the lock meanwhile).
fn resume_backends(st: &State, dead: &[String]) {
    for d in &st.devices {
        for r in d.disks() {
            if let Err(e) = r.disk.resume(dead) {
                tracing::error!(
                    "handover rollback: {}: cannot resume its backend: {e}",
                    r.name
                );
            }
        }
    }
}

/// Pauses every device and saves it. A device that refuses to save (a
/// vhost-user-blk queue that still has a request in flight: a queue thread that
/// read the pause flag of an earlier pause can acknowledge this one early) is
/// resumed with the others and asked again, a few times.
fn pause_and_save(st: &mut State) -> Result<(usize, Vec<Record>)> {
    const TRIES: usize = 5;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let paused = pause_all(st)?;
        match save_all(st) {
            Ok(records) => return Ok((paused, records)),
            Err(e) => {
                resume_all(st);
                if attempt >= TRIES {
                    return Err(e.context(format!("after {TRIES} attempts")));
                }
                tracing::info!("handover: save attempt {attempt} failed ({e:#}); again");
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

fn save_all(st: &State) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    for d in &st.devices {
        out.extend(d.save()?);
    }
    Ok(out)
}

/// What the old process knows of the new one: its pid and the cluster clients it
/// announced before taking locks with them.
#[derive(Default)]
struct Successor {
    pid: Option<i32>,
    /// Its start time (/proc/PID/stat), so that a recycled pid is not taken for it.
    started: Option<u64>,
    clients: Vec<String>,
    /// It sent Abort: it is alive, waiting for our answer, and dropped what it
    /// opened (so its locks are released) before saying so.
    aborted: bool,
}

/// State letter and start time of `pid` (/proc/PID/stat); None if there is none.
pub(super) fn proc_stat(pid: i32) -> Option<(char, u64)> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut f = st.rsplit_once(')')?.1.split_whitespace();
    let state = f.next()?.chars().next()?;
    // Field 22 (starttime) is the 20th after the state.
    let started = f.nth(18)?.parse().ok()?;
    Some((state, started))
}

impl Successor {
    /// After a failed handover: the clients it announced, once it is surely dead
    /// (it is killed if it lingers: it failed, and must not hold our images). Empty
    /// if it announced none or cannot be made sure dead.
    fn dead_clients(&self) -> Vec<String> {
        if self.clients.is_empty() || self.aborted {
            return Vec::new();
        }
        let (Some(pid), Some(started)) = (self.pid.filter(|p| *p > 0), self.started) else {
            return Vec::new();
        };
        // Gone: no such process, another one under a recycled pid, or a zombie
        // (exited, not reaped by its parent: it runs no code).
        let gone = || match proc_stat(pid) {
            None => true,
            Some((state, t)) => t != started || state == 'Z',
        };
        let wait = |limit: Duration| engine::wait_until(limit, Duration::from_millis(10), gone);
        if !wait(Duration::from_secs(5)) {
            if !gone() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if !wait(Duration::from_secs(5)) {
                tracing::error!("handover rollback: the new process {pid} does not die");
                return Vec::new();
            }
        }
        self.clients.clone()
    }
}

fn send_and_confirm(
    server: &Server,
    st: &State,
    sock: &OwnedFd,
    records: Vec<Record>,
    successor: &mut Successor,
) -> Result<()> {
    let snap = ServerSnapshot::of(server, st);
    let s = sock.as_fd();
    channel::send(s, Op::Record, CONFIG_KEY, &serde_json::to_vec(&snap)?, &[])
        .context("handover: cannot send the configuration")?;
    for r in records {
        let fds: Vec<_> = r.fds.iter().map(|f| f.as_fd()).collect();
        channel::send(s, Op::Record, &r.key, &r.bytes, &fds)
            .with_context(|| format!("handover: cannot send record {}", r.key))?;
    }
    // Secrets the new process reopens encrypted disks with.
    for (key, bytes) in server.process().secrets().records() {
        channel::send(s, Op::Record, &key, &bytes, &[])
            .context("handover: cannot send the secrets")?;
    }
    // What the devices keep as they run, and the control plane's listeners; ends
    // the stream.
    channel::send_all(s, server.process().own_records())
        .context("handover: cannot send the devices' records")?;
    wait_confirm(sock, successor)
}

/// Waits for the new process's answer (noting the cluster clients it announces
/// meanwhile); kills it if the answer does not come in time (so that it cannot
/// start serving after we resumed).
fn wait_confirm(sock: &OwnedFd, successor: &mut Successor) -> Result<()> {
    let peer = getsockopt(sock, sockopt::PeerCredentials)
        .ok()
        .map(|c| c.pid());
    successor.pid = peer;
    successor.started = peer.and_then(proc_stat).map(|(_, t)| t);
    let until = Instant::now() + CONFIRM_LIMIT;
    let mut buf = vec![0u8; channel::MAX_MSG];
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let ms = u16::try_from(left.as_millis().min(u128::from(u16::MAX))).unwrap_or(u16::MAX);
        let mut fds = [nix::poll::PollFd::new(
            sock.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let ready = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms)).unwrap_or(0);
        if ready == 0 {
            if Instant::now() < until {
                continue;
            }
            if let Some(pid) = peer.filter(|p| *p > 0) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            bail!("the new process did not confirm within {CONFIRM_LIMIT:?}; it was killed");
        }
        match channel::recv(sock.as_fd(), &mut buf)? {
            Some(m) if m.op == Op::Record && m.key == CLIENT_KEY => {
                let addr = String::from_utf8_lossy(&m.bytes).into_owned();
                if successor.clients.len() < 64 && !successor.clients.contains(&addr) {
                    successor.clients.push(addr);
                }
            }
            Some(m) if m.op == Op::Confirm => return Ok(()),
            Some(m) if m.op == Op::Abort => {
                successor.aborted = true;
                bail!("the new process gave up: {}", m.key)
            }
            Some(m) => bail!("unexpected {:?} from the new process", m.op),
            None => bail!("the new process exited before it confirmed"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn proc_stat_reads_state_and_start_time() {
        let me = i32::try_from(std::process::id()).unwrap();
        let (state, started) = super::proc_stat(me).expect("our own stat");
        assert!(matches!(state, 'R' | 'S'), "{state}");
        assert!(started > 0);
        assert_eq!(super::proc_stat(me).map(|s| s.1), Some(started));
        assert!(super::proc_stat(i32::MAX).is_none());
    }
}
