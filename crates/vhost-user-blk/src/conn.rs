//! State shared between a device's control threads and its queue pollers: the
//! device ([`Shared`], one [`QueueCtl`] per queue) and the connected front end
//! ([`Conn`], one [`Vring`] per queue).
//!
//! Who touches what: the connection's handler (on the serve thread) changes a
//! vring's [`VringState`] on control messages; the queue's poller (on its reactor)
//! locks the same state once per poll to pop chains and push completions. The lock
//! is uncontended on the I/O path: control messages that touch a running ring are
//! rare (GET_VRING_BASE, SET_VRING_ENABLE, SET_VRING_CALL).
//!
//! Dirty-page logging during a live migration (`migration.rs`) rides on the same
//! lock: each [`VringState`] carries the log its poller marks (`data_log`,
//! `used_log`), set by the handler, which the poller compares with its worker's at
//! every poll — a pointer comparison, nothing more while no migration runs. A log
//! the handler replaces is never marked again once it has taken every vring's lock
//! after the swap, so the front end may drop it then.

use std::fs::File;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use arc_swap::ArcSwap;
use engine::{PollMode, Waker};
use guest_mem::{DirtyLog, FaultSignal};
use serde::{Deserialize, Serialize};
use virtio_blk::{BlkConfig, Mem};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};

use crate::guarded::GuardedMem;
use crate::kick::Kicks;

pub(crate) use crate::memory::Gm;
pub(crate) use crate::sync::lock;

/// SET_VRING_ADDR's payload.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct VringAddr {
    pub flags: u32,
    pub desc: u64,
    pub used: u64,
    pub avail: u64,
    pub log: u64,
}

/// One vring of a connection.
pub(crate) struct VringState {
    /// Sizes, guest addresses, indices; `ready()` is "started" (a kick eventfd
    /// arrived since the last GET_VRING_BASE).
    pub queue: Queue,
    pub kick: Option<File>,
    pub call: Option<File>,
    pub err: Option<File>,
    /// SET_VRING_ENABLE (or SET_FEATURES without PROTOCOL_FEATURES).
    pub enabled: bool,
    /// SET_VRING_ADDR as the front end sent it (user addresses, flags and the
    /// log address).
    pub addrs: Option<VringAddr>,
    /// While the front end logs (VHOST_F_LOG_ALL and a log): where completed
    /// requests mark the guest pages they wrote.
    pub data_log: Option<Arc<DirtyLog>>,
    /// ... and where used-ring writes are marked (VHOST_VRING_F_LOG), at the
    /// ring's `log_guest_addr`.
    pub used_log: Option<Arc<DirtyLog>>,
    /// The front end asked for logging and gave no log yet: take no chains (what
    /// they wrote could not be marked).
    pub hold: bool,
}

impl VringState {
    fn new(max_size: u16) -> std::io::Result<VringState> {
        Ok(VringState {
            queue: Queue::new(max_size).map_err(std::io::Error::other)?,
            kick: None,
            call: None,
            err: None,
            enabled: false,
            addrs: None,
            data_log: None,
            used_log: None,
            hold: false,
        })
    }

    /// Whether its kicks matter (started and enabled).
    pub fn running(&self) -> bool {
        self.queue.ready() && self.enabled
    }

    /// Marks the used ring (entries, index, flags and avail_event) in the front
    /// end's log after we wrote it, if it logs this ring.
    #[cold]
    pub fn log_used(&self) {
        if let (Some(log), Some(a)) = (&self.used_log, &self.addrs) {
            // virtq_used: flags, idx, ring[size], avail_event (virtio 1.2, 2.7.8).
            log.mark(a.log, 6 + 8 * u64::from(self.queue.size()));
        }
    }

    /// Signals the guest (the call eventfd, if it gave one).
    pub fn signal_used(&self) -> bool {
        self.call
            .as_ref()
            .is_none_or(|mut c| c.write(&1u64.to_ne_bytes()).is_ok())
    }
}

pub(crate) type Vring = Mutex<VringState>;

/// One front-end connection: what the pollers need of it.
pub(crate) struct Conn {
    pub mem: Gm,
    /// Which of `mem`'s snapshots are safe against the front end shrinking its files.
    pub guarded: GuardedMem,
    pub vrings: Vec<Vring>,
    /// The inflight log the front end handed us with SET_INFLIGHT_FD.
    pub inflight: Mutex<Option<crate::inflight::Region>>,
    /// The front end's socket, to end the connection from a poller.
    pub front: UnixStream,
    /// The device's budget of front-end-triggerable log lines.
    pub log: Arc<trace::LogLimiter>,
    /// Protocol features the front end acknowledged.
    pub protocol: AtomicU64,
    /// The backend request channel (SET_BACKEND_REQ_FD): where a configuration
    /// change is announced.
    pub backend_req: Mutex<Option<UnixStream>>,
    /// The kick eventfds of the running vrings, watched by the kick thread.
    pub kicks: Kicks,
    /// Handed over (or parked for it): the socket may be another device's now.
    pub frozen: AtomicBool,
}

impl Conn {
    pub fn new(
        log: Arc<trace::LogLimiter>,
        front: UnixStream,
        num_queues: usize,
        queue_size: u16,
    ) -> std::io::Result<Conn> {
        let mem = GuestMemoryAtomic::new(Mem::default());
        let guarded = GuardedMem::new(FaultSignal::new()?, mem.memory().into_inner());
        let mut vrings = Vec::with_capacity(num_queues);
        for _ in 0..num_queues {
            vrings.push(Mutex::new(VringState::new(queue_size)?));
        }
        Ok(Conn {
            mem,
            guarded,
            vrings,
            inflight: Mutex::new(None),
            front,
            log,
            protocol: AtomicU64::new(0),
            backend_req: Mutex::new(None),
            kicks: Kicks::new()?,
            frozen: AtomicBool::new(false),
        })
    }

