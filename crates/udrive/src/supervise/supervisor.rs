//! The supervisor: starts `udrive serve … --supervised` with a channel as its stdin,
//! stores the records the child sends, restarts the child when it dies and replays
//! the records to the new one. Signals (SIGINT, SIGTERM) go to the child; the
//! supervisor exits when the child exits by itself or was told to.

use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
use nix::unistd::Pid;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use lifecycle::channel::{self as wire, Op};

use lifecycle::RecordStore;

/// A child that ran this long before dying is restarted at once, and so is the
/// first one that died sooner; further quick deaths in a row back off (100 ms,
/// doubling, up to `MAX_BACKOFF`): a crash loop must not eat the host.
const STABLE: Duration = Duration::from_secs(10);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// `STABLE`, or `UDRIVE_SUPERVISE_STABLE_MS` (benchmarks kill more often).
fn stable() -> Duration {
    std::env::var("UDRIVE_SUPERVISE_STABLE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(STABLE, Duration::from_millis)
}

/// Runs udrive with `args` (its command line without the program and
/// `--supervise`; `serve` is the subcommand) under supervision until it exits or a
/// signal stops it.
pub fn run(args: Vec<OsString>) -> Result<()> {
    let exe = std::env::current_exe().context("supervise: cannot find udrive's own binary")?;
    let store: Arc<RecordStore> = Arc::default();
    let child_pid = Arc::new(AtomicI32::new(0));
    let stopping = Arc::new(AtomicBool::new(false));
    let mut signals = Signals::new([SIGINT, SIGTERM]).context("cannot install signal handlers")?;
    {
        let (pid, stopping) = (child_pid.clone(), stopping.clone());
        std::thread::Builder::new()
            .name("supervise-sig".into())
            .spawn(move || {
                for sig in signals.forever() {
                    stopping.store(true, Ordering::SeqCst);
                    forward(&pid, sig);
                }
            })
            .context("cannot start the signal thread")?;
    }
    let mut quick_deaths = 0u32;
    let mut generation = 0u32;
    loop {
        generation += 1;
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .context("supervise: cannot create the channel to the server")?;
        let mut child = Command::new(&exe)
            .args(&args)
            .arg("--supervised")
            .stdin(Stdio::from(theirs))
            .spawn()
            .with_context(|| format!("supervise: cannot start {}", exe.display()))?;
        child_pid.store(child.id() as i32, Ordering::SeqCst);
        if stopping.load(Ordering::SeqCst) {
            forward(&child_pid, SIGTERM);
        }
        eprintln!(
            "udrive: supervising the server (pid {}, start {generation}); NVMe clients stay \
             connected if it dies",
            child.id()
        );
        let ready = Arc::new(AtomicBool::new(false));
        let keeper = {
            let (store, ready) = (store.clone(), ready.clone());
            std::thread::Builder::new()
                .name("supervise-keep".into())
                .spawn(move || keep(ours, &store, &ready))
                .context("cannot start the keeper thread")?
        };
        let started = Instant::now();
        let status = child.wait().context("supervise: waiting for the server")?;
        child_pid.store(0, Ordering::SeqCst);
        // Ends at the channel's end of stream: the child and its copy are gone.
        let _ = keeper.join();
        if stopping.load(Ordering::SeqCst) || status.success() {
            return exit_with(status);
        }
        if !ready.load(Ordering::SeqCst) {
            bail!(
                "the server exited before it was ready ({}); not restarting it",
                describe(status)
            );
        }
        let kept = store.len();
        if started.elapsed() >= stable() {
            quick_deaths = 0;
        } else {
            quick_deaths += 1;
        }
        let backoff = match quick_deaths {
            0 | 1 => Duration::ZERO,
            k => (Duration::from_millis(100) * 2u32.pow(k.min(8) - 2)).min(MAX_BACKOFF),
        };
        eprintln!(
            "udrive: the server died ({}); restarting it in {backoff:?} with {kept} kept records",
            describe(status)
        );
        std::thread::sleep(backoff);
        if stopping.load(Ordering::SeqCst) {
            return Ok(());
        }
    }
}

fn forward(pid: &AtomicI32, sig: i32) {
    let p = pid.load(Ordering::SeqCst);
    if p > 0 {
        if let Ok(s) = Signal::try_from(sig) {
            let _ = kill(Pid::from_raw(p), s);
        }
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => match Signal::try_from(s) {
            Ok(sig) => format!("killed by {sig}"),
            Err(_) => format!("killed by signal {s}"),
        },
        _ => status.to_string(),
    }
}

fn exit_with(status: ExitStatus) -> Result<()> {
    if status.success() {
        Ok(())
    } else {
        bail!("the server stopped: {}", describe(status))
    }
}

/// Serves one child's channel until it closes.
fn keep(sock: OwnedFd, store: &RecordStore, ready: &AtomicBool) {
    let mut buf = vec![0u8; wire::MAX_MSG];
    loop {
        let m = match wire::recv(sock.as_fd(), &mut buf) {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                // A confused child: its records stay as they were.
                tracing::warn!("supervise: bad message from the server: {e}");
                continue;
            }
        };
        match m.op {
            Op::Put => store.insert(m.key, m.bytes, m.fds),
            Op::Remove => store.remove_prefix(&m.key),
            Op::Hello => {
                if let Err(e) = wire::send_all(sock.as_fd(), store) {
                    tracing::warn!("supervise: cannot hand the records to the server: {e}");
                }
            }
            Op::Ready => ready.store(true, Ordering::SeqCst),
            _ => {
                tracing::warn!("supervise: unexpected {:?} from the server", m.op);
            }
        }
    }
}
