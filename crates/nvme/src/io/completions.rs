//! The completion side of a queue group: its CQ, what it owes the host (requests in
//! flight, the memory snapshots they pin), accounting, and when the interrupt fires.
//!
//! With mirrors of unshared client memory (docs/decisions/0020-dma-messages.md)
//! completions are not posted one by one: the poll collects them, and its last
//! stage sends the data of those that carry any to the client (one batch), then
//! posts their entries and sends those (one more), and only then signals the
//! interrupt. A completion whose data the client refused becomes a Data Transfer
//! Error.

use std::sync::Arc;
use std::time::Instant;

use bdev::IoStatus;
use frontend_core::{Protocol, QueueCore};
use guest_mem::{MemPins, MemView};
use trace::OpClass;

use super::exec::io_op;
use super::pass::{Fatal, Pass};
use super::shadow::{behind, write_event_idx, NO_EI};
use super::sq::{IoSq, Slot};
use crate::decode::{OP_FLUSH, OP_READ, OP_WRITE};
use crate::iov::Run;
use crate::log::{ErrorEntry, GroupCounters, PcieCounters};
use crate::queue::{ring_ranges, CqRing, CQE_SIZE};
use crate::shared::Shared;
use crate::status::{Nvme, Status};

pub(crate) struct Completions {
    pub cq: CqRing,
    /// The CQ's EventIdx as last written (see `IoSq::ei`).
    ei: u16,
    /// Completions posted but not yet signalled (Interrupt Coalescing).
    irq: HeldIrq,
    /// Shadow doorbell reads; requests are counted by `rec`.
    pub pcie: Arc<PcieCounters>,
    /// Commands waiting for the backend.
    pub inflight: u32,
    /// The memory snapshots commands in flight were translated against.
    pins: MemPins,
    /// Accounting and trace data of this group (owned by the polling thread): the
    /// one place its completions are counted.
    pub rec: QueueCore<Nvme>,
    /// CQEs posted in the current poll.
    posted: usize,
    /// With mirrors: completions (SQ id, slot, status) waiting for the end of the
    /// poll, where their data and entries go to the client together.
    deferred: Vec<(u16, u32, Status)>,
}

impl Completions {
    pub fn new(cq: CqRing, rec: QueueCore<Nvme>) -> Completions {
        Completions {
            cq,
            ei: NO_EI,
            irq: HeldIrq::default(),
            pcie: Arc::new(PcieCounters::default()),
            inflight: 0,
            pins: MemPins::with_capacity(4),
            rec,
            posted: 0,
            deferred: Vec::new(),
        }
    }

    /// CQ entries spoken for but not posted yet (see `deferred`).
    #[inline]
    pub fn deferred(&self) -> u32 {
        self.deferred.len() as u32
    }

    /// The group's counters, for the control path.
    pub fn counters(&self) -> GroupCounters {
        GroupCounters {
            io: self.rec.counters(),
            pcie: self.pcie.clone(),
        }
    }

    pub fn begin_poll(&mut self) {
        self.posted = 0;
        self.rec.begin_poll();
    }

    pub fn posted(&self) -> usize {
        self.posted
    }

    /// With shadow doorbells: the CQ's EventIdx, when we do not know what it holds
    /// (a new queue or Doorbell Buffer Config), goes just behind the head we know.
    /// From then on it moves only when an entry is about to be posted into the slot
    /// it names (`event_idx_before_post`).
    #[inline]
    pub fn event_idx_if_unknown(&mut self, pass: &Pass<'_>) {
        if self.ei == NO_EI {
            self.event_idx_behind_head(pass);
        }
    }

    /// Before an entry goes into the CQ slot EventIdx names (a driver consuming it
    /// would pass EventIdx and ring): EventIdx moves just behind the head we know,
    /// where no entry goes before the head is read again. Moved then, not at each
    /// head read: a store right after the read can meet the driver between its
    /// shadow head store and its EventIdx load for the very update we read, and
    /// make it ring for nothing.
    #[inline]
    fn event_idx_before_post(&mut self, pass: &Pass<'_>) {
        if self.cq.tail == self.ei {
            self.event_idx_behind_head(pass);
        }
    }

    fn event_idx_behind_head(&mut self, pass: &Pass<'_>) {
        if let Some(s) = pass.shadow() {
            let v = behind(self.cq.head, self.cq.size);
            write_event_idx(pass.map, s, self.cq.qid, true, v);
            self.ei = v;
        }
    }

    /// EventIdx values we remember are for no buffer (a new Doorbell Buffer Config).
    pub fn forget_event_idx(&mut self) {
        self.ei = NO_EI;
    }

