//! I/O queue groups: one completion queue plus the submission queues that post to
//! it, polled as one [`engine::Poller`] on one reactor. No locks, no allocation per
//! command: slots are preallocated per SQ and iovecs live on the stack.
//!
//! `poll.rs` runs the stages of one poll, `exec.rs` turns commands into backend
//! requests, `batch.rs` hands a poll's reads and writes to the backends in
//! batches, `completions.rs` posts and signals, `shadow.rs` reads doorbells and
//! writes EventIdx. What several stages share are leaves they take as parameters:
//! `sq.rs` (an SQ and its command slots), `ns_table.rs` (the namespaces' channels)
//! and `pass.rs` (what a poll reads once). Imports only go down: this file, then
//! `poll.rs`, `batch.rs`, `completions.rs`, `exec.rs`, then the leaves.

mod batch;
mod completions;
mod exec;
mod ns_table;
mod pass;
mod poll;
mod shadow;
mod sq;

use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bdev::Armed;
use crossbeam_channel::Sender;
use frontend_core::QueueCore;
use guest_mem::{DmaSpace, MemView};

use crate::ns::Ns;
use crate::queue::{CqRing, SqRing};
use crate::shared::Shared;

pub(crate) use completions::Completions;
use ns_table::NsTable;
pub(crate) use ns_table::{NsChan, NsChange};
use sq::IoSq;

use shadow::{read_db, shadow_page, NO_EI};
pub(crate) use shadow::{write_event_idx, write_shadow_db, Shadow};

pub(crate) struct QueueGroup {
    shared: Arc<Shared>,
    view: MemView,
    pub sqs: Vec<IoSq>,
    ns: NsTable,
    pub shadow: Option<Shadow>,
    /// The CQ and everything completions need.
    pub out: Completions,
    /// Runs on its controller's own reactor, where it may wait for the client's
    /// replies; elsewhere (shared reactors) it never waits: a transfer it would
    /// need fails at once (docs/decisions/0020-dma-messages.md).
    pub own: bool,
}

impl QueueGroup {
    pub fn new(
        shared: Arc<Shared>,
        mem: Arc<DmaSpace>,
        cq: CqRing,
        shadow: Option<Shadow>,
        namespaces: &[Option<Ns>],
    ) -> std::io::Result<Box<QueueGroup>> {
        let live = namespaces
            .iter()
            .map(|d| d.as_ref().map(NsChan::open).transpose())
            .collect::<std::io::Result<Vec<_>>>()?;
        // At most one completion per CQ entry is posted per poll.
        let rec = QueueCore::new(
            cq.qid,
            u32::try_from(namespaces.len()).unwrap_or(u32::MAX),
            usize::from(cq.size),
            shared.trace.clone(),
        );
        Ok(Box::new(QueueGroup {
            shared,
            view: MemView::new(mem),
            sqs: Vec::new(),
            ns: NsTable::new(live),
            shadow,
            out: Completions::new(cq, rec),
            own: false,
        }))
    }

    pub fn add_sq(&mut self, ring: SqRing) {
        self.sqs.push(IoSq::new(ring));
    }

    /// One poll on the reactor (`poll.rs`); returns the work it did: commands
    /// fetched and completions posted.
    pub fn poll(&mut self) -> usize {
        if self.shared.fatal.load(Ordering::Relaxed) {
            return 0;
        }
        self.out.begin_poll();
        // Commands in flight keep the snapshots they use pinned, so the view moves
        // on as soon as the client changes its map.
        self.view.refresh();
        // On a reactor other controllers share, never wait for this one's client.
        let _no_waits =
            (!self.own && self.view.map().has_remote()).then(guest_mem::no_remote_waits);
        let fetched = poll::run(self.parts());
        fetched as usize + self.out.posted()
    }

