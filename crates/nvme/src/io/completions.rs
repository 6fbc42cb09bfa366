//! The completion side of a queue group: its CQ, what it owes the host (requests in
//! flight, the memory snapshots they pin), accounting, and when the interrupt fires.

use std::sync::Arc;
use std::time::Instant;

use bdev::IoStatus;
use guest_mem::{MemPins, MemView};
use trace::{OpClass, QueueRecorder};

use super::exec::is_write;
use super::poll::{Fatal, Pass};
use super::shadow::{behind, ei_stale, write_event_idx, NO_EI};
use super::{IoSq, Slot};
use crate::ctrl::Shared;
use crate::decode::{OP_FLUSH, OP_READ, OP_WRITE};
use crate::log::{ErrorEntry, GroupCounters, PcieCounters};
use crate::queue::CqRing;
use crate::status::Status;

pub(crate) struct Completions {
    pub cq: CqRing,
    /// The CQ's EventIdx as last written (see `IoSq::ei`).
    ei: u16,
    /// Completions posted but not yet signalled (Interrupt Coalescing), and when
    /// the first of them was.
    irq_held: u32,
    irq_since: Option<Instant>,
    /// Shadow doorbell reads; requests are counted by `rec`.
    pub pcie: Arc<PcieCounters>,
    /// Commands waiting for the backend.
    pub inflight: u32,
    /// The memory snapshots commands in flight were translated against.
    pins: MemPins,
    /// Metrics and trace data of this group (owned by the polling thread).
    pub rec: QueueRecorder,
    /// CQEs posted in the current poll.
    posted: usize,
}

impl Completions {
    pub fn new(cq: CqRing, rec: QueueRecorder) -> Completions {
        Completions {
            cq,
            ei: NO_EI,
            irq_held: 0,
            irq_since: None,
            pcie: Arc::new(PcieCounters::default()),
            inflight: 0,
            pins: MemPins::with_capacity(4),
            rec,
            posted: 0,
        }
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
    }

    /// Posts command `idx` of `sq` with `status`, accounts it and frees its slot.
    pub fn finish(
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
            slot.status = Status::from_io(st, is_write(slot.opcode));
        }
        if slot.pending > 0 {
            return Ok(());
        }
        slot.stamps.completed = QueueRecorder::stamp(slot.stamps.kick);
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
        // SCT and SC; DNR and More are not part of the error's identity.
        self.rec
            .complete(slot.nsid, class, slot.bytes, st.0 & 0x7ff, slot.stamps);
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

    /// The last stage: the CQ's EventIdx, queue depth, and the interrupt for what
    /// this poll posted.
    pub fn end_poll(&mut self, pass: &Pass<'_>, depth: u32) {
        let in_use = u32::from(self.cq.size).saturating_sub(1) - self.cq.free() + self.inflight;
        if let Some(s) = pass
            .shadow()
            .filter(|_| ei_stale(self.ei, self.cq.head, self.cq.size, in_use))
        {
            let ei = behind(self.cq.head, self.cq.size);
            write_event_idx(pass.map, s, self.cq.qid, true, ei);
            self.ei = ei;
        }
        self.rec.depth(depth);
        // Batch stamps, read only when a traced command finished in this poll.
        let posted_at = if self.rec.has_finished() {
            trace::clock::now()
        } else {
            0
        };
        let signalled = self.cq.ien && self.interrupt_due(pass.shared);
        if signalled {
            pass.shared.irqs.signal(self.cq.vector);
        }
        let signalled_at = if signalled && posted_at != 0 {
            trace::clock::now()
        } else {
            posted_at
        };
        self.rec.set_inflight(self.inflight);
        self.rec.end_poll(posted_at, signalled_at);
    }

    /// Whether this poll signals the CQ's interrupt: at once for every batch that
    /// posted, or with Interrupt Coalescing once `threshold` completions are held or
    /// the oldest held one waited the aggregation time (the clock is read only while
    /// completions are held).
    fn interrupt_due(&mut self, shared: &Shared) -> bool {
        let Some((threshold, time)) = shared.coalescing_for(self.cq.vector) else {
            let due = self.posted > 0 || self.irq_held > 0;
            self.irq_held = 0;
            self.irq_since = None;
            return due;
        };
        if self.posted == 0 && self.irq_held == 0 {
            return false;
        }
        self.irq_held += self.posted as u32;
        let now = Instant::now();
        let first = *self.irq_since.get_or_insert(now);
        if self.irq_held >= threshold || now.duration_since(first) >= time {
            self.irq_held = 0;
            self.irq_since = None;
            return true;
        }
        false
    }

    /// Before sleeping: an interrupt held back for coalescing fires now.
    pub fn release_held_irq(&mut self, shared: &Shared) {
        if self.irq_held > 0 {
            self.irq_held = 0;
            self.irq_since = None;
            shared.irqs.signal(self.cq.vector);
        }
    }
}