    /// A command now waits for the backend: it keeps the memory snapshot it was
    /// translated against.
    pub fn hold(&mut self, view: &MemView, slot: &mut Slot, requests: u16) {
        slot.pending = requests;
        slot.pin = self.pins.pin(view);
        self.inflight += 1;
    }

    /// All requests in flight are gone (drained or abandoned).
    pub fn forget_inflight(&mut self, drained: bool) {
        if drained {
            self.pins.clear();
        }
        self.inflight = 0;
        self.deferred.clear();
    }

    /// Command `idx` of `sq` completed with `status`: posted now, or with mirrors
    /// at the end of the poll.
    #[inline]
    pub fn finish(
        &mut self,
        pass: &Pass<'_>,
        sq: &mut IoSq,
        idx: u32,
        status: Status,
    ) -> Result<(), Fatal> {
        if pass.cq_remote || sq.slots.get(idx as usize).is_some_and(|s| s.push) {
            self.deferred.push((sq.ring.qid, idx, status));
            return Ok(());
        }
        self.post(pass, sq, idx, status)
    }

    /// Posts command `idx` of `sq` with `status`, accounts it and frees its slot.
    fn post(
        &mut self,
        pass: &Pass<'_>,
        sq: &mut IoSq,
        idx: u32,
        status: Status,
    ) -> Result<(), Fatal> {
        let qid = sq.ring.qid;
        let Some(slot) = sq.slots.get(idx as usize) else {
            return Ok(());
        };
        self.account(pass.shared, qid, slot, status);
        let cid = slot.cid;
        sq.free.push(idx);
        self.event_idx_before_post(pass);
        if !self
            .cq
            .post(pass.cq_ring(), 0, sq.ring.head, qid, cid, status)
        {
            return Err(pass.fatal("cannot write CQ entry"));
        }
        self.posted += 1;
        Ok(())
    }

    /// One backend request of command `tag` completed; the command finishes with its
    /// last request.
    pub fn backend_done(
        &mut self,
        pass: &Pass<'_>,
        sqs: &mut [IoSq],
        tag: u64,
        st: IoStatus,
    ) -> Result<(), Fatal> {
        let qid = (tag >> 32) as u16;
        let idx = tag as u32;
        let Some(sq) = sqs.iter_mut().find(|s| s.ring.qid == qid) else {
            return Ok(());
        };
        let Some(slot) = sq.slots.get_mut(idx as usize) else {
            return Ok(());
        };
        if slot.pending == 0 {
            return Ok(());
        }
        slot.pending -= 1;
        if slot.status.is_ok() {
            slot.status = Nvme::from_io(st, io_op(slot.opcode));
        }
        if slot.pending > 0 {
            return Ok(());
        }
        slot.stamps.completed = QueueCore::<Nvme>::stamp(slot.stamps.kick);
        self.inflight = self.inflight.saturating_sub(1);
        self.pins.unpin(slot.pin);
        let status = slot.status;
        self.finish(pass, sq, idx, status)
    }

    fn account(&mut self, shared: &Shared, sqid: u16, slot: &Slot, st: Status) {
        let ok = st.is_ok();
        let class = match slot.opcode {
            OP_READ => OpClass::Read,
            OP_WRITE => OpClass::Write,
            OP_FLUSH => OpClass::Flush,
            _ => OpClass::Other,
        };
        // Counted once, here: SMART, controller stats and `get_stats` read it back.
        self.rec
            .complete(slot.nsid, class, slot.bytes, st, slot.stamps);
        if !ok {
            shared.record_error(ErrorEntry {
                count: 0,
                sqid,
                cid: slot.cid,
                status: st,
                lba: slot.slba,
                nsid: slot.nsid,
            });
        }
    }