    /// What one poll works on.
    #[inline]
    fn parts(&mut self) -> poll::Group<'_> {
        poll::Group {
            shared: &self.shared,
            view: &self.view,
            shadow: self.shadow,
            sqs: &mut self.sqs,
            ns: &mut self.ns,
            out: &mut self.out,
        }
    }

    /// Quiesce (`handover.rs`), off the reactor: posts what the backends completed
    /// and signals its interrupt, but fetches nothing. Returns whether nothing is
    /// left in flight (then no interrupt is held back for coalescing either). A
    /// controller in fatal status posts nothing: its requests are waited for and
    /// dropped, as a reset would (the host resets it anyway).
    pub fn settle(&mut self) -> bool {
        if self.shared.fatal.load(Ordering::Relaxed) {
            self.drain();
            return true;
        }
        self.out.begin_poll();
        self.view.refresh();
        let _ = poll::settle(self.parts());
        let idle = self.out.inflight == 0;
        if idle {
            self.out.release_held_irq(&self.shared);
            self.view.park();
        }
        idle
    }

    /// Applies a namespace change. Called on the control path while the group is off
    /// its reactor; a removed namespace's channel keeps being polled until the
    /// requests it holds complete.
    pub fn apply(&mut self, change: NsChange) {
        if let NsChange::Add(nsid, _) = &change {
            self.out.rec.ensure_namespaces(*nsid);
        }
        self.ns.apply(change);
    }

    /// Whether this group has requests in flight on namespace `nsid` (on its
    /// channel, or on one it replaced when the namespace was resized).
    pub fn ns_busy(&self, nsid: u32) -> bool {
        self.ns.get(nsid).is_some_and(|c| c.inflight > 0)
            || self
                .ns
                .retiring
                .iter()
                .any(|(id, c)| *id == nsid && c.inflight > 0)
    }

    /// Detaches SQ `qid` after letting its in-flight commands finish.
    pub fn remove_sq(&mut self, qid: u16) {
        self.drain();
        self.sqs.retain(|s| s.ring.qid != qid);
    }

    /// Waits (bounded) for asynchronous backend requests; their completions are
    /// dropped because the queue is going away.
    pub fn drain(&mut self) {
        engine::wait_until(Duration::from_secs(5), Duration::from_micros(50), || {
            if self.out.inflight == 0 {
                return true;
            }
            let mut n = 0u32;
            for c in self.ns.all_mut() {
                c.chan.flush();
                let mut k = 0u32;
                c.chan.poll(&mut |_, _| k += 1);
                c.inflight = c.inflight.saturating_sub(k);
                n += k;
            }
            self.out.inflight = self.out.inflight.saturating_sub(n);
            self.out.inflight == 0
        });
        if self.out.inflight > 0 {
            // Their memory stays mapped: a late completion must not write into
            // memory the client was told it got back.
            tracing::warn!(
                requests = self.out.inflight,
                "backend requests did not complete within 5 s; dropping them"
            );
        }
        self.out.forget_inflight(self.out.inflight == 0);
        self.ns.retiring.clear();
        for c in self.ns.live.iter_mut().flatten() {
            c.inflight = 0;
        }
        for sq in self.sqs.iter_mut() {
            let n = sq.slots.len() as u32;
            sq.free.clear();
            sq.free.extend((0..n).rev());
            sq.runs.iter_mut().for_each(Vec::clear);
        }
    }

    /// Off the reactors: hold no memory snapshot, so unmaps need not wait for us.
    pub fn park(&mut self) {
        self.view.park();
    }

    /// Before the group runs (again): SQ entries in unshared client memory are
    /// fetched from the head on (`fetch_entries` in `poll.rs`).
    pub fn resync(&mut self) {
        for sq in &mut self.sqs {
            sq.synced = sq.ring.head;
        }
    }

    /// Doorbell Buffer Config while the group exists: EventIdx values we remember
    /// are for no buffer.
    pub fn set_shadow(&mut self, shadow: Shadow) {
        self.shadow = Some(shadow);
        self.out.forget_event_idx();
        for sq in &mut self.sqs {
            sq.ei = NO_EI;
        }
    }

    /// How long the idle group spins before it may sleep: the controller's poll
    /// mode's time, shortened while a deep queue waits on slow channels
    /// ([`engine::adaptive_spin`]).
    pub fn sleep_after(&self) -> Option<Duration> {
        let spin = self.shared.sleep_after()?;
        let all_slow = self.all_slow();
        if self.defers_doorbells(all_slow) {
            return Some(Duration::ZERO);
        }
        Some(engine::adaptive_spin(
            spin,
            self.out.inflight as usize,
            all_slow,
        ))
    }

    /// Whether every request in flight is on a channel with slow completions.
    fn all_slow(&self) -> bool {
        self.ns
            .all()
            .filter(|c| c.inflight > 0)
            .all(|c| c.chan.slow_completions())
    }

    /// Whether the group sleeps without asking the driver to ring: its queue is deep
    /// on slow channels (whose completions wake it), it has no fast namespace whose
    /// commands would wait for them, and EventIdx can tell the driver not to ring
    /// ([`engine::defers_doorbells`]); `all_slow` is [`Self::all_slow`].
    fn defers_doorbells(&self, all_slow: bool) -> bool {
        self.shadow.is_some()
            && engine::defers_doorbells(self.out.inflight as usize, all_slow)
            && self.ns.only_slow()
    }

    /// Before the reactor sleeps: arm the backends' completion notifiers, publish
    /// EventIdx at each SQ's head so the driver rings on its next command (one behind
    /// it while doorbells are deferred: the next completion wakes us), then look
    /// at the tails once more (a command written before the driver could see the
    /// new EventIdx would otherwise wait for the next one). `false`: stay awake.
    pub fn prepare_sleep(&mut self) -> bool {
        if self.shared.sleep_after().is_none() {
            return false;
        }
        if self.shared.fatal.load(Ordering::Relaxed) {
            self.view.park();
            return true;
        }
        if self.out.inflight > 0 {
            for c in self.ns.all_mut() {
                if c.inflight > 0 && !matches!(c.chan.arm_notifier(), Armed::Fd | Armed::Timer) {
                    return false;
                }
            }
        }
        let defer = self.defers_doorbells(self.all_slow());
        let map = self.view.refresh();
        let page = self.shared.doorbells.all();
        if let Some(s) = self.shadow {
            for sq in &mut self.sqs {
                let ei = if defer {
                    shadow::behind(sq.ring.head, sq.ring.size)
                } else {
                    sq.ring.head
                };
                write_event_idx(map, s, sq.ring.qid, false, ei);
                sq.ei = ei;
            }
            // Pairs with the driver's barrier between its shadow write and its
            // EventIdx read (Dekker): one of us sees the other's store.
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        let shadow = shadow_page(map, self.shadow);
        for sq in &self.sqs {
            if read_db(&page, shadow.as_ref(), sq.ring.qid, false) != u32::from(sq.ring.head) {
                return false;
            }
        }
        // Asleep we hold no snapshot: an unmap need not wait for us. An interrupt
        // held back for coalescing waits out its aggregation time (`wake_by`).
        self.view.park();
        self.out.before_sleep(&self.shared);
        true
    }

    /// When a sleeping group must poll again without any fd waking it: the
    /// interrupt it holds back for coalescing falls due, or a channel releases a
    /// request it holds back (QoS, injected latency).
    pub fn wake_by(&self) -> Option<Instant> {
        if self.shared.fatal.load(Ordering::Relaxed) {
            return None;
        }
        let held = if self.out.inflight > 0 {
            self.ns
                .all()
                .filter(|c| c.inflight > 0)
                .filter_map(|c| c.chan.wake_by())
                .min()
        } else {
            None
        };
        self.out
            .irq_due_at(&self.shared)
            .into_iter()
            .chain(held)
            .min()
    }

    /// What wakes the group besides doorbell messages: completion notifiers of
    /// channels with requests in flight (armed by `prepare_sleep`).
    pub fn wake_fds<'a>(&'a self, add: &mut dyn FnMut(BorrowedFd<'a>)) {
        if self.out.inflight == 0 {
            return;
        }
        for c in self.ns.all() {
            if c.inflight > 0 {
                if let Some(fd) = c.chan.notifier() {
                    add(fd);
                }
            }
        }
    }
}

/// What the engine polls. When the reactor drops it (after `remove_poller`), the
/// group is sent back to the control path, which gets its concrete state back
/// without any lock on the hot path.
pub(crate) struct GroupPoller {
    pub group: Option<Box<QueueGroup>>,
    pub back: Sender<Box<QueueGroup>>,
}

impl engine::Poller for GroupPoller {
    fn poll(&mut self) -> usize {
        self.group.as_mut().map_or(0, |g| g.poll())
    }

    fn sleep_after(&self) -> Option<Duration> {
        self.group.as_ref().and_then(|g| g.sleep_after())
    }

    fn prepare_sleep(&mut self) -> bool {
        self.group.as_mut().is_none_or(|g| g.prepare_sleep())
    }

    fn wake_fds<'a>(&'a self, add: &mut dyn FnMut(BorrowedFd<'a>)) {
        if let Some(g) = &self.group {
            g.wake_fds(add);
        }
    }

    fn wake_by(&self) -> Option<Instant> {
        self.group.as_ref().and_then(|g| g.wake_by())
    }
}

impl Drop for GroupPoller {
    fn drop(&mut self) {
        if let Some(g) = self.group.take() {
            let _ = self.back.try_send(g);
        }
    }
}
