//! The listening control socket: accepting, one thread per connection, framing
//! and deadlines (see the module documentation of `crate::rpc`).

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::api::{error_reply, Rpc, INVALID_REQUEST, PARSE_ERROR, SERVER_ERROR};
use crate::framing::{Framer, Push};

/// Largest request message (one object or one batch).
pub const MAX_MESSAGE: usize = 1 << 20;
/// Connections served at once; more are answered with an error and closed.
pub const MAX_CONNECTIONS: usize = 64;
/// A connection with no complete message for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The listening control socket.
pub struct RpcServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    /// Written on drop: wakes the accepting thread without going through `path`,
    /// which may be gone (its directory removed) or served by a successor.
    wake: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl RpcServer {
    /// Binds `path` with file mode `mode` (refusing a path a live process serves,
    /// replacing a stale socket) and starts accepting.
    pub fn start(path: &Path, mode: u32, rpc: Arc<Rpc>) -> io::Result<RpcServer> {
        let listener = sockfile::bind(path, sockfile::SocketAccess { mode, gid: None })?;
        Self::start_on(path, listener, rpc)
    }

    /// Accepts on `listener`, bound to `path` (by this process or one it took over from).
    pub fn start_on(path: &Path, listener: UnixListener, rpc: Arc<Rpc>) -> io::Result<RpcServer> {
        // Kept with the process's records: a handover passes it on.
        rpc.server.process().keep_listener(
            crate::process::RPC_LISTENER_KEY,
            path.as_os_str().as_encoded_bytes(),
            &listener,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let (wake, woken) = UnixStream::pair()?;
        let thread = sandbox::spawn(sandbox::Role::Control, "rpc-accept".into(), move || {
            accept_loop(listener, rpc, stop2, woken)
        });
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        Ok(RpcServer {
            path: path.to_path_buf(),
            stop,
            wake,
            thread: Some(thread),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = (&self.wake).write_all(&[1]);
        // An accept already past the poll (its client gave up in between) waits
        // for the next connection: give it one, if the path is still ours.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Waits until `listener` has a connection to accept (true) or `woken` is
/// written: the server stops (false).
fn connection_waiting(listener: &UnixListener, woken: &UnixStream) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    loop {
        let mut fds = [
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
            PollFd::new(woken.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Err(nix::errno::Errno::EINTR) => continue,
            // accept reports what is wrong with the listener.
            Err(_) => return true,
            Ok(_) => return fds[1].revents().is_none_or(|r| r.is_empty()),
        }
    }
}

fn accept_loop(listener: UnixListener, rpc: Arc<Rpc>, stop: Arc<AtomicBool>, woken: UnixStream) {
    let table = Arc::new(ConnTable::new());
    let log = trace::LogLimiter::new();
    loop {
        if !connection_waiting(&listener, &woken) || stop.load(Ordering::Acquire) {
            return;
        }
        let conn = listener.accept().map(|(s, _)| s);
        let mut s = match conn {
            Ok(s) => s,
            Err(e) => {
                // EMFILE repeats every 10 ms until a descriptor frees up.
                trace::limited!(
                    log,
                    warn,
                    "rpc: accept failed: {e} (out of file descriptors? raise `ulimit -n`)"
                );
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Some(slot) = table.admit(&s) else {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let e = error_reply(
                Value::Null,
                SERVER_ERROR,
                &format!(
                    "too many control connections busy with requests (limit {MAX_CONNECTIONS}); try again"
                ),
            );
            let _ = s.write_all(format!("{e}\n").as_bytes());
            continue;
        };
        let (rpc, table2) = (rpc.clone(), table.clone());
        let spawned = sandbox::spawn(sandbox::Role::Control, "rpc-conn".into(), move || {
            serve_connection(s, &rpc, &table2, &slot);
            table2.leave(&slot);
        });
        if let Err(e) = spawned {
            tracing::warn!("rpc: cannot start a connection thread: {e}");
        }
    }
}

/// What a control connection is doing, for choosing one to close when all slots
/// are taken.
#[derive(Debug)]
struct ConnSlot {
    id: u64,
    stream: Option<UnixStream>,
    /// A handler is running for it: never evicted.
    busy: AtomicBool,
    /// When it last completed a message or connected (ms since the table began).
    last: AtomicU64,
}

/// The open control connections. A flood of idle or slow connections must not lock
/// the operator out: when all `MAX_CONNECTIONS` slots are taken, a new connection
/// closes the one that has been waiting longest without a request running (a slow
/// sender mid-message counts as waiting), and is refused only if every slot is
/// busy running a request. The per-message deadline and the idle timeout bound how
/// long any connection holds a slot anyway.
struct ConnTable {
    conns: std::sync::Mutex<Vec<Arc<ConnSlot>>>,
    next: AtomicU64,
    /// Where the connections' `last` times count from.
    epoch: Instant,
}

impl ConnTable {
    fn new() -> ConnTable {
        ConnTable {
            conns: Default::default(),
            next: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Milliseconds since the table began.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn admit(&self, s: &UnixStream) -> Option<Arc<ConnSlot>> {
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if conns.len() >= MAX_CONNECTIONS {
            let victim = conns
                .iter()
                .filter(|c| !c.busy.load(Ordering::Acquire))
                .min_by_key(|c| c.last.load(Ordering::Relaxed))?
                .clone();
            tracing::info!(
                "rpc: {MAX_CONNECTIONS} control connections open; closing the longest idle one"
            );
            if let Some(v) = &victim.stream {
                let _ = v.shutdown(std::net::Shutdown::Both);
            }
            conns.retain(|c| c.id != victim.id);
        }
        let slot = Arc::new(ConnSlot {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            stream: s.try_clone().ok(),
            busy: AtomicBool::new(false),
            last: AtomicU64::new(self.now_ms()),
        });
        conns.push(slot.clone());
        Some(slot)
    }

    fn leave(&self, slot: &ConnSlot) {
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|c| c.id != slot.id);
    }
}

fn send(s: &mut UnixStream, v: &Value) -> io::Result<()> {
    let mut out = serde_json::to_vec(v).map_err(io::Error::other)?;
    out.push(b'\n');
    s.write_all(&out)
}

fn serve_connection(mut s: UnixStream, rpc: &Rpc, table: &ConnTable, slot: &ConnSlot) {
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    let mut framer = Framer::new(MAX_MESSAGE);
    let mut buf = vec![0u8; 64 << 10];
    // Between messages a connection may idle for IDLE_TIMEOUT; once a message has
    // started it must be complete within the message deadline.
    let mut deadline: Option<std::time::Instant> = None;
    loop {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(std::time::Instant::now()),
            None => IDLE_TIMEOUT,
        };
        if wait.is_zero() || s.set_read_timeout(Some(wait)).is_err() {
            return;
        }
        let n = match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut at = 0;
        while at < n {
            let (used, push) = framer.push(&buf[at..n]);
            at += used;
            if framer.in_message() && deadline.is_none() {
                deadline = Some(std::time::Instant::now() + sockfile::message_deadline());
            }
            let reply = match push {
                Push::More => continue,
                Push::Message(msg) => {
                    deadline = None;
                    slot.busy.store(true, Ordering::Release);
                    let r = rpc.handle_message(&msg);
                    slot.last.store(table.now_ms(), Ordering::Relaxed);
                    slot.busy.store(false, Ordering::Release);
                    r
                }
                Push::TooLarge => {
                    let e = error_reply(
                        Value::Null,
                        INVALID_REQUEST,
                        &format!("message larger than {MAX_MESSAGE} bytes; connection closed"),
                    );
                    let _ = send(&mut s, &e);
                    return;
                }
                Push::Junk(b) => {
                    let e = error_reply(
                        Value::Null,
                        PARSE_ERROR,
                        &format!(
                            "malformed JSON: byte {:?} cannot start a request (expected {{ or [); connection closed",
                            char::from(b)
                        ),
                    );
                    let _ = send(&mut s, &e);
                    return;
                }
            };
            if let Some(r) = reply {
                if send(&mut s, &r).is_err() {
                    return;
                }
            }
            // A handover just completed: the new process serves everything.
            rpc.server.process().exit_if_handed_over();
        }
    }
}
