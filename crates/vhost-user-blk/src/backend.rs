//! The `VhostUserBackend` implementation: answers feature/config questions and
//! hands the vrings of each connection to the queue pollers.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use engine::{PollMode, Waker};
use guest_mem::FaultSignal;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringMutex, VringT};
use virtio_blk::{BlkConfig, Mem};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::guarded::GuardedMem;

pub(crate) type Gm = GuestMemoryAtomic<Mem>;
pub(crate) type Vring = VringMutex<Gm>;

/// One front-end connection: its memory and (after the first kick) its vrings.
pub(crate) struct Conn {
    pub mem: Gm,
    pub vrings: Mutex<Option<Vec<Vring>>>,
    /// The inflight log the front end handed us with SET_INFLIGHT_FD.
    pub inflight: Mutex<Option<crate::inflight::Region>>,
    /// Which of `mem`'s snapshots are safe against the front end shrinking its files.
    pub guarded: GuardedMem,
    /// The front end's socket, to end the connection from a poller.
    pub front: Mutex<Option<UnixStream>>,
    /// The device's budget of front-end-triggerable log lines.
    pub log: Arc<trace::LogLimiter>,
    /// Exit eventfds whose ownership vhost-user-backend took and dropped (see
    /// `exit_event`).
    exit_consumers: Mutex<Vec<RawFd>>,
    /// Protocol features the front end acknowledged (SET_PROTOCOL_FEATURES, seen by
    /// the relay).
    pub protocol: AtomicU64,
    /// The backend request channel (SET_BACKEND_REQ_FD, answered by the relay):
    /// where a configuration change is announced.
    pub backend_req: Mutex<Option<UnixStream>>,
    /// What the front end set up, for a handover (kept by the relay).
    journal: Mutex<crate::handover::Journal>,
    /// The device's handle on the relay (handover: park, resume, release).
    pub relay: crate::proxy::RelayCtl,
}

