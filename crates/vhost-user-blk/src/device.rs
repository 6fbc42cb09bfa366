//! A running vhost-user-blk device: socket, connections, and its queue pollers.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use arc_swap::ArcSwap;
use bdev::BlockDevice;
use engine::{Engine, PollMode, PollerId};
use trace::{Mailbox, TraceControl};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use virtio_blk::{BlkConfig, DeviceOptions, QueueWorker};

use crate::backend::{BlkBackend, ConfigNotice, Conn, QueueCtl, Shared};
use crate::poller::VirtqPoller;

/// How a device is set up.
#[derive(Clone, Debug, Default)]
pub struct BlkDeviceOptions {
    pub device: DeviceOptions,
    pub poll: PollMode,
    /// Mode and group of the socket file (default: owner only).
    pub access: sockfile::SocketAccess,
}

pub struct VhostUserBlk {
    pub socket: PathBuf,
    engine: Arc<Engine>,
    pollers: Vec<PollerId>,
    stop: Arc<AtomicBool>,
    conn_handle: Arc<Mutex<Option<ShutdownHandle>>>,
    thread: Option<JoinHandle<()>>,
    connections: Arc<ConnCounts>,
    /// Trace switch of all the device's virtqueues.
    pub(crate) trace: Arc<TraceControl>,
    /// Per virtqueue, in queue order: where its poller leaves snapshots.
    pub(crate) mailboxes: Vec<Arc<Mailbox>>,
    pub(crate) shared: Arc<Shared>,
}

/// How long a disconnect waits for in-flight requests before letting a new front
/// end in.
const DISCONNECT_DRAIN: Duration = Duration::from_secs(30);

/// How long a resize waits for the queues to switch to the new disk handle.
const SWITCH_LIMIT: Duration = Duration::from_secs(10);