    /// Starts the connection's kick thread, which wakes `shared`'s queues; it
    /// ends on `kicks.stop()`.
    pub fn spawn_kicks(self: &Arc<Self>, shared: Arc<Shared>) -> std::io::Result<JoinHandle<()>> {
        let conn = self.clone();
        sandbox::spawn(
            sandbox::Role::VhostKick,
            "vhost-blk-kick".into(),
            move || {
                conn.kicks.run(|i| {
                    if let Some(q) = shared.queues.get(i) {
                        q.waker.load().wake();
                    }
                })
            },
        )
    }

    /// Ends the connection (the serve thread sees the socket shut down); the device
    /// then waits for the next front end as after any disconnect.
    pub fn disconnect(&self) {
        if self.frozen.load(Ordering::Acquire) {
            return;
        }
        let _ = self.front.shutdown(std::net::Shutdown::Both);
    }
}

/// What the front end was told of a new capacity ([`crate::VhostUserBlk::resize`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigNotice {
    /// The configuration change message went out on the backend request channel.
    Sent,
    /// No front end is connected: the next one reads the new capacity.
    NoFrontEnd,
    /// The front end did not negotiate CONFIG and BACKEND_REQ (or gave no
    /// channel): it sees the new capacity when it reads the config space again
    /// (QEMU on reconnect; the guest after a reset, if the VMM re-reads it).
    NotNegotiated,
    /// Writing to the channel failed (the front end closed its end).
    Failed(String),
}

/// A disk handle waiting for a queue's poller ([`QueueCtl::next_disk`]).
pub(crate) type NextDisk = (Box<dyn bdev::IoChannel>, bdev::BlockInfo);

/// Per-queue state shared between the control threads and the queue's poller.
pub(crate) struct QueueCtl {
    /// The connection the poller should serve; bumping `gen` tells it to look.
    pub conn: Mutex<Option<Arc<Conn>>>,
    pub gen: AtomicU64,
    /// Requests the poller has handed to the backend and not completed.
    pub in_flight: AtomicUsize,
    /// Counts GET_VRING_BASE stops, so the poller can start afresh afterwards.
    pub stops: AtomicU64,
    /// Wakes the reactor that polls this queue; replaced when the queue moves to
    /// another reactor. Read by the kick thread with one load.
    pub waker: ArcSwap<Waker>,
    /// A channel on the disk's resized handle for the poller to take (an online
    /// resize); bumping `disk_gen` tells it to look. Until it has taken it the
    /// poller takes no new chains; it switches once nothing is in flight.
    pub next_disk: Mutex<Option<NextDisk>>,
    pub disk_gen: AtomicU64,
    /// The `gen` (with [`PAUSED`]) at which the poller last stopped with nothing
    /// in flight: a pause waits for it to equal `gen`.
    pub paused_ack: AtomicU64,
}

/// Bit of [`QueueCtl::gen`]: the device is paused (a handover); the poller takes
/// no new chains, completes those it has, then acknowledges in `paused_ack`. It
/// costs the I/O path nothing: `gen` is loaded there anyway.
pub(crate) const PAUSED: u64 = 1 << 63;

impl QueueCtl {
    pub fn new(waker: Waker, paused: bool) -> QueueCtl {
        QueueCtl {
            conn: Mutex::new(None),
            gen: AtomicU64::new(if paused { PAUSED } else { 0 }),
            in_flight: AtomicUsize::new(0),
            stops: AtomicU64::new(0),
            waker: ArcSwap::from_pointee(waker),
            next_disk: Mutex::new(None),
            disk_gen: AtomicU64::new(0),
            paused_ack: AtomicU64::new(0),
        }
    }

    pub fn attach(&self, conn: Option<Arc<Conn>>) {
        *lock(&self.conn) = conn;
        self.gen.fetch_add(1, Ordering::AcqRel);
        self.waker.load().wake();
    }

    /// Waits until the poller has no request in flight (or `limit` passes).
    pub fn drain(&self, limit: Duration) -> bool {
        engine::wait_until(limit, Duration::from_micros(200), || {
            if self.in_flight.load(Ordering::Acquire) == 0 {
                return true;
            }
            self.waker.load().wake();
            false
        })
    }
}

/// The device, as its threads share it.
pub(crate) struct Shared {
    pub cfg: Arc<BlkConfig>,
    pub queues: Vec<QueueCtl>,
    /// The connected front end, if any (to announce a config change).
    pub front: Mutex<Option<Arc<Conn>>>,
    /// The device's poll mode; pollers read it when their reactor asks how long
    /// to spin, so changing it takes no lock anywhere.
    pub poll: engine::AtomicPollMode,
    /// Budget of the log lines its front ends can trigger (shared by connections,
    /// so reconnecting does not refill it).
    pub log: Arc<trace::LogLimiter>,
    /// Whether and how the device takes part in a live migration.
    pub migration: crate::migration::Migration,
}

impl Shared {
    pub fn poll_mode(&self) -> PollMode {
        self.poll.load()
    }

    pub fn wake_all(&self) {
        for q in &self.queues {
            q.waker.load().wake();
        }
    }
}
