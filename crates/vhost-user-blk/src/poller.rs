//! One virtqueue as an engine poller: runs on the reactor that owns the queue.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use engine::Poller;
use guest_mem::DirtyLog;
use virtio_blk::{Mem, QueueWorker};
use virtio_queue::QueueT;
use vm_memory::GuestAddressSpace;

use crate::conn::{lock, Conn, Shared, PAUSED};

pub(crate) struct VirtqPoller {
    pub index: usize,
    pub shared: Arc<Shared>,
    pub worker: QueueWorker,
    gen: u64,
    /// The connection served; its vring `index` is this queue's.
    conn: Option<Arc<Conn>>,
    mem: Arc<Mem>,
    /// Guest notifications are off (we are polling) for the current vring.
    quiet: bool,
    /// `QueueCtl::stops` when we last looked: a stop (GET_VRING_BASE: guest reset,
    /// reboot) clears a broken queue and re-applies notification suppression.
    stops: u64,
    /// The rings were (re)started: consult the inflight log before taking chains.
    recover: bool,
    /// The current connection's memory faulted and it is being disconnected.
    faulted: bool,
    /// `QueueCtl::disk_gen` of the disk handle the worker uses.
    disk_gen: u64,
}

impl VirtqPoller {
    pub fn new(index: usize, shared: Arc<Shared>, worker: QueueWorker) -> Self {
        VirtqPoller {
            index,
            shared,
            worker,
            gen: 0,
            conn: None,
            mem: Arc::new(Mem::default()),
            quiet: false,
            stops: 0,
            recover: true,
            faulted: false,
            disk_gen: 0,
        }
    }

    /// Whether the worker serves the newest disk handle (an online resize hands a
    /// new one over): it switches once nothing is in flight on the old one; until
    /// then no new chain is taken, so none is checked against the old size.
    #[inline]
    fn disk_current(&mut self) -> bool {
        let gen = self.shared.queues[self.index]
            .disk_gen
            .load(Ordering::Acquire);
        gen == self.disk_gen || self.take_disk(gen)
    }

    #[cold]
    #[inline(never)]
    fn take_disk(&mut self, gen: u64) -> bool {
        if self.worker.in_flight() != 0 {
            return false;
        }
        let ctl = &self.shared.queues[self.index];
        let next = ctl
            .next_disk
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((chan, info)) = next {
            if let Err(chan) = self.worker.set_disk(chan, info.clone()) {
                // Cannot happen with nothing in flight; keep it for the next poll.
                *ctl.next_disk.lock().unwrap_or_else(|e| e.into_inner()) = Some((chan, info));
                return false;
            }
        }
        self.disk_gen = gen;
        true
    }

    /// Picks up a new connection (or its loss) once nothing is in flight on the old
    /// one; acknowledges a pause ([`PAUSED`]) the same way.
    #[inline]
    fn refresh(&mut self) {
        let gen = self.shared.queues[self.index].gen.load(Ordering::Acquire);
        if gen != self.gen {
            self.refresh_slow(gen);
        }
    }

    #[cold]
    #[inline(never)]
    fn refresh_slow(&mut self, gen: u64) {
        if self.worker.in_flight() != 0 {
            return;
        }
        let ctl = &self.shared.queues[self.index];
        if gen & PAUSED != 0 {
            // Paused: everything taken is on the used ring (and the guest was
            // signalled in the poll that completed it); take nothing new until the
            // bit is cleared. The connection is looked at again then.
            ctl.paused_ack.store(gen, Ordering::Release);
            return;
        }
        self.gen = gen;
        self.conn = lock(&ctl.conn)
            .clone()
            .filter(|c| c.vrings.len() > self.index);
        // Let go of the old connection's memory table and inflight log: the front
        // end may be gone, and its mappings (and file descriptors) with it.
        self.mem = Arc::new(Mem::default());
        self.worker.set_inflight(None);
        self.worker.reset();
        self.quiet = false;
        self.recover = true;
        self.faulted = false;
    }
}

impl VirtqPoller {
    /// The front end shrank a file it shares with us (its pages now read as zeroes):
    /// end its connection; the next one starts clean. Kept out of line so the hot
    /// `poll` stays small.
    #[cold]
    #[inline(never)]
    fn faulted(&mut self, conn: &Conn) -> usize {
        if !self.faulted {
            self.faulted = true;
            trace::limited!(
                conn.log,
                error,
                queue = self.index,
                "the vhost-user front end truncated memory it shares with us while it \
                 was in use; disconnecting it"
            );
            conn.disconnect();
        }
        self.idle()
    }