impl VhostUserBlk {
    /// Listens on `socket` and serves `disk`; queue `i` is polled by reactor
    /// `reactors[i % reactors.len()]`.
    pub fn start(
        socket: &Path,
        disk: Arc<dyn BlockDevice>,
        opts: BlkDeviceOptions,
        engine: &Arc<Engine>,
        reactors: &[usize],
    ) -> io::Result<VhostUserBlk> {
        let nq = usize::from(opts.device.num_queues);
        if nq == 0 || opts.device.queue_size == 0 || reactors.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a vhost-user-blk device needs at least one queue, a queue size and a reactor",
            ));
        }
        let cfg = Arc::new(BlkConfig::new(opts.device.clone(), disk.info().clone()));
        let mut queues = Vec::with_capacity(nq);
        for i in 0..nq {
            let r = reactors[i % reactors.len()];
            let waker = engine.waker(r).ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("no reactor {r}"))
            })?;
            queues.push(QueueCtl {
                conn: Mutex::new(None),
                gen: AtomicU64::new(0),
                in_flight: AtomicUsize::new(0),
                stops: AtomicU64::new(0),
                waker: ArcSwap::from_pointee(waker),
                next_disk: Mutex::new(None),
                disk_gen: AtomicU64::new(0),
            });
        }
        let shared = Arc::new(Shared {
            cfg,
            queues,
            front: Mutex::new(None),
            poll: engine::AtomicPollMode::new(opts.poll),
            log: Arc::new(trace::LogLimiter::new()),
        });
        let mut listener = Listener::from(sockfile::bind(socket, opts.access).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot listen on {}: {e}", socket.display()),
            )
        })?);

        let trace = Arc::new(TraceControl::default());
        let mut mailboxes = Vec::with_capacity(nq);
        let mut pollers = Vec::with_capacity(nq);
        for i in 0..nq {
            let worker =
                QueueWorker::traced(shared.cfg.clone(), disk.channel()?, i as u16, trace.clone());
            mailboxes.push(worker.mailbox());
            let p = VirtqPoller::new(i, shared.clone(), worker);
            let r = reactors[i % reactors.len()];
            match engine.add_poller(r, Box::new(p)) {
                Ok(id) => pollers.push(id),
                Err(e) => {
                    for id in pollers {
                        let _ = engine.remove_poller(id);
                    }
                    let _ = std::fs::remove_file(socket);
                    return Err(io::Error::other(e));
                }
            }
        }

        let stop = Arc::new(AtomicBool::new(false));
        let conn_handle = Arc::new(Mutex::new(None));
        let connections = Arc::new(ConnCounts::default());
        let (stop2, handle2, count2, sock2) = (
            stop.clone(),
            conn_handle.clone(),
            connections.clone(),
            socket.to_path_buf(),
        );
        let shared2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name("vhost-blk".into())
            .spawn(move || serve(&mut listener, shared2, &stop2, &handle2, &count2, &sock2))?;
        Ok(VhostUserBlk {
            socket: socket.to_path_buf(),
            engine: engine.clone(),
            pollers,
            stop,
            conn_handle,
            thread: Some(thread),
            connections,
            trace,
            mailboxes,
            shared,
        })
    }

    /// Whether a front end is connected now.
    pub fn connected(&self) -> bool {
        lock(&self.conn_handle).is_some()
    }

    /// How the device's queues wait for work now.
    pub fn poll_mode(&self) -> PollMode {
        self.shared.poll_mode()
    }

    /// Changes how the queues wait for work, while they run: the pollers report
    /// the new mode the next time their reactor asks (on a message, and every few
    /// thousand iterations); sleeping reactors are woken so they ask now. Busy
    /// pollers turn guest notifications off again at their next poll.
    pub fn set_poll_mode(&self, mode: PollMode) {
        self.shared.set_poll_mode(mode);
        for q in &self.shared.queues {
            q.waker.load().wake();
        }
    }

    /// Moves virtqueue `i`'s poller to reactor `reactors[i % reactors.len()]`, while
    /// the device runs: each poller is taken off its reactor between two polls
    /// (with its requests in flight, which complete on the new one), its kicks are
    /// pointed at the new reactor, and it is handed over. Checks every reactor
    /// first; on an error nothing has moved unless the engine is shutting down.
    pub fn move_queues(&mut self, reactors: &[usize]) -> io::Result<()> {
        if reactors.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no reactor to move the queues to",
            ));
        }
        let mut wakers = Vec::with_capacity(self.pollers.len());
        for i in 0..self.pollers.len() {
            let r = reactors[i % reactors.len()];
            let w = self.engine.waker(r).ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("no reactor {r}"))
            })?;
            wakers.push((r, w));
        }
        for (i, (r, w)) in wakers.into_iter().enumerate() {
            let id = self.pollers[i];
            if id.reactor == r {
                continue;
            }
            let p = self
                .engine
                .remove_poller(id)
                .map_err(io::Error::other)?
                .ok_or_else(|| {
                    io::Error::other(format!("queue {i} is not on reactor {}", id.reactor))
                })?;
            // A kick in between wakes the old reactor; the new one checks the ring
            // on its first poll.
            self.shared.queues[i].waker.store(Arc::new(w));
            self.pollers[i] = self.engine.add_poller(r, p).map_err(io::Error::other)?;
        }
        Ok(())
    }

    /// Serves `disk`, a resized handle of the device's disk (the same data at
    /// another size, same block size), while the front end runs
    /// (docs/decisions/0018-online-resize.md): each queue's poller switches to a
    /// channel on it once nothing is in flight on the old one (taking no new chain
    /// meanwhile), then the config space reports the new capacity and the front
    /// end is told (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG). The answer says whether
    /// it was. Fails, changing nothing, if a channel cannot be opened or the block
    /// size differs.
    pub fn resize(&self, disk: Arc<dyn BlockDevice>) -> io::Result<ConfigNotice> {
        let info = disk.info().clone();
        if info.block_size != self.shared.cfg.info.block_size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the resized disk has {}-byte blocks, the device {}",
                    info.block_size, self.shared.cfg.info.block_size
                ),
            ));
        }
        let mut chans = Vec::with_capacity(self.shared.queues.len());
        for _ in &self.shared.queues {
            chans.push(disk.channel()?);
        }
        for (q, chan) in self.shared.queues.iter().zip(chans) {
            *lock(&q.next_disk) = Some((chan, info.clone()));
            q.disk_gen.fetch_add(1, Ordering::AcqRel);
            q.waker.load().wake();
        }
        let switched = engine::wait_until(SWITCH_LIMIT, Duration::from_micros(200), || {
            let mut all = true;
            for q in &self.shared.queues {
                if lock(&q.next_disk).is_some() {
                    all = false;
                    q.waker.load().wake();
                }
            }
            all
        });
        if !switched {
            // They take no new chain until they switch: no request sees the old size.
            tracing::warn!(
                socket = %self.socket.display(),
                "queues still finishing requests on the old disk after {SWITCH_LIMIT:?}; they switch when those complete"
            );
        }
        self.shared.cfg.set_capacity(info.size_bytes());
        let front = lock(&self.shared.front).clone();
        Ok(match front {
            Some(conn) => conn.config_changed(),
            None => ConfigNotice::NoFrontEnd,
        })
    }

    /// The capacity the config space reports, in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.shared.cfg.capacity_bytes()
    }

    /// The reactor of each virtqueue's poller, in queue order.
    pub fn queue_reactors(&self) -> Vec<usize> {
        self.pollers.iter().map(|p| p.reactor).collect()
    }

    /// Virtqueues the device offers.
    pub fn num_queues(&self) -> usize {
        self.mailboxes.len()
    }

    /// Front ends that have connected so far.
    pub fn connections(&self) -> u64 {
        self.connections.started.load(Ordering::Relaxed)
    }

    /// Front ends whose connection has ended and whose requests have finished
    /// (what a reconnecting front end may then read from the used rings is final).
    pub fn disconnections(&self) -> u64 {
        self.connections.ended.load(Ordering::Relaxed)
    }

    /// Disconnects the front end (after in-flight requests complete), closes the
    /// socket and takes the pollers off their reactors.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = lock(&self.conn_handle).as_ref() {
            h.shutdown();
        }
        // Unblocks a thread waiting in accept().
        let _ = UnixStream::connect(&self.socket);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for id in self.pollers.drain(..) {
            let _ = self.engine.remove_poller(id);
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Drop for VhostUserBlk {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop_inner();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Connections accepted and connections ended (after their requests finished).
#[derive(Default)]
struct ConnCounts {
    started: AtomicU64,
    ended: AtomicU64,
}

/// Serves one front end at a time, each with a fresh vhost-user-backend daemon (its
/// handler keeps per-connection state such as ownership that must not leak into
/// the next connection).
fn serve(
    listener: &mut Listener,
    shared: Arc<Shared>,
    stop: &AtomicBool,
    handle: &Mutex<Option<ShutdownHandle>>,
    count: &ConnCounts,
    socket: &Path,
) {
    while !stop.load(Ordering::SeqCst) {
        let conn = match Conn::new(shared.log.clone()) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tracing::error!(socket = %socket.display(), error = %e, "cannot set up a vhost-user connection");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let backend = BlkBackend {
            shared: shared.clone(),
            conn: conn.clone(),
        };
        let mut daemon = match VhostUserDaemon::new("vhost-blk".into(), backend, conn.mem.clone()) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(socket = %socket.display(), error = ?e, "cannot set up vhost-user handler");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let front = match listener.accept() {
            Ok(Some(s)) => s,
            Ok(None) => continue,
            Err(e) => {
                let e = match e {
                    vhost::vhost_user::Error::SocketError(e) => e,
                    e => io::Error::other(e),
                };
                crate::fd_limit::report(&format!("a connection on {}", socket.display()), &e);
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        *lock(&conn.front) = front.try_clone().ok();
        *lock(&shared.front) = Some(conn.clone());
        // vhost-user-backend's handler sits behind our relay (see proxy.rs), reached
        // over a private socket.
        let relay = match inner_pair().and_then(|(mut inner, back, dir)| {
            daemon
                .start(&mut inner)
                // vhost-user-backend's error is not a std error (it may hold a
                // thread's panic payload): keep its text.
                .map_err(|e| io::Error::other(e.to_string()))?;
            drop(dir);
            let c = conn.clone();
            std::thread::Builder::new()
                .name("vhost-blk-proxy".into())
                .spawn(move || crate::proxy::run(front, back, c))
        }) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(socket = %socket.display(), error = %e, "cannot set up the vhost-user relay");
                continue;
            }
        };
        if stop.load(Ordering::SeqCst) {
            daemon.request_shutdown();
        } else {
            count.started.fetch_add(1, Ordering::Relaxed);
            trace::limited!(shared.log, info, socket = %socket.display(), "vhost-user front end connected");
        }
        *lock(handle) = daemon.shutdown_handle();
        if let Err(e) = daemon.wait() {
            trace::limited!(shared.log, info, socket = %socket.display(), error = ?e, "vhost-user connection ended with an error");
        }
        *lock(handle) = None;
        *lock(&shared.front) = None;
        let _ = relay.join();
        // Requests taken from this connection's rings finish (their memory stays
        // mapped while they do) before the pollers let go of the vrings.
        for q in &shared.queues {
            q.attach(None);
        }
        for q in &shared.queues {
            q.drain(DISCONNECT_DRAIN);
        }
        drop(daemon);
        count.ended.fetch_add(1, Ordering::Relaxed);
        trace::limited!(shared.log, info, socket = %socket.display(), "vhost-user front end disconnected");
    }
}

/// A listener on a fresh private socket and a stream already connected to it. The
/// socket lives in a new 0700 directory (an abstract socket could be reached, and
/// raced, by any local user) that is removed once the daemon has accepted.
fn inner_pair() -> io::Result<(Listener, UnixStream, PrivateDir)> {
    use std::os::unix::fs::DirBuilderExt;
    use std::os::unix::net::UnixListener;
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "udrive-vhost-blk-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let dir = PrivateDir(dir);
    let path = dir.0.join("s");
    let l = UnixListener::bind(&path)?;
    let s = UnixStream::connect(&path)?;
    Ok((Listener::from(l), s, dir))
}

/// Removes the relay's socket directory when dropped.
struct PrivateDir(PathBuf);

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