impl Drop for Conn {
    fn drop(&mut self) {
        for fd in self
            .exit_consumers
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            // SAFETY: vhost-user-backend 0.24 turned this eventfd into a raw fd for
            // its worker's epoll set and never closes it (Cargo.lock pins the
            // version; re-check on upgrade). The worker holds the backend, which
            // holds this `Conn`, so when we run the worker is gone and nothing else
            // uses or closes the fd: we are its only owner.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

impl Conn {
    pub fn new(log: Arc<trace::LogLimiter>, num_queues: usize) -> io::Result<Conn> {
        let mem = GuestMemoryAtomic::new(Mem::default());
        let guarded = GuardedMem::new(FaultSignal::new()?, mem.memory().into_inner());
        Ok(Conn {
            mem,
            vrings: Mutex::new(None),
            inflight: Mutex::new(None),
            guarded,
            front: Mutex::new(None),
            log,
            exit_consumers: Mutex::new(Vec::new()),
            protocol: AtomicU64::new(0),
            backend_req: Mutex::new(None),
            journal: Mutex::new(crate::handover::Journal::new(num_queues)),
            relay: crate::proxy::RelayCtl::new()?,
        })
    }

    pub fn journal(&self) -> std::sync::MutexGuard<'_, crate::handover::Journal> {
        self.journal.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells the front end that the config space changed
    /// (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on the backend request channel); it
    /// then reads the config again (QEMU: GET_CONFIG, then a config interrupt to
    /// the guest). Needs CONFIG and BACKEND_REQ negotiated and the channel handed
    /// over. No reply is asked for, so a front end that does not read its end
    /// cannot hold the caller: the write is bounded by a timeout.
    pub fn config_changed(&self) -> ConfigNotice {
        let need = VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::BACKEND_REQ;
        let acked =
            VhostUserProtocolFeatures::from_bits_truncate(self.protocol.load(Ordering::Acquire));
        if !acked.contains(need) {
            return ConfigNotice::NotNegotiated;
        }
        let mut slot = self.backend_req.lock().unwrap_or_else(|e| e.into_inner());
        let Some(s) = slot.as_ref() else {
            return ConfigNotice::NotNegotiated;
        };
        let mut msg = [0u8; 12];
        msg[0..4].copy_from_slice(&BACKEND_CONFIG_CHANGE_MSG.to_le_bytes());
        msg[4..8].copy_from_slice(&1u32.to_le_bytes()); // version 1, no reply asked
        let sent = s
            .set_write_timeout(Some(Duration::from_secs(1)))
            .and_then(|()| std::io::Write::write_all(&mut &*s, &msg));
        match sent {
            Ok(()) => ConfigNotice::Sent,
            Err(e) => {
                // The channel is of no further use.
                *slot = None;
                ConfigNotice::Failed(e.to_string())
            }
        }
    }

    /// Ends the connection (the relay sees the socket shut down and the daemon
    /// stops); the device then waits for the next front end as after any disconnect.
    pub fn disconnect(&self) {
        if self.relay.frozen() {
            // Parked for a handover, or handed over: the socket may be another
            // device's now.
            return;
        }
        if let Some(s) = self
            .front
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// VHOST_USER_BACKEND_CONFIG_CHANGE_MSG (SLAVE_CONFIG_CHANGE_MSG before QEMU 8.1).
const BACKEND_CONFIG_CHANGE_MSG: u32 = 2;

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

/// Per-queue state shared between the vhost-user threads and the queue's poller.
pub(crate) struct QueueCtl {
    /// The connection the poller should serve; bumping `gen` tells it to look.
    pub conn: Mutex<Option<Arc<Conn>>>,
    pub gen: AtomicU64,
    /// Requests the poller has handed to the backend and not completed.
    pub in_flight: AtomicUsize,
    /// Counts GET_VRING_BASE stops, so the poller can start afresh afterwards.
    pub stops: AtomicU64,
    /// Wakes the reactor that polls this queue; replaced when the queue moves to
    /// another reactor (`set_placement`). Read by the kick thread with one load.
    pub waker: ArcSwap<Waker>,
    /// A channel on the disk's resized handle for the poller to take (an online
    /// resize); bumping `disk_gen` tells it to look. Until it has taken it the
    /// poller takes no new chains; it switches once nothing is in flight.
    pub next_disk: Mutex<Option<NextDisk>>,
    pub disk_gen: AtomicU64,
    /// The `gen` (with [`PAUSED`]) at which the poller last stopped with nothing
    /// in flight: a quiesce waits for it to equal `gen`.
    pub paused_ack: AtomicU64,
}

/// Bit of [`QueueCtl::gen`]: the device is quiesced (a handover); the poller takes
/// no new chains, completes those it has, then acknowledges in `paused_ack`. It
/// costs the I/O path nothing: `gen` is loaded there anyway.
pub(crate) const PAUSED: u64 = 1 << 63;

impl QueueCtl {
    pub fn attach(&self, conn: Option<Arc<Conn>>) {
        *self.conn.lock().unwrap_or_else(|e| e.into_inner()) = conn;
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

pub(crate) struct Shared {
    pub cfg: Arc<BlkConfig>,
    pub queues: Vec<QueueCtl>,
    /// The connected front end, if any (to announce a config change).
    pub front: Mutex<Option<Arc<Conn>>>,
    /// The device's poll mode ([`PollMode`] as `u8`); pollers read it when their
    /// reactor asks how long to spin, so changing it takes no lock anywhere.
    pub poll: engine::AtomicPollMode,
    /// Budget of the log lines its front ends can trigger (shared by connections,
    /// so reconnecting does not refill it).
    pub log: Arc<trace::LogLimiter>,
}

impl Shared {
    pub fn poll_mode(&self) -> PollMode {
        self.poll.load()
    }

    pub fn set_poll_mode(&self, mode: PollMode) {
        self.poll.store(mode);
    }
}

/// How long GET_VRING_BASE waits for in-flight requests before answering anyway.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

#[derive(Clone)]
pub(crate) struct BlkBackend {
    pub shared: Arc<Shared>,
    pub conn: Arc<Conn>,
}

impl BlkBackend {
    fn install_vrings(&self, vrings: &[Vring]) {
        let mut slot = self.conn.vrings.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(vrings.to_vec());
            drop(slot);
            for q in &self.shared.queues {
                q.attach(Some(self.conn.clone()));
            }
        }
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.shared.queues.len()
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.shared.cfg.opts.queue_size)
    }

    fn features(&self) -> u64 {
        self.shared.cfg.features | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            // Answered by `proxy` in front of vhost-user-backend's handler.
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            // SET_BACKEND_REQ_FD is answered by `proxy` too: vhost-user-backend's
            // `Backend` cannot send the config change message (vhost 0.18).
            | VhostUserProtocolFeatures::BACKEND_REQ
    }

    fn set_event_idx(&self, _enabled: bool) {
        // The vrings carry the flag themselves (set by the handler).
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.shared.cfg.read(offset, size)
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        self.shared
            .cfg
            .write(offset, buf)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }

    fn update_memory(&self, mem: Gm) -> io::Result<()> {
        // The handler replaced the snapshot inside the GuestMemoryAtomic we share
        // with the pollers (requests in flight keep the old one alive); they start
        // using it once its regions are guarded.
        self.conn.guarded.sync(mem.memory().into_inner()).inspect_err(|e| {
            trace::limited!(self.shared.log, error, error = %e, "cannot guard the front end's new memory table; its queues stay stopped");
        })
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // The handler marked the queue not ready, so the poller takes no new chains;
        // answer GET_VRING_BASE only once the ones it took are on the used ring.
        if let Some(q) = self.shared.queues.get(queue_index as usize) {
            q.stops.fetch_add(1, Ordering::AcqRel);
            if !q.drain(DRAIN_LIMIT) {
                trace::limited!(
                    self.shared.log,
                    warn,
                    queue_index,
                    "requests still in flight after {DRAIN_LIMIT:?}; stopping the vring anyway"
                );
            }
        }
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        // Without one the vring worker thread never ends and dropping the daemon
        // after a disconnect would hang.
        let (consumer, notifier) =
            new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC)
                .inspect_err(|e| crate::fd_limit::report("an exit eventfd", e))
                .ok()?;
        // vhost-user-backend 0.24 registers the consumer with `into_raw_fd()` and
        // never closes it: one eventfd leaked per connection. The connection closes
        // it (see `Conn`'s drop).
        self.conn
            .exit_consumers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(consumer.as_raw_fd());
        Some((consumer, notifier))
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        self.install_vrings(vrings);
        if let Some(q) = self.shared.queues.get(usize::from(device_event)) {
            q.waker.load().wake();
        }
        Ok(())
    }
}

/// Makes sure vrings are what we think (compile-time check of the trait bound).
#[allow(dead_code)]
fn _assert_vring(v: &Vring) -> u16 {
    v.queue_next_avail()
}
