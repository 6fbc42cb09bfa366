//! A running vhost-user-blk device: socket, connections, and its queue pollers.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bdev::BlockDevice;
use engine::{Engine, PollMode, PollerId};
use trace::{Mailbox, TraceControl};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use virtio_blk::{BlkConfig, DeviceOptions, QueueWorker};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::backend::{BlkBackend, ConfigNotice, Conn, QueueCtl, Shared, PAUSED};
use crate::handover::{
    replay_messages, ConnRecord, ConnectionState, FdTaker, HandoverState, HANDOVER_VERSION,
};
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
    serve: Arc<ServeCtl>,
    conn_handle: Arc<Mutex<Option<ShutdownHandle>>>,
    thread: Option<JoinHandle<()>>,
    connections: Arc<ConnCounts>,
    /// Trace switch of all the device's virtqueues.
    pub(crate) trace: Arc<TraceControl>,
    /// Per virtqueue, in queue order: where its poller leaves snapshots.
    pub(crate) mailboxes: Vec<Arc<Mailbox>>,
    pub(crate) shared: Arc<Shared>,
    /// A copy of the listening socket (handed over with [`VhostUserBlk::export`]).
    listener: UnixListener,
    /// Where a handover stands.
    handover: Mutex<Handover>,
}

/// A device's part in a handover.
#[derive(Default)]
struct Handover {
    /// Quiesced: the queues take no new chains, the relay (if a front end is
    /// connected) is parked, and no new front end is accepted.
    quiesced: bool,
    /// The parked connection.
    conn: Option<Arc<Conn>>,
    /// Exported while quiesced: stopping the device now leaves the front end's
    /// socket and the socket path to the device that took them.
    exported: bool,
}

/// How long a disconnect waits for in-flight requests before letting a new front
/// end in.
const DISCONNECT_DRAIN: Duration = Duration::from_secs(30);

/// How long a resize waits for the queues to switch to the new disk handle.
const SWITCH_LIMIT: Duration = Duration::from_secs(10);

