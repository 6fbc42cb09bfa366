//! A running vhost-user-blk device: socket, connections, its queue pollers, and
//! its lifecycle (pause, resume, save, restore).

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bdev::BlockDevice;
use engine::{Engine, PollMode, PollerId};
use trace::{Mailbox, TraceControl};
use virtio_blk::{BlkConfig, DeviceOptions, QueueWorker};

use crate::conn::{lock, ConfigNotice, QueueCtl, Shared, PAUSED};
use crate::error::{io, Error, Result, StateError};
use crate::poller::VirtqPoller;
use crate::serve::{ConnCounts, Established, Phase, ServeArgs, ServeCtl};
use crate::state::{FdTaker, HandoverState, HANDOVER_VERSION, MIN_HANDOVER_VERSION};

/// How a device is set up.
#[derive(Clone, Debug, Default)]
pub struct BlkDeviceOptions {
    pub device: DeviceOptions,
    pub poll: PollMode,
    /// Mode and group of the socket file (default: owner only).
    pub access: sockfile::SocketAccess,
    /// Whether and how the device takes part in a live migration of its VM.
    pub migration: crate::MigrationOptions,
}

pub struct VhostUserBlk {
    pub socket: PathBuf,
    engine: Arc<Engine>,
    pollers: Vec<PollerId>,
    serve: Arc<ServeCtl>,
    thread: Option<JoinHandle<()>>,
    connections: Arc<ConnCounts>,
    /// Trace switch of all the device's virtqueues.
    pub(crate) trace: Arc<TraceControl>,
    /// Per virtqueue, in queue order: where its poller leaves snapshots.
    pub(crate) mailboxes: Vec<Arc<Mailbox>>,
    pub(crate) shared: Arc<Shared>,
    /// A copy of the listening socket (handed over with [`VhostUserBlk::save`]).
    listener: UnixListener,
    /// Where a handover stands.
    handover: Mutex<Handover>,
}

/// A device's part in a handover.
#[derive(Default)]
struct Handover {
    /// Paused: the queues take no new chains, the connection (if any) is parked
    /// between two messages, and no new front end is accepted.
    paused: bool,
    /// Saved (or restored and not yet resumed): stopping the device now leaves
    /// the front end's socket and the socket path to the device that has them.
    handed_over: bool,
}

/// How long a resize waits for the queues to switch to the new disk handle.
const SWITCH_LIMIT: Duration = Duration::from_secs(10);