    /// With mirrors: sends the data of this poll's completions to the client, then
    /// posts their entries and sends those. Before the interrupt.
    #[cold]
    fn flush_deferred(&mut self, pass: &Pass<'_>, sqs: &mut [IoSq]) -> Result<(), Fatal> {
        let mut done = std::mem::take(&mut self.deferred);
        let data = |sqs: &[IoSq], qid: u16, idx: u32| -> Vec<Run> {
            sqs.iter()
                .find(|s| s.ring.qid == qid)
                .filter(|s| s.slots.get(idx as usize).is_some_and(|sl| sl.push))
                .and_then(|s| s.runs.get(idx as usize))
                .cloned()
                .unwrap_or_default()
        };
        let ranges: Vec<Run> = done
            .iter()
            .filter(|(_, _, st)| st.is_ok())
            .flat_map(|&(q, i, _)| data(sqs, q, i))
            .collect();
        if !ranges.is_empty() && pass.map.push(&ranges).is_err() {
            // Which ones: each again on its own.
            for (q, i, st) in done.iter_mut() {
                let runs = data(sqs, *q, *i);
                if st.is_ok() && !runs.is_empty() && pass.map.push(&runs).is_err() {
                    *st = Status::DATA_TRANSFER_ERROR;
                }
            }
        }
        let first = self.cq.tail;
        let mut n = 0u32;
        for (qid, idx, st) in done.drain(..) {
            let Some(sq) = sqs.iter_mut().find(|s| s.ring.qid == qid) else {
                continue;
            };
            if let Some(r) = sq.runs.get_mut(idx as usize) {
                r.clear();
            }
            self.post(pass, sq, idx, st)?;
            n += 1;
        }
        // Keep the (empty) vector's capacity for the next poll.
        self.deferred = done;
        if n > 0 {
            let to = self.cq.tail;
            let ranges = ring_ranges(self.cq.base, first, to, self.cq.size, CQE_SIZE);
            // The whole ring was posted around (n == size is impossible: one entry
            // always stays free).
            if pass.map.push(&ranges).is_err() {
                return Err(pass.fatal("cannot send CQ entries to the client"));
            }
        }
        Ok(())
    }

    /// The last stage: completions held for the client's memory, queue depth,
    /// and the interrupt for what this poll posted.
    pub fn end_poll(&mut self, pass: &Pass<'_>, sqs: &mut [IoSq], depth: u32) -> Result<(), Fatal> {
        if !self.deferred.is_empty() {
            self.flush_deferred(pass, sqs)?;
        }
        self.rec.depth(depth);
        // The core takes the batch stamps around the interrupt (read only when a
        // traced command finished in this poll).
        let Completions {
            cq,
            irq,
            posted,
            rec,
            inflight,
            ..
        } = self;
        rec.end_poll(*inflight, || {
            let signalled = cq.ien && irq.due(pass.shared, cq.vector, *posted);
            if signalled {
                pass.shared.irqs.signal(cq.vector);
            }
            signalled
        });
        Ok(())
    }

    /// Before sleeping: an interrupt held back for coalescing fires now, unless its
    /// aggregation time is still running; then the reactor wakes when it falls due
    /// ([`Self::irq_due_at`]) and that poll's `end_poll` fires it. Coalescing then
    /// holds across a sleep as it does while polling (NVMe 1.4 §5.21.1.8: an
    /// interrupt once the threshold is reached or the oldest completion waited the
    /// aggregation time), so a slow backend's completions, each of which wakes the
    /// reactor, do not each cost the host an interrupt.
    pub fn before_sleep(&mut self, shared: &Shared) {
        if self.irq_due_at(shared).is_none() {
            self.release_held_irq(shared);
        }
    }

    /// When the interrupt held back for coalescing is due, if one is.
    pub fn irq_due_at(&self, shared: &Shared) -> Option<Instant> {
        if self.irq.held == 0 {
            return None;
        }
        let (_, time) = shared.coalescing_for(self.cq.vector)?;
        self.irq.since.map(|t| t + time)
    }

    /// An interrupt held back for coalescing fires now.
    pub fn release_held_irq(&mut self, shared: &Shared) {
        if self.irq.held > 0 {
            self.irq = HeldIrq::default();
            shared.irqs.signal(self.cq.vector);
        }
    }
}

/// Completions posted but not yet signalled (Interrupt Coalescing), and when the
/// first of them was.
#[derive(Default)]
struct HeldIrq {
    held: u32,
    since: Option<Instant>,
}

impl HeldIrq {
    /// Whether this poll, which posted `posted` completions, signals interrupt
    /// `vector`: at once for every batch that posted, or with Interrupt Coalescing
    /// once `threshold` completions are held or the oldest held one waited the
    /// aggregation time (the clock is read only while completions are held).
    fn due(&mut self, shared: &Shared, vector: u16, posted: usize) -> bool {
        let Some((threshold, time)) = shared.coalescing_for(vector) else {
            let due = posted > 0 || self.held > 0;
            *self = HeldIrq::default();
            return due;
        };
        if posted == 0 && self.held == 0 {
            return false;
        }
        self.held += posted as u32;
        let now = Instant::now();
        let first = *self.since.get_or_insert(now);
        if self.held >= threshold || now.duration_since(first) >= time {
            *self = HeldIrq::default();
            return true;
        }
        false
    }
}
