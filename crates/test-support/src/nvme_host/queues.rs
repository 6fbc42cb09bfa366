//! The fake host's queues: placing commands, ringing doorbells (as register writes,
//! or through the shadow doorbell buffer with EventIdx), reaping completions.

use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

use initiator::cmd::CqRing;
use initiator::{Completion, Sqe};
use zerocopy::IntoBytes;

use super::layout::{BASE, DOORBELLS, PAGE, Q};
use super::Host;
use crate::nvme_cmd::{set_prp, sqe, Outcome};
use crate::wait::poll_until;

/// Byte offset of queue `qid`'s SQ tail (or, with `cq`, CQ head) doorbell among the
/// doorbells, and in a shadow doorbell buffer.
fn db_index(qid: u16, cq: bool) -> u64 {
    (u64::from(qid) * 2 + u64::from(cq)) * 4
}

impl Host {
    /// Rings like a client whose doorbells are trapped: each ring is a register
    /// write, which also wakes the poller that owns the queue. With a shadow
    /// buffer, stores there and rings only when the EventIdx asks for it.
    fn ring(&mut self, qid: u16, cq: bool, v: u16) {
        let idx = db_index(qid, cq);
        if let (Some(db), true) = (self.shadow, qid != 0) {
            let old = self.read_u32(db + idx) as u16;
            self.write_mem(db + idx, &u32::from(v).to_le_bytes());
            fence(Ordering::SeqCst);
            let Some(ei) = self.event_idx else { return };
            let e = self.read_u32(ei + idx) as u16;
            if v.wrapping_sub(e).wrapping_sub(1) >= v.wrapping_sub(old) {
                return;
            }
        }
        self.rung += 1;
        self.ctrl
            .bar0_write(DOORBELLS + idx, &u32::from(v).to_le_bytes());
    }

    /// Rings a raw SQ tail value (for hostile tests).
    pub fn ring_sq_raw(&mut self, qid: u16, v: u16) {
        self.ring(qid, false, v);
    }

    /// Stores a raw CQ head value into the doorbell page, as a client that mapped
    /// the page does (no message: nothing checks it until the controller reads it).
    pub fn store_cq_head_raw(&self, qid: u16, v: u16) {
        let off = usize::try_from(DOORBELLS + db_index(qid, true)).expect("offset");
        self.ctrl
            .doorbells()
            .all()
            .store_u32(off, u32::from(v))
            .expect("doorbell page");
    }

    /// The phase tag of every entry of the CQ that SQ `qid` posts to, as the
    /// controller left it (without consuming anything).
    pub fn cq_phases(&mut self, qid: u16) -> Vec<bool> {
        let q = *self.q(qid);
        (0..u64::from(q.ring.depth))
            .map(|i| self.read_mem(q.cq + i * 16 + 14, 1)[0] & 1 == 1)
            .collect()
    }

    fn q(&mut self, qid: u16) -> &mut Q {
        if qid == 0 {
            &mut self.admin
        } else {
            &mut self.io[usize::from(qid)]
        }
    }