/// The parts of a device that exist before it serves anyone.
struct Parts {
    shared: Arc<Shared>,
    trace: Arc<TraceControl>,
    mailboxes: Vec<Arc<Mailbox>>,
    pollers: Vec<PollerId>,
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
    ) -> Result<VhostUserBlk> {
        check_opts(&opts, reactors)?;
        let listener = sockfile::bind(socket, opts.access).map_err(|source| Error::Listen {
            path: socket.to_path_buf(),
            source,
        })?;
        Self::start_on(listener, socket, disk, opts, engine, reactors).inspect_err(|_| {
            let _ = std::fs::remove_file(socket);
        })
    }

    /// As [`start`](Self::start), on a listening socket already bound at `socket`
    /// (inherited from another process): the path is neither unlinked nor bound
    /// again here. [`stop`](Self::stop) removes it as usual.
    pub fn start_on(
        listener: UnixListener,
        socket: &Path,
        disk: Arc<dyn BlockDevice>,
        opts: BlkDeviceOptions,
        engine: &Arc<Engine>,
        reactors: &[usize],
    ) -> Result<VhostUserBlk> {
        check_opts(&opts, reactors)?;
        let parts = Parts::new(&disk, &opts, engine, reactors, false)?;
        Self::launch(listener, socket, parts, engine, None, false)
    }

    /// Builds a device that takes over a front end from a device in another
    /// process (or this one), without a reconnect: `state` and `fds` are what
    /// [`save`](Self::save) gave there (the listening socket among the fds). The
    /// connection's handler is rebuilt from the state directly, each vring
    /// continuing at the index the old device stopped at.
    ///
    /// The device starts **paused**, a two-phase commit: its queues take
    /// nothing, it reads nothing from the front end's socket and accepts no front
    /// end. The caller then stops the old device (the commit point) and calls
    /// [`resume`](Self::resume) here. Until then, stopping or dropping this device
    /// hands everything back untouched and the old device can
    /// [`resume`](Self::resume).
    ///
    /// `state` and `fds` are checked like client input (counts, sizes, indices,
    /// every fd used exactly once, the vrings' indices against their used rings
    /// in guest memory); on any error nothing is left running and the front end's
    /// socket is untouched.
    pub fn restore(
        socket: &Path,
        disk: Arc<dyn BlockDevice>,
        opts: BlkDeviceOptions,
        engine: &Arc<Engine>,
        reactors: &[usize],
        state: HandoverState,
        fds: Vec<OwnedFd>,
    ) -> Result<VhostUserBlk> {
        check_opts(&opts, reactors)?;
        check_state(&state, &opts, disk.info().size_bytes())?;
        let mut taker = FdTaker::new(fds);
        let listener = UnixListener::from(OwnedFd::from(taker.take(state.listener_fd)?));
        if crate::channel::stream_socket(
            listener
                .as_fd()
                .try_clone_to_owned()
                .map_err(StateError::Io)?,
        )
        .is_none()
        {
            return Err(StateError::NotSocket("listening socket").into());
        }
        // The queues stay paused until the state is installed and checked: on an
        // error they must not have taken anything the old device would take again.
        let parts = Parts::new(&disk, &opts, engine, reactors, true)?;
        parts.shared.migration.set_wanted(state.writer);
        let first = match state.connection {
            None => None,
            Some(c) => match crate::state::restore(&parts.shared, c, &mut taker) {
                Ok(est) => Some(est),
                Err(e) => {
                    release(None);
                    parts.remove(engine);
                    return Err(e);
                }
            },
        };
        if let Err(e) = taker.finish() {
            release(first);
            parts.remove(engine);
            return Err(e.into());
        }
        let dev = Self::launch(listener, socket, parts, engine, first, true)?;
        // Paused, and its front end (socket path, connection) still the old
        // device's: stopping it now hands them back.
        *lock(&dev.handover) = Handover {
            paused: true,
            handed_over: true,
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
    ) -> Result<VhostUserBlk> {
        let Parts {
            shared,
            trace,
            mailboxes,
            pollers,
        } = parts;
        let started = (|| {
            let ctl = Arc::new(ServeCtl::new(held).map_err(io("create an eventfd"))?);
            let copy = listener
                .try_clone()
                .map_err(io("copy the listening socket"))?;
            listener
                .set_nonblocking(true)
                .map_err(io("make the listening socket non-blocking"))?;
            Ok::<_, Error>((ctl, copy))
        })();
        let (serve_ctl, copy) = match started {
            Ok(x) => x,
            Err(e) => {
                release(first);
                remove_pollers(engine, &pollers);
                return Err(e);
            }
        };
        let connections = Arc::new(ConnCounts::default());
        let args = ServeArgs {
            listener,
            shared: shared.clone(),
            ctl: serve_ctl.clone(),
            count: connections.clone(),
            socket: socket.to_path_buf(),
            first,
        };
        let thread = sandbox::spawn(sandbox::Role::VhostDevice, "vhost-blk".into(), move || {
            crate::serve::serve(args)
        });
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                remove_pollers(engine, &pollers);
                return Err(Error::Io {
                    what: "start the serve thread",
                    source: e,
                });
            }
        };
        Ok(VhostUserBlk {
            socket: socket.to_path_buf(),
            engine: engine.clone(),
            pollers,
            serve: serve_ctl,
            thread: Some(thread),
            connections,
            trace,
            mailboxes,
            shared,
            listener: copy,
            handover: Mutex::new(Handover::default()),
        })
    }

    /// Pauses the device for a handover, within `limit`: no new front end is
    /// accepted; the connected front end's socket is no longer read (at a message
    /// boundary); the queues take no new chains and complete those they took (on
    /// the used ring, the guest signalled). The guest sees a pause. On an error
    /// (the limit) the device runs on as before. Pausing a paused device does
    /// nothing.
    ///
    /// The I/O path pays nothing for this: the pause is a bit in the generation
    /// counter each poll loads anyway.
    pub fn pause(&self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        let mut h = lock(&self.handover);
        if h.paused {
            return Ok(());
        }
        self.serve.hold(true);
        if let Err(e) = self.serve.wait_held(deadline) {
            self.serve.hold(false);
            return Err(e);
        }
        h.paused = true;
        h.handed_over = false;
        drop(h);
        for q in &self.shared.queues {
            // An acknowledgement of an earlier pause has the same value as this
            // one's (resume only clears the bit): forget it, or a queue with a
            // request in flight would look drained.
            q.paused_ack.store(0, Ordering::Release);
            q.gen.fetch_or(PAUSED, Ordering::AcqRel);
            q.waker.load().wake();
        }
        let drained = engine::wait_until(
            deadline.saturating_duration_since(Instant::now()),
            Duration::from_micros(100),
            || self.queues_paused(),
        );
        if !drained {
            self.resume();
            return Err(Error::PauseTimeout(limit));
        }
        // The successor takes the disk's writer claim.
        self.shared.migration.pause();
        Ok(())
    }

    fn queues_paused(&self) -> bool {
        let mut all = true;
        for q in &self.shared.queues {
            if q.paused_ack.load(Ordering::Acquire) != q.gen.load(Ordering::Acquire) {
                all = false;
                q.waker.load().wake();
            }
        }
        all
    }

    /// Undoes [`pause`](Self::pause) (a handover that failed or was called off,
    /// before or after [`save`](Self::save)): the queues take chains again and the
    /// front end's socket is read from where it was left. On a device from
    /// [`restore`](Self::restore) it commits the handover: the device starts
    /// serving. Does nothing on a device that is not paused.
    pub fn resume(&self) {
        let mut h = lock(&self.handover);
        if !h.paused {
            return;
        }
        for q in &self.shared.queues {
            q.gen.fetch_and(!PAUSED, Ordering::AcqRel);
            q.waker.load().wake();
        }
        self.serve.hold(false);
        h.paused = false;
        h.handed_over = false;
        if let Err(e) = self.shared.migration.serve() {
            tracing::error!(socket = %self.socket.display(), error = %e, "resumed without the disk's writer claim");
        }
    }

    /// Whether the device writes its disk: not a migration's destination
    /// before its VM starts here, nor a source after its VM left.
    pub fn writes_disk(&self) -> bool {
        self.shared.migration.wanted()
    }

    /// Whether the device is paused ([`pause`](Self::pause)).
    pub fn paused(&self) -> bool {
        lock(&self.handover).paused
    }

    /// Describes the paused device for [`restore`](Self::restore) in another
    /// process: the state (serde, [`HANDOVER_VERSION`]) and copies of the fds it
    /// refers to by index — the listening socket; with a front end connected, its
    /// socket, memory region files, kick/call/err eventfds, inflight area and
    /// backend request channel. Each vring's `base` is the index it stopped at
    /// (its used index: nothing is in flight).
    ///
    /// Once saved, stopping or dropping this device leaves the front end's socket
    /// and the socket path alone (they belong to the new device), unless
    /// [`resume`](Self::resume) called the handover off. Fails if the device is
    /// not paused or the front end set up something a handover cannot carry.
    pub fn save(&self) -> Result<(HandoverState, Vec<OwnedFd>)> {
        let mut h = lock(&self.handover);
        if !h.paused {
            return Err(Error::NotPaused);
        }
        let mut fds = vec![OwnedFd::from(
            self.listener
                .try_clone()
                .map_err(io("copy the listening socket"))?,
        )];
        let connection = match self.serve.phase() {
            Phase::Parked(conn, handler) => {
                let handler = lock(&handler);
                Some(crate::state::save(&handler, &conn.front, &mut fds)?)
            }
            _ => None,
        };
        h.handed_over = true;
        let cfg = &self.shared.cfg;
        Ok((
            HandoverState {
                version: HANDOVER_VERSION,
                num_queues: cfg.opts.num_queues,
                queue_size: cfg.opts.queue_size,
                capacity_bytes: cfg.capacity_bytes(),
                listener_fd: 0,
                writer: self.shared.migration.wanted(),
                connection,
            },
            fds,
        ))
    }

    /// Whether a front end is connected now.
    pub fn connected(&self) -> bool {
        matches!(self.serve.phase(), Phase::Serving | Phase::Parked(..))
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
        self.shared.poll.store(mode);
        self.shared.wake_all();
    }

    /// Moves virtqueue `i`'s poller to reactor `reactors[i % reactors.len()]`, while
    /// the device runs: each poller is taken off its reactor between two polls
    /// (with its requests in flight, which complete on the new one), its kicks are
    /// pointed at the new reactor, and it is handed over. Checks every reactor
    /// first; on an error nothing has moved unless the engine is shutting down.
    pub fn move_queues(&mut self, reactors: &[usize]) -> Result<()> {
        if reactors.is_empty() {
            return Err(Error::BadOptions);
        }
        let mut wakers = Vec::with_capacity(self.pollers.len());
        for i in 0..self.pollers.len() {
            let r = reactors[i % reactors.len()];
            let w = self.engine.waker(r).ok_or(Error::NoReactor(r))?;
            wakers.push((r, w));
        }
        for (i, (r, w)) in wakers.into_iter().enumerate() {
            let id = self.pollers[i];
            if id.reactor == r {
                continue;
            }
            let engine_err = |reactor, source| Error::Engine {
                queue: i,
                reactor,
                source,
            };
            let p = self
                .engine
                .remove_poller(id)
                .map_err(|e| engine_err(id.reactor, e))?
                .ok_or(Error::PollerGone {
                    queue: i,
                    reactor: id.reactor,
                })?;
            // A kick in between wakes the old reactor; the new one checks the ring
            // on its first poll.
            self.shared.queues[i].waker.store(Arc::new(w));
            self.pollers[i] = self.engine.add_poller(r, p).map_err(|e| engine_err(r, e))?;
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
    pub fn resize(&self, disk: Arc<dyn BlockDevice>) -> Result<ConfigNotice> {
        let info = disk.info().clone();
        if info.block_size != self.shared.cfg.info.block_size {
            return Err(Error::BlockSize {
                got: info.block_size,
                want: self.shared.cfg.info.block_size,
            });
        }
        let mut chans = Vec::with_capacity(self.shared.queues.len());
        for _ in &self.shared.queues {
            chans.push(disk.channel().map_err(Error::Channel)?);
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
    /// socket and takes the pollers off their reactors. After a
    /// [`save`](Self::save) (still paused) it leaves the front end connected and
    /// the socket path in place instead: another device serves them now.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let handed_over = {
            let h = lock(&self.handover);
            h.paused && h.handed_over
        };
        self.serve.stop(handed_over);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        remove_pollers(&self.engine, &self.pollers);
        self.pollers.clear();
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

/// Lets go of a restored connection that will not be served, leaving the front
/// end's socket as it is (it is still the old device's).
fn release(est: Option<Established>) {
    if let Some(est) = est {
        est.conn.frozen.store(true, Ordering::Release);
    }
}

fn remove_pollers(engine: &Engine, pollers: &[PollerId]) {
    for id in pollers {
        let _ = engine.remove_poller(*id);
    }
}

fn check_opts(opts: &BlkDeviceOptions, reactors: &[usize]) -> Result<()> {
    let qs = opts.device.queue_size;
    if opts.device.num_queues == 0 || !qs.is_power_of_two() || reactors.is_empty() {
        return Err(Error::BadOptions);
    }
    Ok(())
}

fn check_state(
    state: &HandoverState,
    opts: &BlkDeviceOptions,
    disk_bytes: u64,
) -> Result<(), StateError> {
    if !(MIN_HANDOVER_VERSION..=HANDOVER_VERSION).contains(&state.version) {
        return Err(StateError::Version {
            got: state.version,
            want: HANDOVER_VERSION,
        });
    }
    if state.num_queues != opts.device.num_queues || state.queue_size != opts.device.queue_size {
        return Err(StateError::Geometry {
            state_queues: state.num_queues,
            state_size: state.queue_size,
            dev_queues: opts.device.num_queues,
            dev_size: opts.device.queue_size,
        });
    }
    if state.capacity_bytes != disk_bytes {
        return Err(StateError::Capacity {
            state: state.capacity_bytes,
            disk: disk_bytes,
        });
    }
    Ok(())
}

impl Parts {
    /// The device's shared state and its queue pollers, on their reactors.
    /// `paused`: the queues start paused (a restored device, until its state
    /// is installed and checked).
    fn new(
        disk: &Arc<dyn BlockDevice>,
        opts: &BlkDeviceOptions,
        engine: &Arc<Engine>,
        reactors: &[usize],
        paused: bool,
    ) -> Result<Parts> {
        let nq = usize::from(opts.device.num_queues);
        let cfg = Arc::new(BlkConfig::new(opts.device.clone(), disk.info().clone()));
        let mut queues = Vec::with_capacity(nq);
        for i in 0..nq {
            let r = reactors[i % reactors.len()];
            let waker = engine.waker(r).ok_or(Error::NoReactor(r))?;
            queues.push(QueueCtl::new(waker, paused));
        }
        let shared = Arc::new(Shared {
            cfg,
            queues,
            front: Mutex::new(None),
            poll: engine::AtomicPollMode::new(opts.poll),
            log: Arc::new(trace::LogLimiter::new()),
            migration: crate::migration::Migration::new(&opts.migration),
        });
        if let Some(why) = &shared.migration.refusal {
            tracing::info!("vhost-user-blk device offers no live migration: {why}");
        }
        // A restored device takes it when it resumes.
        if !paused {
            shared.migration.serve()?;
        }
        let trace = Arc::new(TraceControl::default());
        let mut mailboxes = Vec::with_capacity(nq);
        let mut pollers = Vec::with_capacity(nq);
        for i in 0..nq {
            let chan = match disk.channel() {
                Ok(c) => c,
                Err(e) => {
                    remove_pollers(engine, &pollers);
                    return Err(Error::Channel(e));
                }
            };
            let worker = QueueWorker::traced(shared.cfg.clone(), chan, i as u16, trace.clone());
            mailboxes.push(worker.mailbox());
            let p = VirtqPoller::new(i, shared.clone(), worker);
            let r = reactors[i % reactors.len()];
            match engine.add_poller(r, Box::new(p)) {
                Ok(id) => pollers.push(id),
                Err(source) => {
                    remove_pollers(engine, &pollers);
                    return Err(Error::Engine {
                        queue: i,
                        reactor: r,
                        source,
                    });
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
        remove_pollers(engine, &self.pollers);
    }
}
