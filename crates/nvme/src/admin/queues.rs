//! Create/Delete I/O Submission and Completion Queue.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use guest_mem::{Access, MemoryMap};

use crate::ctrl::{Inner, State};
use crate::io::{write_event_idx, write_shadow_db, QueueGroup};
use crate::queue::{db_index, CqRing, SqRing, Sqe, CQE_SIZE, SQE_SIZE};
use crate::regs;
use crate::status::Status;

use super::{err, ok, Done};

impl Inner {
    /// A new queue starts at head = tail = 0: clear what an earlier queue with this id
    /// left in the shared doorbell page, or the poller would run stale entries.
    fn reset_doorbell(&self, qid: u16, cq: bool) {
        let off = crate::DOORBELL_PAGE_OFFSET + db_index(qid, cq);
        self.shared.doorbells.all().store_u32(off, 0);
    }

    fn queue_id(&self, sqe: &Sqe) -> Option<u16> {
        let qid = crate::bits::lo16(sqe.cdw(10));
        (qid != 0 && qid <= self.cfg.max_io_queues).then_some(qid)
    }

    /// Entries requested, checked against MQES.
    fn queue_size(&self, sqe: &Sqe) -> Result<u16, Status> {
        let n = (sqe.cdw(10) >> 16) + 1;
        if n < 2 || n > u32::from(self.cfg.max_queue_entries) {
            return Err(Status::INVALID_QUEUE_SIZE);
        }
        u16::try_from(n).map_err(|_| Status::INVALID_QUEUE_SIZE)
    }

    pub(super) fn create_cq(&self, st: &mut State, map: &MemoryMap, sqe: &Sqe) -> Done {
        let Some(qid) = self.queue_id(sqe).filter(|q| !st.groups.contains_key(q)) else {
            return err(Status::INVALID_QUEUE_ID);
        };
        let size = match self.queue_size(sqe) {
            Ok(s) => s,
            Err(s) => return err(s),
        };
        let cdw11 = sqe.cdw(11);
        let ien = cdw11 & 2 != 0;
        let vector = (cdw11 >> 16) as u16;
        if cdw11 & 1 == 0 || regs::cc_iocqes(st.regs.cc) != 4 {
            return err(Status::INVALID_FIELD);
        }
        if vector >= self.cfg.msix_vectors {
            return err(Status::INVALID_VECTOR);
        }
        let base = sqe.prp1();
        let bytes = usize::from(size) * CQE_SIZE;
        if !base.is_multiple_of(4096) || map.translate(base, bytes, Access::Write).is_err() {
            return err(Status::INVALID_FIELD);
        }
        self.reset_doorbell(qid, true);
        let cq = CqRing::new(qid, base, size, ien, vector);
        let g = match QueueGroup::new(self.shared.clone(), self.mem.clone(), cq, st.shadow, &st.ns)
        {
            Ok(g) => g,
            Err(e) => {
                tracing::error!("nvme: cannot open backend channels: {e}");
                return err(Status::INTERNAL_ERROR);
            }
        };
        if let Some(s) = st.shadow {
            write_shadow_db(map, s, qid, true, 0);
            write_event_idx(map, s, qid, true, 0);
        }
        match self.place_group(st, g) {
            Ok(()) => ok(0),
            Err(s) => err(s),
        }
    }

    pub(super) fn create_sq(&self, st: &mut State, map: &MemoryMap, sqe: &Sqe) -> Done {
        let Some(qid) = self.queue_id(sqe).filter(|q| !st.sq_owner.contains_key(q)) else {
            return err(Status::INVALID_QUEUE_ID);
        };
        let size = match self.queue_size(sqe) {
            Ok(s) => s,
            Err(s) => return err(s),
        };
        let cdw11 = sqe.cdw(11);
        let cqid = (cdw11 >> 16) as u16;
        // NVMe 2.0 base, Create I/O Submission Queue, CDW11.CQID: 0 (the admin CQ)
        // and identifiers beyond the allocated completion queues are not valid
        // queue identifiers at all (Invalid Queue Identifier, as for a bad QID);
        // Completion Queue Invalid is for a valid identifier with no queue created.
        let allocated_cqs = (st.features.queues >> 16) + 1;
        if cqid == 0 || u32::from(cqid) > allocated_cqs {
            return err(Status::INVALID_QUEUE_ID);
        }
        if !st.groups.contains_key(&cqid) {
            return err(Status::CQ_INVALID);
        }
        if cdw11 & 1 == 0 || regs::cc_iosqes(st.regs.cc) != 6 {
            return err(Status::INVALID_FIELD);
        }
        let base = sqe.prp1();
        let bytes = usize::from(size) * SQE_SIZE;
        if !base.is_multiple_of(4096) || map.translate(base, bytes, Access::Read).is_err() {
            return err(Status::INVALID_FIELD);
        }
        let Some(mut g) = self.take_group(st, cqid) else {
            st.groups.remove(&cqid);
            return err(Status::INTERNAL_ERROR);
        };
        self.reset_doorbell(qid, false);
        if let Some(s) = st.shadow {
            write_shadow_db(map, s, qid, false, 0);
            write_event_idx(map, s, qid, false, 0);
        }
        g.add_sq(SqRing {
            qid,
            base,
            size,
            head: 0,
        });
        st.sq_owner.insert(qid, cqid);
        match self.place_group(st, g) {
            Ok(()) => ok(0),
            Err(s) => err(s),
        }
    }

    pub(super) fn delete_sq(&self, st: &mut State, sqe: &Sqe) -> Done {
        let qid = crate::bits::lo16(sqe.cdw(10));
        let Some(cqid) = st.sq_owner.get(&qid).copied().filter(|_| qid != 0) else {
            return err(Status::INVALID_QUEUE_ID);
        };
        st.sq_owner.remove(&qid);
        let Some(mut g) = self.take_group(st, cqid) else {
            st.groups.remove(&cqid);
            return err(Status::INTERNAL_ERROR);
        };
        g.remove_sq(qid);
        match self.place_group(st, g) {
            Ok(()) => ok(0),
            Err(s) => err(s),
        }
    }

    pub(super) fn delete_cq(&self, st: &mut State, sqe: &Sqe) -> Done {
        let qid = crate::bits::lo16(sqe.cdw(10));
        if qid == 0 || !st.groups.contains_key(&qid) {
            return err(Status::INVALID_QUEUE_ID);
        }
        if st.sq_owner.values().any(|c| *c == qid) {
            return err(Status::INVALID_QUEUE_DELETION);
        }
        if let Some(mut g) = self.take_group(st, qid) {
            g.drain();
            st.retire(&g);
        }
        st.groups.remove(&qid);
        ok(0)
    }
}
