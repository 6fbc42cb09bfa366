//! The running process's side: the `handover` control method.

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bdev::BlockDevice;
use nix::sys::socket::{
    connect, getsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, UnixAddr,
};
use serde::Deserialize;
use serde_json::{json, Value};

use super::snapshot::ServerSnapshot;
use super::{handed_over, CONFIG_KEY, HANDED_OVER, RPC_LISTENER_KEY};
use crate::rpc::{parse_params, Rpc, RpcError};
use crate::server::State;
use crate::supervise::wire::{self, Op};

/// How long queues may take to finish the requests they have when a handover
/// starts (then it is abandoned and the devices resume).
const QUIESCE_LIMIT: Duration = Duration::from_secs(5);
/// How long the new process may take from our last record to its confirmation;
/// past it, it is killed and we resume.
const CONFIRM_LIMIT: Duration = Duration::from_secs(60);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    /// The new process's private handover socket.
    socket: PathBuf,
}

/// `handover {"socket": PATH}`: hands every device to the process listening on
/// PATH. Returns once it confirmed (this process then exits after the reply), or
/// fails having resumed everything.
pub fn handover(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let p: Params = parse_params(p)?;
    if crate::supervise::supervised() {
        return Err(anyhow!(
            "this server runs under --supervise: a handover of a supervised server is not \
             supported; restart its child instead (SIGTERM stops the whole service)"
        )
        .into());
    }
    let sock = connect_to(&p.socket)?;
    check_peer(&sock)?;
    let mut st = rpc.server.lock();
    let t0 = Instant::now();
    refuse_what_cannot_move(&st)?;
    let (paused, records) = pause_and_export(&mut st)?;
    let quiesced = t0.elapsed();
    if let Err(e) = let_go_all(&st) {
        take_back_all(&st, &[]);
        resume_all(&mut st);
        tracing::warn!("handover failed, devices resumed: {e:#}");
        return Err(e.context("handover failed; this process serves on").into());
    }
    let pause_done = t0.elapsed();
    let mut successor = Successor::default();
    match send_and_confirm(&rpc.server, &st, &sock, records, &mut successor) {
        Ok(()) => {
            let total = t0.elapsed();
            HANDED_OVER.store(true, Ordering::Release);
            // The lock stays held: nothing may change here any more.
            std::mem::forget(st);
            tracing::info!(
                devices = paused,
                quiesce_us = quiesced.as_micros() as u64,
                let_go_us = (pause_done - quiesced).as_micros() as u64,
                total_us = total.as_micros() as u64,
                "handover confirmed by the new process"
            );
            Ok(json!({
                "devices": paused,
                "quiesce_us": pause_done.as_micros() as u64,
                "handover_us": total.as_micros() as u64,
            }))
        }
        Err(e) => {
            let dead = successor.dead_clients();
            take_back_all(&st, &dead);
            resume_all(&mut st);
            tracing::warn!("handover failed, devices resumed: {e:#}");
            Err(e.context("handover failed; this process serves on").into())
        }
    }
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

/// Every device as a handover sees it; a device of a kind it cannot move, or a
/// backend whose kind refuses, fails the handover before anything pauses.
fn refuse_what_cannot_move(st: &State) -> Result<()> {
    for d in &st.devices {
        let Some(h) = handed_over(d) else {
            bail!("{}: unknown device kind", d.socket().display());
        };
        for (name, spec, _) in h.backends() {
            if let Some(why) = spec.kind.0.handover_refusal() {
                bail!("{name} ({spec}): {why}");
            }
        }
    }
    Ok(())
}

/// Pauses every device; on a failure resumes those paused and says which failed.
fn pause_all(st: &mut State) -> Result<usize> {
    for i in 0..st.devices.len() {
        if let Some(h) = handed_over(&st.devices[i]) {
            if let Err(e) = h.pause_for_handover(QUIESCE_LIMIT) {
                resume(&st.devices[..i]);
                return Err(e);
            }
        }
    }
    Ok(st.devices.len())
}

fn resume(devices: &[crate::server::Device]) {
    devices
        .iter()
        .filter_map(|d| handed_over(d))
        .for_each(|h| h.resume_after_handover_failed());
}

/// After every device quiesced (no request in flight): each backend gives up what
/// would keep the new process from opening it by its spec (an RBD image's
/// exclusive lock, decision 0025).
fn let_go_all(st: &State) -> Result<()> {
    for h in st.devices.iter().filter_map(|d| handed_over(d)) {
        for (name, _, disk) in h.backends() {
            disk.pause()
                .with_context(|| format!("{name}: cannot let go of its backend"))?;
        }
    }
    Ok(())
}

/// The handover failed: backends take back what they let go of. A failure is
/// logged: that backend's writes fail until it is fixed (it is not expected:
/// nobody else may hold the lock meanwhile).
fn take_back_all(st: &State, dead: &[String]) {
    for h in st.devices.iter().filter_map(|d| handed_over(d)) {
        for (name, _, disk) in h.backends() {
            if let Err(e) = disk.resume(dead) {
                tracing::error!("handover rollback: {name}: cannot take its backend back: {e}");
            }
        }
    }
}

fn resume_all(st: &mut State) {
    resume(&st.devices);
}

/// Pauses every device and takes its records. A device that refuses its export
/// (a vhost-user-blk queue that still has a request in flight: a queue thread
/// that read the pause flag of an earlier pause can acknowledge this one early)
/// is resumed with the others and asked again, a few times.
fn pause_and_export(st: &mut State) -> Result<(usize, Vec<super::Record>)> {
    const TRIES: usize = 5;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let paused = pause_all(st)?;
        match export_all(st) {
            Ok(records) => return Ok((paused, records)),
            Err(e) => {
                resume_all(st);
                if attempt >= TRIES {
                    return Err(e.context(format!("after {TRIES} attempts")));
                }
                tracing::info!("handover: export attempt {attempt} failed ({e:#}); again");
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

fn export_all(st: &State) -> Result<Vec<super::Record>> {
    let mut out = Vec::new();
    for h in st.devices.iter().filter_map(|d| handed_over(d)) {
        out.extend(h.handover_records()?);
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
fn proc_stat(pid: i32) -> Option<(char, u64)> {
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
        let wait = |limit: Duration| {
            let until = Instant::now() + limit;
            while !gone() {
                if Instant::now() >= until {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            true
        };
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
    server: &crate::server::Server,
    st: &State,
    sock: &OwnedFd,
    records: Vec<super::Record>,
    successor: &mut Successor,
) -> Result<()> {
    let metrics = crate::metrics::listener_copy();
    let snap = ServerSnapshot::of(server, st, metrics.as_ref().map(|(_, a)| *a));
    let s = sock.as_fd();
    wire::send(s, Op::Record, CONFIG_KEY, &serde_json::to_vec(&snap)?, &[])
        .context("handover: cannot send the configuration")?;
    if let Some(l) = crate::rpc::listener_copy() {
        wire::send(s, Op::Record, RPC_LISTENER_KEY, &[], &[l.as_fd()])?;
    }
    if let Some((l, _)) = &metrics {
        wire::send(
            s,
            Op::Record,
            super::METRICS_LISTENER_KEY,
            &[],
            &[l.as_fd()],
        )?;
    }
    {
        {
            for (key, bytes, fds) in records {
                let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                wire::send(s, Op::Record, &key, &bytes, &fds)
                    .with_context(|| format!("handover: cannot send record {key}"))?;
            }
        }
    }
    wire::send_all(s, &crate::supervise::local_records())
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
    let mut buf = vec![0u8; wire::MAX_MSG];
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
        match wire::recv(sock.as_fd(), &mut buf)? {
            Some(m) if m.op == Op::Record && m.key == super::CLIENT_KEY => {
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