/// The parts of a device that exist before it serves anyone.
struct Parts {
    shared: Arc<Shared>,
    trace: Arc<TraceControl>,
    mailboxes: Vec<Arc<Mailbox>>,
    pollers: Vec<PollerId>,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

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
        check_opts(&opts, reactors)?;
        let listener = sockfile::bind(socket, opts.access).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot listen on {}: {e}", socket.display()),
            )
        })?;
        Self::start_on(listener, socket, disk, opts, engine, reactors).inspect_err(|_| {
            let _ = std::fs::remove_file(socket);
        })
    }

    /// As [`start`](Self::start), on a listening socket already bound at `socket`
    /// (inherited from another process, e.g. in a handover): the path is neither
    /// unlinked nor bound again here. [`stop`](Self::stop) removes it as usual.
    pub fn start_on(
        listener: UnixListener,
        socket: &Path,
        disk: Arc<dyn BlockDevice>,
        opts: BlkDeviceOptions,
        engine: &Arc<Engine>,
        reactors: &[usize],
    ) -> io::Result<VhostUserBlk> {
        check_opts(&opts, reactors)?;
        let parts = Parts::new(&disk, &opts, engine, reactors, false)?;
        Self::launch(listener, socket, parts, engine, None, false)
    }

    /// Starts a device that takes over a front end from a device in another
    /// process (or this one), without a reconnect: `state` and `fds` are what
    /// [`export`](Self::export) gave there (the listening socket among the fds).
    /// The front end's state is replayed to this device's vhost-user handler (each
    /// vring continuing at the index the old device stopped at).
    ///
    /// The device starts **quiesced**, a two-phase commit: its queues take
    /// nothing, it reads nothing from the front end's socket and accepts no front
    /// end. The caller then stops the old device (the commit point; its kick
    /// workers and pollers are gone) and calls [`unquiesce`](Self::unquiesce)
    /// here: the front end's socket is relayed from where the old device stopped
    /// reading it. Until then, stopping or dropping this device hands everything
    /// back untouched and the old device can [`unquiesce`](Self::unquiesce).
    ///
    /// `state` and `fds` are checked like client input (counts, sizes, indices,
    /// every fd used exactly once, the vrings' indices against their used rings
    /// in guest memory); on any error nothing is left running and the front end's
    /// socket is untouched, so the old device can [`unquiesce`](Self::unquiesce).
    #[allow(clippy::too_many_arguments)]
    pub fn start_resumed(
        socket: &Path,
        disk: Arc<dyn BlockDevice>,
        opts: BlkDeviceOptions,
        engine: &Arc<Engine>,
        reactors: &[usize],
        state: HandoverState,
        fds: Vec<OwnedFd>,
    ) -> io::Result<VhostUserBlk> {
        check_opts(&opts, reactors)?;
        if state.version != HANDOVER_VERSION {
            return Err(invalid(format!(
                "handover state version {} (this device reads {HANDOVER_VERSION})",
                state.version
            )));
        }
        if state.num_queues != opts.device.num_queues || state.queue_size != opts.device.queue_size
        {
            return Err(invalid(format!(
                "the front end set up {} queues of up to {} entries; this device has {} of {}",
                state.num_queues, state.queue_size, opts.device.num_queues, opts.device.queue_size
            )));
        }
        if state.capacity_bytes != disk.info().size_bytes() {
            return Err(invalid(format!(
                "the front end saw {} bytes; this disk has {}",
                state.capacity_bytes,
                disk.info().size_bytes()
            )));
        }
        let mut taker = FdTaker::new(fds);
        let listener = UnixListener::from(OwnedFd::from(taker.take(state.listener_fd)?));
        let conn = match state.connection {
            Some(c) => {
                c.record.validate(state.num_queues, state.queue_size)?;
                let front = taker.take(c.front_fd)?;
                let bases: Vec<Option<u32>> = c.record.vrings.iter().map(|v| v.base).collect();
                let record = c.record.map_fds(&mut |i| taker.take(i))?;
                Some((front, record, bases))
            }
            None => None,
        };
        taker.finish()?;
        for (what, f) in [("listening socket", Some(listener.as_fd()))]
            .into_iter()
            .chain([("front end's socket", conn.as_ref().map(|c| c.0.as_fd()))])
        {
            if let Some(f) = f {
                use std::os::unix::fs::FileTypeExt;
                let t = File::from(f.try_clone_to_owned()?).metadata()?.file_type();
                if !t.is_socket() {
                    return Err(invalid(format!("the {what} handed over is not a socket")));
                }
            }
        }
        // The queues stay paused until the replay is done and checked: on an error
        // they must not have taken anything the old device would take again.
        let parts = Parts::new(&disk, &opts, engine, reactors, true)?;
        let first = match conn {
            None => None,
            Some((front, record, bases)) => {
                let front = UnixStream::from(OwnedFd::from(front));
                match resume_connection(&parts.shared, front, record, &bases) {
                    Ok(est) => Some(est),
                    Err(e) => {
                        parts.remove(engine);
                        return Err(e);
                    }
                }
            }
        };
        let conn = first.as_ref().map(|e| e.conn.clone());
        let dev = Self::launch(listener, socket, parts, engine, first, true)?;
        // Quiesced, and its front end (socket path, connection) still the old
        // device's: stopping it now hands them back.
        *lock(&dev.handover) = Handover {
            quiesced: true,
            conn,
            exported: true,
        };
        Ok(dev)
    }

    fn launch(
        listener: UnixListener,
        socket: &Path,
        parts: Parts,
        engine: &Arc<Engine>,
        first: Option<Established>,
        held: bool,
    ) -> io::Result<VhostUserBlk> {
        let Parts {
            shared,
            trace,
            mailboxes,
            pollers,
        } = parts;
        let fail = |e: io::Error, pollers: &[PollerId]| {
            for id in pollers {
                let _ = engine.remove_poller(*id);
            }
            e
        };
        let serve_ctl = match ServeCtl::new(held) {
            Ok(s) => Arc::new(s),
            Err(e) => return Err(fail(e, &pollers)),
        };
        let copy = match listener.try_clone() {
            Ok(c) => c,
            Err(e) => return Err(fail(e, &pollers)),
        };
        if let Err(e) = listener.set_nonblocking(true) {
            return Err(fail(e, &pollers));
        }
        let conn_handle = Arc::new(Mutex::new(None));
        let connections = Arc::new(ConnCounts::default());
        let (ctl2, handle2, count2, sock2) = (
            serve_ctl.clone(),
            conn_handle.clone(),
            connections.clone(),
            socket.to_path_buf(),
        );
        let shared2 = shared.clone();
        let thread = match std::thread::Builder::new()
            .name("vhost-blk".into())
            .spawn(move || serve(listener, shared2, &ctl2, &handle2, &count2, &sock2, first))
        {
            Ok(t) => t,
            Err(e) => return Err(fail(e, &pollers)),
        };
        Ok(VhostUserBlk {
            socket: socket.to_path_buf(),
            engine: engine.clone(),
            pollers,
            serve: serve_ctl,
            conn_handle,
            thread: Some(thread),
            connections,
            trace,
            mailboxes,
            shared,
            listener: copy,
            handover: Mutex::new(Handover::default()),
        })
    }

    /// Stops the device for a handover, within `timeout`: no new front end is
    /// accepted; the connected front end's socket is no longer read (at a message
    /// boundary, once vhost-user-backend has answered everything relayed so far)
    /// and its rings' kicks are no longer polled; the queues take no new chains and
    /// complete those they took (on the used ring, the guest signalled). The guest
    /// sees a pause. On an error (the timeout, a front end whose rings cannot be
    /// stopped: one that did not negotiate PROTOCOL_FEATURES) the device runs on
    /// as before. Quiescing a quiesced device does nothing.
    ///
    /// The I/O path pays nothing for this: the pause is a bit in the generation
    /// counter each poll loads anyway.
    pub fn quiesce(&self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut h = lock(&self.handover);
        if h.quiesced {
            return Ok(());
        }
        let conn = match self.hold_front_end(deadline) {
            Ok(c) => c,
            Err(e) => {
                self.serve.hold(false);
                return Err(e);
            }
        };
        h.quiesced = true;
        h.conn = conn;
        h.exported = false;
        drop(h);
        for q in &self.shared.queues {
            // An acknowledgement of an earlier pause has the same value as this
            // one's (unquiesce only clears the bit): forget it, or a queue with a
            // request in flight would look drained.
            q.paused_ack.store(0, Ordering::Release);
            q.gen.fetch_or(PAUSED, Ordering::AcqRel);
            q.waker.load().wake();
        }
        let drained = engine::wait_until(
            deadline.saturating_duration_since(Instant::now()),
            Duration::from_micros(100),
            || {
                let mut all = true;
                for q in &self.shared.queues {
                    let gen = q.gen.load(Ordering::Acquire);
                    if q.paused_ack.load(Ordering::Acquire) != gen {
                        all = false;
                        q.waker.load().wake();
                    }
                }
                all
            },
        );
        if !drained {
            self.unquiesce();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("requests still in flight after {timeout:?}; the device runs on"),
            ));
        }
        Ok(())
    }

    /// Stops accepting front ends and parks the connected one's relay: returns that
    /// connection, if there is one.
    fn hold_front_end(&self, deadline: Instant) -> io::Result<Option<Arc<Conn>>> {
        self.serve.hold(true);
        loop {
            let phase = self.serve.wait_settled(deadline)?;
            match phase {
                ServePhase::Held => return Ok(None),
                ServePhase::Serving(conn) => match conn.relay.park(deadline) {
                    Ok(()) => return Ok(Some(conn)),
                    // Ending: the serve thread moves on to Held.
                    Err(e) if e.kind() == io::ErrorKind::NotConnected => {
                        self.serve.wait_left(&conn, deadline)?;
                    }
                    Err(e) => return Err(e),
                },
                _ => {
                    return Err(io::Error::other("the device has stopped"));
                }
            }
        }
    }

    /// Undoes [`quiesce`](Self::quiesce) (a handover that failed or was called off,
    /// before or after [`export`](Self::export)): the rings' kicks are polled again,
    /// the queues take chains again and the front end's socket is read from where
    /// it was left. On a device from [`start_resumed`](Self::start_resumed) it
    /// commits the handover: the device starts serving. Does nothing on a device
    /// that is not quiesced.
    pub fn unquiesce(&self) {
        let mut h = lock(&self.handover);
        if !h.quiesced {
            return;
        }
        for q in &self.shared.queues {
            q.gen.fetch_and(!PAUSED, Ordering::AcqRel);
            q.waker.load().wake();
        }
        if let Some(c) = h.conn.take() {
            c.relay.resume();
        }
        self.serve.hold(false);
        h.quiesced = false;
        h.exported = false;
    }

    /// Whether the device is quiesced ([`quiesce`](Self::quiesce)).
    pub fn quiesced(&self) -> bool {
        lock(&self.handover).quiesced
    }

    /// Describes the quiesced device for [`start_resumed`](Self::start_resumed) in
    /// another process: the state (serde, [`HANDOVER_VERSION`]) and copies of the
    /// fds it refers to by index — the listening socket; with a front end
    /// connected, its socket, memory region files, kick/call/err eventfds,
    /// inflight area and backend request channel. Each vring's `base` is the
    /// index it stopped at (its used index: nothing is in flight).
    ///
    /// Once exported, stopping or dropping this device leaves the front end's
    /// socket and the socket path alone (they belong to the new device), unless
    /// [`unquiesce`](Self::unquiesce) called the handover off. Fails if the device
    /// is not quiesced or the front end set up something a handover cannot
    /// reproduce (then unquiesce).
    pub fn export(&self) -> io::Result<(HandoverState, Vec<OwnedFd>)> {
        use vhost_user_backend::VringT;
        use virtio_queue::QueueT;
        let mut h = lock(&self.handover);
        if !h.quiesced {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "export needs a quiesced device",
            ));
        }
        let mut fds = vec![OwnedFd::from(self.listener.try_clone()?)];
        let connection = match &h.conn {
            None => None,
            Some(conn) => {
                let front = lock(&conn.front)
                    .as_ref()
                    .ok_or_else(|| io::Error::other("the connection has no socket"))?
                    .try_clone()?;
                fds.push(OwnedFd::from(front));
                let journal = conn.journal();
                if let Some(why) = &journal.unsupported {
                    return Err(io::Error::new(io::ErrorKind::Unsupported, why.clone()));
                }
                let mut record = journal.rec.export(&mut fds)?;
                drop(journal);
                // The handler's vrings know where each stopped (the pollers advanced
                // them past the front end's SET_VRING_BASE); before the first kick
                // handed them to us nothing was taken, and the recorded base holds.
                if let Some(vrings) = lock(&conn.vrings).as_ref() {
                    for (i, (rec, v)) in record.vrings.iter_mut().zip(vrings).enumerate() {
                        let st = v.get_ref();
                        let q = st.get_queue();
                        if q.ready() && q.next_avail() != q.next_used() {
                            return Err(io::Error::other(format!(
                                "vring {i}: {} requests still in flight",
                                q.next_avail().wrapping_sub(q.next_used())
                            )));
                        }
                        if q.ready() || rec.base.is_some() {
                            rec.base = Some(u32::from(q.next_avail()));
                        }
                    }
                }
                record.validate(
                    self.shared.cfg.opts.num_queues,
                    self.shared.cfg.opts.queue_size,
                )?;
                Some(ConnectionState {
                    front_fd: 1,
                    record,
                })
            }
        };
        h.exported = true;
        Ok((
            HandoverState {
                version: HANDOVER_VERSION,
                num_queues: self.shared.cfg.opts.num_queues,
                queue_size: self.shared.cfg.opts.queue_size,
                capacity_bytes: self.shared.cfg.capacity_bytes(),
                listener_fd: 0,
                connection,
            },
            fds,
        ))
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
    /// socket and takes the pollers off their reactors. After an
    /// [`export`](Self::export) (still quiesced) it leaves the front end connected
    /// and the socket path in place instead: another device serves them now.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let handed_over = {
            let mut h = lock(&self.handover);
            let out = h.quiesced && h.exported;
            if out {
                if let Some(c) = h.conn.take() {
                    c.relay.release();
                }
            }
            out
        };
        if !handed_over {
            self.unquiesce();
        }
        self.serve.stop();
        if let Some(h) = lock(&self.conn_handle).as_ref() {
            h.shutdown();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for id in self.pollers.drain(..) {
            let _ = self.engine.remove_poller(id);
        }
        if !handed_over {
            let _ = std::fs::remove_file(&self.socket);
        }
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

fn check_opts(opts: &BlkDeviceOptions, reactors: &[usize]) -> io::Result<()> {
    if opts.device.num_queues == 0 || opts.device.queue_size == 0 || reactors.is_empty() {
        return Err(invalid(
            "a vhost-user-blk device needs at least one queue, a queue size and a reactor".into(),
        ));
    }
    Ok(())
}

impl Parts {
    /// The device's shared state and its queue pollers, on their reactors.
    /// `paused`: the queues start quiesced (a resumed device, until its replay
    /// is checked).
    fn new(
        disk: &Arc<dyn BlockDevice>,
        opts: &BlkDeviceOptions,
        engine: &Arc<Engine>,
        reactors: &[usize],
        paused: bool,
    ) -> io::Result<Parts> {
        let nq = usize::from(opts.device.num_queues);
        let cfg = Arc::new(BlkConfig::new(opts.device.clone(), disk.info().clone()));
        let mut queues = Vec::with_capacity(nq);
        for i in 0..nq {
            let r = reactors[i % reactors.len()];
            let waker = engine
                .waker(r)
                .ok_or_else(|| invalid(format!("no reactor {r}")))?;
            queues.push(QueueCtl {
                conn: Mutex::new(None),
                gen: AtomicU64::new(if paused { PAUSED } else { 0 }),
                in_flight: AtomicUsize::new(0),
                stops: AtomicU64::new(0),
                waker: ArcSwap::from_pointee(waker),
                next_disk: Mutex::new(None),
                disk_gen: AtomicU64::new(0),
                paused_ack: AtomicU64::new(0),
            });
        }
        let shared = Arc::new(Shared {
            cfg,
            queues,
            front: Mutex::new(None),
            poll: engine::AtomicPollMode::new(opts.poll),
            log: Arc::new(trace::LogLimiter::new()),
        });
        let trace = Arc::new(TraceControl::default());
        let mut mailboxes = Vec::with_capacity(nq);
        let mut pollers = Vec::with_capacity(nq);
        for i in 0..nq {
            let chan = match disk.channel() {
                Ok(c) => c,
                Err(e) => {
                    for id in pollers {
                        let _ = engine.remove_poller(id);
                    }
                    return Err(e);
                }
            };
            let worker = QueueWorker::traced(shared.cfg.clone(), chan, i as u16, trace.clone());
            mailboxes.push(worker.mailbox());
            let p = VirtqPoller::new(i, shared.clone(), worker);
            let r = reactors[i % reactors.len()];
            match engine.add_poller(r, Box::new(p)) {
                Ok(id) => pollers.push(id),
                Err(e) => {
                    for id in pollers {
                        let _ = engine.remove_poller(id);
                    }
                    return Err(io::Error::other(e));
                }
            }
        }
        Ok(Parts {
            shared,
            trace,
            mailboxes,
            pollers,
        })
    }

    fn remove(self, engine: &Engine) {
        for id in self.pollers {
            let _ = engine.remove_poller(id);
        }
    }
}

/// Connections accepted and connections ended (after their requests finished).
#[derive(Default)]
struct ConnCounts {
    started: AtomicU64,
    ended: AtomicU64,
}

/// What the serve thread is doing.
#[derive(Clone)]
enum ServePhase {
    /// Waiting for a front end.
    Accepting,
    /// Quiesced: accepting nobody.
    Held,
    /// Serving this front end.
    Serving(Arc<Conn>),
    /// Stopped.
    Done,
}

struct ServeSt {
    stop: bool,
    hold: bool,
    phase: ServePhase,
}

/// The device's handle on its serve thread: stop it, or hold it (accept no front
/// end) for a handover.
struct ServeCtl {
    /// Wakes the serve thread out of its wait for a front end.
    evt: EventFd,
    st: Mutex<ServeSt>,
    cv: Condvar,
}

impl ServeCtl {
    fn new(hold: bool) -> io::Result<ServeCtl> {
        Ok(ServeCtl {
            evt: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?,
            st: Mutex::new(ServeSt {
                stop: false,
                hold,
                phase: ServePhase::Accepting,
            }),
            cv: Condvar::new(),
        })
    }

    fn hold(&self, on: bool) {
        lock(&self.st).hold = on;
        self.cv.notify_all();
        let _ = self.evt.write(1);
    }

    fn stop(&self) {
        lock(&self.st).stop = true;
        self.cv.notify_all();
        let _ = self.evt.write(1);
    }

    fn stopping(&self) -> bool {
        lock(&self.st).stop
    }

    fn set_phase(&self, p: ServePhase) {
        lock(&self.st).phase = p;
        self.cv.notify_all();
    }

    /// Waits (until `deadline`) while `waiting` holds of the serve thread's state;
    /// `what` names what did not happen in time.
    fn wait_while(
        &self,
        deadline: Instant,
        what: &str,
        mut waiting: impl FnMut(&ServeSt) -> bool,
    ) -> io::Result<std::sync::MutexGuard<'_, ServeSt>> {
        let mut st = lock(&self.st);
        while waiting(&st) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, what.to_string()));
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(st)
    }

    /// Waits (until `deadline`) for the serve thread to hold or to serve a front end.
    fn wait_settled(&self, deadline: Instant) -> io::Result<ServePhase> {
        let st = self.wait_while(
            deadline,
            "the vhost-user device did not stop accepting in time",
            |st| matches!(st.phase, ServePhase::Accepting),
        )?;
        Ok(st.phase.clone())
    }

    /// Waits (until `deadline`) for the serve thread to be done with `conn`.
    fn wait_left(&self, conn: &Arc<Conn>, deadline: Instant) -> io::Result<()> {
        self.wait_while(
            deadline,
            "the ending vhost-user connection did not finish in time",
            |st| matches!(&st.phase, ServePhase::Serving(c) if Arc::ptr_eq(c, conn)),
        )
        .map(drop)
    }

    /// Whether a front end may be accepted right now.
    fn may_accept_now(&self) -> bool {
        let st = lock(&self.st);
        !st.stop && !st.hold
    }

    /// Before accepting: waits while held; `false` once stopping.
    fn may_accept(&self) -> bool {
        let mut st = lock(&self.st);
        loop {
            if st.stop {
                return false;
            }
            if !st.hold {
                st.phase = ServePhase::Accepting;
                self.cv.notify_all();
                return true;
            }
            if !matches!(st.phase, ServePhase::Held) {
                st.phase = ServePhase::Held;
                self.cv.notify_all();
            }
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A front end's connection, set up; the serve thread starts its relay (so that a
/// resumed device that fails to start has read nothing from the front end).
struct Established {
    conn: Arc<Conn>,
    daemon: VhostUserDaemon<BlkBackend>,
    relay: crate::proxy::Relay,
}

/// vhost-user-backend's handler for `conn`, started on a private socket; returns
/// it with our end of that socket.
fn start_daemon(
    shared: &Arc<Shared>,
    conn: &Arc<Conn>,
) -> io::Result<(VhostUserDaemon<BlkBackend>, UnixStream)> {
    let backend = BlkBackend {
        shared: shared.clone(),
        conn: conn.clone(),
    };
    let mut daemon = VhostUserDaemon::new("vhost-blk".into(), backend, conn.mem.clone())
        // vhost-user-backend's error is not a std error (it may hold a thread's
        // panic payload): keep its text.
        .map_err(|e| io::Error::other(format!("cannot set up vhost-user handler: {e}")))?;
    let (mut inner, back, dir) = inner_pair()?;
    daemon
        .start(&mut inner)
        .map_err(|e| io::Error::other(e.to_string()))?;
    drop(dir);
    Ok((daemon, back))
}

/// Sets up a handed-over front end: a fresh handler, the journal replayed to it
/// and checked, then the relay started on the front end's socket.
fn resume_connection(
    shared: &Arc<Shared>,
    front: UnixStream,
    record: ConnRecord<File>,
    bases: &[Option<u32>],
) -> io::Result<Established> {
    let conn = Arc::new(Conn::new(shared.log.clone(), shared.queues.len())?);
    // It reads the front end only once the device is let run (`unquiesce`).
    conn.relay.hold_at_start();
    *lock(&conn.front) = Some(front.try_clone()?);
    *lock(&shared.front) = Some(conn.clone());
    let (mut daemon, back) = start_daemon(shared, &conn)?;
    let relay = crate::proxy::Relay::new(front, back, conn.clone());
    let replayed = replay_messages(record).and_then(|msgs| relay.replay(msgs, bases));
    if let Err(e) = replayed {
        // Not a disconnect: the front end's socket is the old device's again. The
        // relay never ran, so nothing shut it down.
        conn.relay.release();
        *lock(&shared.front) = None;
        daemon.request_shutdown();
        if let Some(h) = daemon.shutdown_handle() {
            h.shutdown();
        }
        let _ = daemon.wait();
        for q in &shared.queues {
            q.attach(None);
        }
        return Err(io::Error::new(
            e.kind(),
            format!("cannot resume the handed-over vhost-user connection: {e}"),
        ));
    }
    Ok(Established {
        conn,
        daemon,
        relay,
    })
}

/// Waits for a front end on `listener` (while the device is neither held nor
/// stopping) and sets up its connection.
fn accept(
    listener: &UnixListener,
    ep: &Epoll,
    shared: &Arc<Shared>,
    ctl: &ServeCtl,
    socket: &Path,
) -> Option<Established> {
    if !ctl.may_accept() {
        return None;
    }
    let mut events = [EpollEvent::default(); 2];
    match ep.wait(-1, &mut events) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return None,
        Err(e) => {
            tracing::error!(socket = %socket.display(), error = %e, "cannot wait for vhost-user connections");
            std::thread::sleep(Duration::from_millis(100));
            return None;
        }
    }
    let _ = ctl.evt.read();
    // Held or stopped meanwhile: leave the front end waiting in the backlog (for
    // the device a handover hands the socket to).
    if !ctl.may_accept_now() {
        return None;
    }
    let front = match listener.accept() {
        Ok((s, _)) => s,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::Interrupted
            ) =>
        {
            return None
        }
        Err(e) => {
            crate::fd_limit::report(&format!("a connection on {}", socket.display()), &e);
            std::thread::sleep(Duration::from_millis(100));
            return None;
        }
    };
    let conn = match Conn::new(shared.log.clone(), shared.queues.len()) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            tracing::error!(socket = %socket.display(), error = %e, "cannot set up a vhost-user connection");
            return None;
        }
    };
    *lock(&conn.front) = front.try_clone().ok();
    // vhost-user-backend's handler sits behind our relay (see proxy.rs), reached
    // over a private socket.
    let est = start_daemon(shared, &conn).map(|(daemon, back)| Established {
        conn: conn.clone(),
        daemon,
        relay: crate::proxy::Relay::new(front, back, conn.clone()),
    });
    match est {
        Ok(e) => {
            *lock(&shared.front) = Some(conn);
            Some(e)
        }
        Err(e) => {
            tracing::error!(socket = %socket.display(), error = %e, "cannot set up the vhost-user relay");
            None
        }
    }
}