    /// Places `s` in queue `qid` with a new CID, without ringing; that CID.
    fn place(&mut self, qid: u16, mut s: Sqe) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        s.cid = self.cid;
        let q = *self.q(qid);
        self.write_mem(q.sq + u64::from(q.tail) * 64, s.as_bytes());
        self.q(qid).tail = (q.tail + 1) % q.size;
        s.cid
    }

    /// Places a command in queue `qid` and rings the doorbell; returns its CID.
    pub fn submit(&mut self, qid: u16, s: Sqe) -> u16 {
        let cid = self.place(qid, s);
        let tail = self.q(qid).tail;
        self.ring(qid, false, tail);
        cid
    }

    /// Places commands in queue `qid` and rings its doorbell once, so the
    /// controller sees them as one batch; returns their CIDs.
    pub fn submit_batch(&mut self, qid: u16, cmds: &[Sqe]) -> Vec<u16> {
        let cids = cmds.iter().map(|c| self.place(qid, *c)).collect();
        let tail = self.q(qid).tail;
        self.ring(qid, false, tail);
        cids
    }

    /// Next completion of CQ `qid`, if posted.
    pub fn try_reap(&mut self, qid: u16) -> Option<Completion> {
        let q = *self.q(qid);
        let len = usize::from(q.ring.depth) * 16;
        let ring = self.region.slice(q.cq - BASE, len).expect("CQ in memory");
        let mut cq = q.ring;
        let cqe = cq.pop(&ring)?;
        self.q(qid).ring = cq;
        self.ring(qid, true, cq.head);
        Some(cqe.into())
    }

    /// The next completion of CQ `qid`; fails the test after 5 s.
    #[track_caller]
    pub fn reap(&mut self, qid: u16) -> Completion {
        let mut got = None;
        poll_until(Duration::from_secs(5), || {
            got = self.try_reap(qid);
            got.is_some()
        });
        got.unwrap_or_else(|| panic!("no completion on queue {qid}"))
    }

    /// The next `n` completions of CQ `qid`, in the order posted; fails the test
    /// when they do not all come within 5 s.
    #[track_caller]
    pub fn reap_n(&mut self, qid: u16, n: usize) -> Vec<Completion> {
        (0..n).map(|_| self.reap(qid)).collect()
    }

    /// Submit and wait for the completion.
    #[track_caller]
    pub fn cmd(&mut self, qid: u16, s: Sqe) -> Completion {
        let cid = self.submit(qid, s);
        let cq = self.q(qid).cqid;
        let c = self.reap(cq);
        assert_eq!(c.cid, cid);
        c
    }

    #[track_caller]
    pub fn admin(&mut self, s: Sqe) -> Completion {
        self.cmd(0, s)
    }

    #[track_caller]
    pub fn io(&mut self, s: Sqe) -> Completion {
        self.cmd(1, s)
    }

    pub fn create_cq(&mut self, qid: u16, size: u16, ien: bool, vector: u16) -> Completion {
        let cq = self.alloc((u64::from(size) * 16).div_ceil(PAGE));
        let mut s = sqe(0x05, 0);
        set_prp(&mut s, cq, 0);
        s.cdw10 = u32::from(qid) | (u32::from(size.wrapping_sub(1)) << 16);
        s.cdw11 = 1 | (u32::from(ien) << 1) | (u32::from(vector) << 16);
        let c = self.admin(s);
        if c.ok() {
            let q = &mut self.io[usize::from(qid)];
            q.cq = cq;
            q.ring = CqRing::new(size);
        }
        c
    }

    pub fn create_sq(&mut self, qid: u16, size: u16, cqid: u16) -> Completion {
        let sq = self.alloc((u64::from(size) * 64).div_ceil(PAGE));
        let mut s = sqe(0x01, 0);
        set_prp(&mut s, sq, 0);
        s.cdw10 = u32::from(qid) | (u32::from(size.wrapping_sub(1)) << 16);
        s.cdw11 = 1 | (u32::from(cqid) << 16);
        let c = self.admin(s);
        if c.ok() {
            let q = &mut self.io[usize::from(qid)];
            q.sq = sq;
            q.size = size;
            q.cqid = cqid;
            q.tail = 0;
        }
        c
    }

    /// Enable + one I/O queue pair (qid 1, 64 entries, vector 1).
    pub fn ready(&mut self, ien: bool) {
        self.enable();
        assert!(self.create_cq(1, 64, ien, 1).ok());
        assert!(self.create_sq(1, 64, 1).ok());
    }

    /// Enables the controller with Doorbell Buffer Config (shadow doorbells and
    /// EventIdx, one page each, as Linux uses them) and one I/O queue pair with
    /// interrupts; returns the EventIdx page's address.
    pub fn ready_with_shadow(&mut self) -> u64 {
        self.enable();
        let db = self.alloc(1);
        let ei = self.alloc(1);
        let mut s = sqe(0x7c, 0);
        set_prp(&mut s, db, ei);
        assert!(self.admin(s).ok());
        self.shadow = Some(db);
        self.event_idx = Some(ei);
        assert!(self.create_cq(1, 64, true, 1).ok());
        assert!(self.create_sq(1, 64, 1).ok());
        ei
    }

    /// The EventIdx the controller published for SQ 1 in the shadow doorbell
    /// buffer's EventIdx page at `ei` (from [`Host::ready_with_shadow`]).
    pub fn sq1_event_idx(&self, ei: u64) -> u16 {
        self.read_u32(ei + 8) as u16
    }
}
