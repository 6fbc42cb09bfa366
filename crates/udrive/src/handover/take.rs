//! The new process's side: `udrive serve --takeover RPC_SOCKET`.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use nix::sys::socket::{
    bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr,
};
use serde_json::json;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use vfio_user::Kept;

use super::snapshot::ServerSnapshot;
use super::{CONFIG_KEY, METRICS_LISTENER_KEY, RPC_LISTENER_KEY};
use crate::supervise::wire::{self, Op};

/// How long the running process may take to connect and send everything.
const RECEIVE_LIMIT: Duration = Duration::from_secs(30);

/// Our private socket; removed when we are done with it.
struct TempSocket {
    fd: OwnedFd,
    path: PathBuf,
}

impl Drop for TempSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn listen_at(dir: &Path) -> Result<TempSocket> {
    let path = dir.join(format!(".udrive-takeover-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .context("takeover: cannot create a socket")?;
    let addr = UnixAddr::new(&path).context("takeover: socket path too long")?;
    bind(fd.as_raw_fd(), &addr)
        .with_context(|| format!("takeover: cannot bind {}", path.display()))?;
    let s = TempSocket { fd, path };
    std::fs::set_permissions(&s.path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    listen(&s.fd, Backlog::new(1).unwrap_or(Backlog::MAXCONN))
        .context("takeover: cannot listen")?;
    Ok(s)
}

/// Takes every device over from the process serving `from` and serves them.
pub fn run(from: &Path) -> Result<()> {
    let t0 = Instant::now();
    let dir = from
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let ours = listen_at(dir)?;
    // The request returns when the handover is over: run it beside us.
    let (from2, ours_path) = (from.to_path_buf(), ours.path.clone());
    let request = std::thread::Builder::new()
        .name("takeover-rpc".into())
        .spawn(move || {
            crate::rpc::client::call(
                &from2,
                "handover",
                json!({"socket": ours_path}),
                Duration::from_secs(120),
            )
        })
        .context("takeover: cannot start a thread")?;
    let conn = match accept_within(&ours, RECEIVE_LIMIT, &request) {
        Ok(c) => c,
        Err(e) => {
            if request.is_finished() {
                if let Ok(Err(r)) = request.join() {
                    bail!("the running udrive refused the handover: {r}");
                }
            }
            return Err(e);
        }
    };
    drop(ours);
    fail_point("receive");
    let mut records = match receive(&conn) {
        Ok(r) => r,
        Err(e) => {
            // The running process connects before it checks what it can hand over:
            // a refusal closes the connection, and its reason is the request's answer.
            let until = Instant::now() + Duration::from_secs(5);
            while !request.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            if request.is_finished() {
                if let Ok(Err(r)) = request.join() {
                    bail!("the running udrive refused the handover: {r}");
                }
            }
            return Err(e);
        }
    };
    let received = t0.elapsed();
    fail_point("start");
    super::TAKING_OVER.store(true, std::sync::atomic::Ordering::Release);
    *super::TO_OLD.lock().unwrap_or_else(|p| p.into_inner()) = conn.try_clone().ok();
    let started = take_over(&mut records);
    *super::TO_OLD.lock().unwrap_or_else(|p| p.into_inner()) = None;
    let running = match started {
        Ok(r) => r,
        Err(e) => {
            let why = format!("{e:#}");
            let _ = wire::send(conn.as_fd(), Op::Abort, &why, &[], &[]);
            let _ = request.join();
            return Err(e.context("takeover failed; the running udrive resumed its devices"));
        }
    };
    let signals = Signals::new([SIGINT, SIGTERM]).context("cannot install signal handlers")?;
    fail_point("confirm");
    // From here the old process lets go: ours to serve.
    wire::send(conn.as_fd(), Op::Confirm, "", &[], &[])
        .context("takeover: cannot confirm to the running udrive")?;
    super::TAKING_OVER.store(false, std::sync::atomic::Ordering::Release);
    for d in running.server.lock().devices.iter_mut() {
        if let Some(h) = super::handed_over_mut(d) {
            h.start_after_takeover();
        }
    }
    match request.join() {
        Ok(Ok(v)) => tracing::info!(
            received_us = received.as_micros() as u64,
            total_us = t0.elapsed().as_micros() as u64,
            old = %v,
            "took every device over"
        ),
        Ok(Err(e)) => tracing::warn!("handover request ended with: {e}"),
        Err(_) => tracing::warn!("handover request thread failed"),
    }
    println!(
        "udrive: took over from {} in {:.1} ms",
        from.display(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    running.print_banner();
    running.run_until_signal(signals)
}

/// Tests make the takeover die at a step (`UDRIVE_TAKEOVER_DIE_AT=receive|start|
/// confirm`) to check that the running process rolls back.
fn fail_point(step: &str) {
    if std::env::var("UDRIVE_TAKEOVER_DIE_AT").is_ok_and(|s| s == step) {
        eprintln!("udrive: UDRIVE_TAKEOVER_DIE_AT={step}: dying here");
        std::process::abort();
    }
}

/// Accepts the running process's connection, unless its answer comes first (a
/// refusal) or it takes too long.
fn accept_within(
    l: &TempSocket,
    limit: Duration,
    request: &std::thread::JoinHandle<Result<serde_json::Value, crate::rpc::client::CallError>>,
) -> Result<OwnedFd> {
    let until = Instant::now() + limit;
    loop {
        let mut fds = [nix::poll::PollFd::new(
            l.fd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(50u16)).unwrap_or(0) > 0 {
            return vfio_user::sock::accept(l.fd.as_fd()).context("takeover: accept failed");
        }
        if request.is_finished() {
            bail!("the running udrive answered without connecting");
        }
        if Instant::now() >= until {
            bail!("the running udrive did not connect within {limit:?}");
        }
    }
}

fn receive(conn: &OwnedFd) -> Result<BTreeMap<String, Kept>> {
    let mut buf = vec![0u8; wire::MAX_MSG];
    let mut out = BTreeMap::new();
    let until = Instant::now() + RECEIVE_LIMIT;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [nix::poll::PollFd::new(
            conn.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms)).unwrap_or(0) == 0 {
            bail!("takeover: the running udrive sent nothing for {RECEIVE_LIMIT:?}");
        }
        match wire::recv(conn.as_fd(), &mut buf).context("takeover: receiving")? {
            Some(m) if m.op == Op::Record => {
                out.insert(
                    m.key,
                    Kept {
                        bytes: m.bytes,
                        fds: m.fds,
                    },
                );
            }
            Some(m) if m.op == Op::End => return Ok(out),
            Some(m) => bail!("takeover: unexpected {:?} from the running udrive", m.op),
            None => bail!("takeover: the running udrive closed the connection"),
        }
    }
}

/// Starts everything from the records: configuration, listeners, devices.
fn take_over(records: &mut BTreeMap<String, Kept>) -> Result<crate::serve::Running> {
    let config = records
        .remove(CONFIG_KEY)
        .ok_or_else(|| anyhow!("no configuration in the handover"))?;
    let snap: ServerSnapshot =
        serde_json::from_slice(&config.bytes).context("takeover: bad configuration")?;
    let cfg = snap.config()?;
    let take_fd = |records: &mut BTreeMap<String, Kept>, key: &str| {
        records.remove(key).and_then(|mut k| k.fds.pop())
    };
    let listeners = crate::serve::Listeners {
        rpc: take_fd(records, RPC_LISTENER_KEY).map(std::os::unix::net::UnixListener::from),
        metrics: take_fd(records, METRICS_LISTENER_KEY).map(std::net::TcpListener::from),
    };
    crate::supervise::inherit(std::mem::take(records));
    let running = crate::serve::start(&cfg, 0o600, listeners)?;
    for q in &snap.qos {
        running
            .server
            .with_qos(&q.socket, Some(q.nsid), |d| Ok(d.set_limits(q.limits())?))
            .with_context(|| format!("cannot restore QoS of {}", q.socket.display()))?;
    }
    for d in &running.server.lock().devices {
        if let Some(h) = super::handed_over(d) {
            h.check_takeover_state()?;
        }
    }
    crate::supervise::ready();
    Ok(running)
}
