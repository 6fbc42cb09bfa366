//! The new process's side (`udrive serve --takeover RPC_SOCKET`): asks the running
//! process to hand over, receives its records, and confirms or aborts once
//! `serve` has started the devices from them.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use lifecycle::channel::{self, Op};
use lifecycle::{Kept, KeptRecords};
use nix::sys::socket::{
    bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr,
};
use serde_json::json;

use super::snapshot::ServerSnapshot;
use super::CONFIG_KEY;
use crate::rpc_client::CallError;

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

/// A takeover in progress, the new process's side: the running process has sent
/// everything and waits for [`Takeover::confirm`] or [`Takeover::abort`].
pub struct Takeover {
    from: PathBuf,
    conn: OwnedFd,
    /// The `handover` control request, answered when the handover is over.
    request: JoinHandle<std::result::Result<serde_json::Value, CallError>>,
    t0: Instant,
    received: Duration,
}

/// What the running process sent: its configuration and the records to restore
/// the devices from.
pub struct Received {
    pub takeover: Takeover,
    pub snapshot: ServerSnapshot,
    pub records: KeptRecords,
}

impl Takeover {
    /// Asks the process serving the control socket `from` to hand its devices over,
    /// and receives them.
    pub fn receive(from: &Path) -> Result<Received> {
        let t0 = Instant::now();
        let dir = from
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let ours = listen_at(dir)?;
        // The request returns when the handover is over: run it beside us.
        let (from2, ours_path) = (from.to_path_buf(), ours.path.clone());
        let request = sandbox::spawn(sandbox::Role::Control, "takeover-rpc".into(), move || {
            crate::rpc_client::call(
                &from2,
                "handover",
                json!({"socket": ours_path}),
                Duration::from_secs(120),
            )
        })
        .context("takeover: cannot start a thread")?;
        let conn = match accept_within(&ours, RECEIVE_LIMIT, &request) {
            Ok(c) => c,
            Err(e) => return Err(refusal_or(request, e)),
        };
        drop(ours);
        fail_point("receive");
        let mut records = match receive(&conn) {
            Ok(r) => r,
            Err(e) => {
                // The running process connects before it checks what it can hand
                // over: a refusal closes the connection, and its reason is the
                // request's answer.
                engine::wait_until(Duration::from_secs(5), Duration::from_millis(20), || {
                    request.is_finished()
                });
                return Err(refusal_or(request, e));
            }
        };
        let config = records
            .remove(CONFIG_KEY)
            .ok_or_else(|| anyhow!("no configuration in the handover"))?;
        let snapshot: ServerSnapshot =
            serde_json::from_slice(&config.bytes).context("takeover: bad configuration")?;
        let takeover = Takeover {
            from: from.to_path_buf(),
            conn,
            request,
            t0,
            received: t0.elapsed(),
        };
        Ok(Received {
            takeover,
            snapshot,
            records,
        })
    }

    /// The channel to the running process, for the process's announcements while
    /// it takes over (`crate::process::Process::taking_over`).
    pub fn channel(&self) -> Result<OwnedFd> {
        self.conn
            .try_clone()
            .context("takeover: cannot duplicate the channel")
    }

    /// We could not start: the running process resumes its devices.
    pub fn abort(self, why: &anyhow::Error) {
        let why = format!("{why:#}");
        let _ = channel::send(self.conn.as_fd(), Op::Abort, &why, &[], &[]);
        let _ = self.request.join();
    }

    /// Our devices are up (paused): from here the running process lets go and they
    /// are ours to serve.
    pub fn confirm(&self) -> Result<()> {
        fail_point("confirm");
        channel::send(self.conn.as_fd(), Op::Confirm, "", &[], &[])
            .context("takeover: cannot confirm to the running udrive")
    }

    /// After [`Takeover::confirm`]: waits for the running process's answer.
    pub fn finish(self) {
        match self.request.join() {
            Ok(Ok(v)) => tracing::info!(
                received_us = self.received.as_micros() as u64,
                total_us = self.t0.elapsed().as_micros() as u64,
                old = %v,
                "took every device over"
            ),
            Ok(Err(e)) => tracing::warn!("handover request ended with: {e}"),
            Err(_) => tracing::warn!("handover request thread failed"),
        }
        // The server runs on whether or not anyone reads this.
        let _ = crate::outln!(
            "udrive: took over from {} in {:.1} ms",
            self.from.display(),
            self.t0.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// The running process's refusal if its answer came, else `e`.
fn refusal_or(
    request: JoinHandle<std::result::Result<serde_json::Value, CallError>>,
    e: anyhow::Error,
) -> anyhow::Error {
    if request.is_finished() {
        if let Ok(Err(r)) = request.join() {
            return anyhow!("the running udrive refused the handover: {r}");
        }
    }
    e
}

/// Tests make the takeover die at a step (`UDRIVE_TAKEOVER_DIE_AT=receive|start|
/// confirm`) to check that the running process rolls back.
pub fn fail_point(step: &str) {
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
    request: &JoinHandle<std::result::Result<serde_json::Value, CallError>>,
) -> Result<OwnedFd> {
    let until = Instant::now() + limit;
    loop {
        let mut fds = [nix::poll::PollFd::new(
            l.fd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(50u16)).unwrap_or(0) > 0 {
            return lifecycle::fdpass::accept(l.fd.as_fd()).context("takeover: accept failed");
        }
        if request.is_finished() {
            bail!("the running udrive answered without connecting");
        }
        if Instant::now() >= until {
            bail!("the running udrive did not connect within {limit:?}");
        }
    }
}

fn receive(conn: &OwnedFd) -> Result<KeptRecords> {
    // Zeroed when dropped: secrets pass through it.
    let mut buf = zeroize::Zeroizing::new(vec![0u8; channel::MAX_MSG]);
    let mut out = KeptRecords::new();
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
        match channel::recv(conn.as_fd(), &mut buf).context("takeover: receiving")? {
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