/// Serves one front end at a time, each with a fresh vhost-user-backend daemon (its
/// handler keeps per-connection state such as ownership that must not leak into
/// the next connection). `first`: a connection handed over from another device.
fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    ctl: &ServeCtl,
    handle: &Mutex<Option<ShutdownHandle>>,
    count: &ConnCounts,
    socket: &Path,
    mut first: Option<Established>,
) {
    let ep = match Epoll::new().and_then(|ep| {
        ep.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, 0),
        )?;
        ep.ctl(
            ControlOperation::Add,
            ctl.evt.as_raw_fd(),
            EpollEvent::new(EventSet::IN, 1),
        )?;
        Ok(ep)
    }) {
        Ok(ep) => ep,
        Err(e) => {
            tracing::error!(socket = %socket.display(), error = %e, "cannot wait for vhost-user connections");
            ctl.set_phase(ServePhase::Done);
            return;
        }
    };
    loop {
        let taken_over = first.is_some();
        let est = match first.take() {
            Some(e) => e,
            None => {
                if ctl.stopping() {
                    break;
                }
                match accept(&listener, &ep, &shared, ctl, socket) {
                    Some(e) => e,
                    None => continue,
                }
            }
        };
        let Established {
            conn,
            mut daemon,
            relay,
        } = est;
        let relay = std::thread::Builder::new()
            .name("vhost-blk-proxy".into())
            .spawn(move || relay.run())
            .inspect_err(|e| {
                tracing::error!(socket = %socket.display(), error = %e, "cannot start the vhost-user relay");
            })
            .ok();
        ctl.set_phase(ServePhase::Serving(conn.clone()));
        if relay.is_none() || ctl.stopping() {
            daemon.request_shutdown();
        } else {
            count.started.fetch_add(1, Ordering::Relaxed);
            if taken_over {
                trace::limited!(shared.log, info, socket = %socket.display(), "vhost-user front end taken over (still connected)");
            } else {
                trace::limited!(shared.log, info, socket = %socket.display(), "vhost-user front end connected");
            }
        }
        *lock(handle) = daemon.shutdown_handle();
        if relay.is_none() || ctl.stopping() {
            if let Some(h) = lock(handle).as_ref() {
                h.shutdown();
            }
        }
        if let Err(e) = daemon.wait() {
            trace::limited!(shared.log, info, socket = %socket.display(), error = ?e, "vhost-user connection ended with an error");
        }
        *lock(handle) = None;
        *lock(&shared.front) = None;
        if let Some(t) = relay {
            let _ = t.join();
        }
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
        if !conn.relay.frozen() {
            trace::limited!(shared.log, info, socket = %socket.display(), "vhost-user front end disconnected");
        }
        ctl.set_phase(ServePhase::Accepting);
    }
    ctl.set_phase(ServePhase::Done);
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