    #[cold]
    #[inline(never)]
    fn idle(&mut self) -> usize {
        self.worker.finish_poll(|| false);
        0
    }

    /// Whether the queue sleeps without asking the guest to kick: deep on a backend
    /// whose completions wake us ([`engine::defers_doorbells`], decision 0029).
    fn defers_kicks(&self) -> bool {
        engine::defers_doorbells(self.worker.in_flight(), self.worker.slow_completions())
    }
}

/// Whether the worker marks the dirty log the vring says (both none, or one log).
#[inline]
fn same_log(a: Option<&Arc<DirtyLog>>, b: Option<&Arc<DirtyLog>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

/// Leaves the guest's kicks off for a sleep that a completion will end: with
/// EVENT_IDX `avail_event` goes one behind the next avail index (the driver kicks
/// only when its index passes `avail_event`, which it already has), without it
/// `VRING_USED_F_NO_NOTIFY` stays set. Then looks at the avail index once more:
/// `true` if the guest added requests meanwhile (stay awake for them).
fn defer_kicks(q: &mut virtio_queue::Queue, mem: &Mem) -> Result<bool, virtio_queue::Error> {
    use vm_memory::{Bytes, GuestAddress};
    if q.event_idx_enabled() {
        // virtq_used: flags, idx, ring[size], then avail_event (virtio 1.2, 2.7.8).
        let at = q
            .used_ring()
            .checked_add(4 + 8 * u64::from(q.size()))
            .ok_or(virtio_queue::Error::AddressOverflow)?;
        let behind = q.next_avail().wrapping_sub(1);
        mem.store(behind.to_le(), GuestAddress(at), Ordering::Relaxed)
            .map_err(virtio_queue::Error::GuestMemory)?;
    } else {
        q.disable_notification(mem)?;
    }
    // Pairs with the driver's barrier between publishing its avail index and
    // reading avail_event or the flags: one of us sees the other's store.
    std::sync::atomic::fence(Ordering::SeqCst);
    Ok(q.avail_idx(mem, Ordering::Acquire)?.0 != q.next_avail())
}

impl Poller for VirtqPoller {
    fn poll(&mut self) -> usize {
        self.refresh();
        let disk_current = self.disk_current();
        let Some(conn) = &self.conn else {
            // Still answer stats readers and pick up trace start/stop.
            self.worker.finish_poll(|| false);
            return 0;
        };
        if conn.guarded.signal.faulted() {
            let conn = conn.clone();
            return self.faulted(&conn);
        }
        // The handler changes the vring only on control messages; this lock is
        // uncontended on the I/O path.
        let mut st = lock(&conn.vrings[self.index]);
        {
            // The memory snapshot is taken under the vring lock: the handler
            // installs (and guards) a table before it sets ring addresses in it, so
            // a ring seen running here lies in this snapshot. One taken before the
            // lock may predate the ring, and reading its avail index there fails
            // (the queue would be marked broken).
            let g = conn.mem.memory();
            if !conn.guarded.is_guarded(&g) {
                // A new memory table is being installed: wait until it is guarded.
                // Every guest-memory access of this poller goes through
                // `self.mem`, so none touches memory that a shrinking file could
                // turn into an unrecoverable SIGBUS.
                drop(st);
                return self.idle();
            }
            if !std::ptr::eq(&*g, &*self.mem) {
                self.mem = g.into_inner();
            }
        }
        if !same_log(st.data_log.as_ref(), self.worker.dirty_log()) {
            self.worker.set_dirty_log(st.data_log.clone());
        }
        // A newer connection (or none) waits for our in-flight requests: take no new ones.
        let current = self.shared.queues[self.index].gen.load(Ordering::Relaxed) == self.gen;
        // Read under the vring lock: a stop counted before the vring was restarted is
        // seen no later than the restart itself.
        let stops = self.shared.queues[self.index].stops.load(Ordering::Acquire);
        if stops != self.stops {
            self.stops = stops;
            self.worker.reset();
            self.quiet = false;
            self.recover = true;
        }
        let pop = current && disk_current && st.running() && !st.hold;
        // Whether this poll writes the used ring outside of completions.
        let mut flags_written = false;
        if pop && self.recover && self.worker.in_flight() == 0 {
            // SET_INFLIGHT_FD comes before the rings are started, so the log of
            // this start is in place now.
            self.recover = false;
            let log = conn
                .inflight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .and_then(|r| r.queue(self.index));
            self.worker.set_inflight(log);
            self.worker.recover(&mut st.queue, &self.mem);
            flags_written = true;
        }
        if pop && !self.quiet {
            // Polling: ask the guest not to kick (no-op with EVENT_IDX beyond not
            // moving avail_event, which is what suppresses kicks there).
            let _ = st.queue.disable_notification(&*self.mem);
            self.quiet = true;
            flags_written = true;
        }
        // Buffers are translated with the snapshot taken after the avail index read
        // (see `process_with`): the one loaded above may predate an ADD_MEM_REG whose
        // buffers the first requests of a connection already point into.
        let (atomic, guarded) = (&conn.mem, &conn.guarded);
        let mut latest = |m: &mut Arc<Mem>| {
            let g = atomic.memory();
            if !std::ptr::eq(&*g, &**m) && guarded.is_guarded(&g) {
                *m = g.into_inner();
            }
        };
        let p = self
            .worker
            .process_with(&mut st.queue, &mut self.mem, &mut latest, pop);
        if st.used_log.is_some() && (p.used > 0 || flags_written) {
            st.log_used();
        }
        // With EVENT_IDX the guest may not want this interrupt: then `notify` is 0.
        self.worker.finish_poll(|| {
            p.used > 0
                && st.queue.needs_notification(&*self.mem).unwrap_or(true)
                && st.signal_used()
        });
        self.shared.queues[self.index]
            .in_flight
            .store(self.worker.in_flight(), Ordering::Release);
        p.work
    }

    /// The reactor asks on control messages and every few thousand iterations, so
    /// a `set_poll_mode` reaches it without a lock or a per-poll load.
    fn sleep_after(&self) -> Option<Duration> {
        let spin = self.shared.poll_mode().sleep_after()?;
        if self.defers_kicks() {
            return Some(Duration::ZERO);
        }
        Some(engine::adaptive_spin(
            spin,
            self.worker.in_flight(),
            self.worker.slow_completions(),
        ))
    }

    fn prepare_sleep(&mut self) -> bool {
        // Switched to busy since the reactor last asked: stay awake. Requests in
        // flight need a backend that wakes us when they complete.
        if self.shared.poll_mode().sleep_after().is_none()
            || (self.worker.in_flight() != 0 && !self.worker.arm_notifier())
        {
            return false;
        }
        let ctl = &self.shared.queues[self.index];
        let gen = ctl.gen.load(Ordering::Acquire);
        if gen & PAUSED != 0 && ctl.paused_ack.load(Ordering::Acquire) == gen {
            // Paused with nothing in flight: sleep until resumed (which wakes us).
            return true;
        }
        if gen != self.gen || ctl.disk_gen.load(Ordering::Acquire) != self.disk_gen {
            return false;
        }
        let Some(conn) = &self.conn else {
            return true;
        };
        let mut st = lock(&conn.vrings[self.index]);
        // A held ring (logging asked, no log yet) is woken when the log comes.
        if !st.running() || st.hold || self.worker.broken().is_some() {
            return true;
        }
        let sleep = if self.defers_kicks() {
            // Notifications stay off (`quiet` with it): the next completion wakes us.
            !defer_kicks(&mut st.queue, &self.mem).unwrap_or(true)
        } else {
            self.quiet = false;
            // Re-enable kicks; if the guest added work meanwhile, stay awake.
            // (Through our snapshot, not the vring's: see the guarded-memory note
            // in `poll`.)
            !st.queue.enable_notification(&*self.mem).unwrap_or(true)
        };
        if st.used_log.is_some() {
            st.log_used();
        }
        sleep
    }

    fn wake_fds<'a>(&'a self, add: &mut dyn FnMut(std::os::fd::BorrowedFd<'a>)) {
        if self.worker.in_flight() != 0 {
            if let Some(fd) = self.worker.notifier() {
                add(fd);
            }
        }
    }

    fn wake_by(&self) -> Option<std::time::Instant> {
        if self.worker.in_flight() != 0 {
            self.worker.wake_by()
        } else {
            None
        }
    }
}
