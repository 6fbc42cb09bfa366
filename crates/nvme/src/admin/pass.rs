//! The admin queue pass: read the admin doorbells, post what finished outside a
//! pass and the events outstanding requests wait for, fetch and execute new
//! commands, push what was posted to unshared client memory, signal vector 0.
//! Runs with the controller's state locked, on whatever thread runs admin passes
//! (`service.rs`).

use std::sync::atomic::Ordering;
use std::time::Instant;

use guest_mem::{Access, DmaSlice, MemoryMap};

use crate::ctrl::{AdminQueues, Inner, State};
use crate::log::ErrorEntry;
use crate::queue::{db_index, ring_ranges, Sqe, CQE_SIZE, SQE_SIZE};
use crate::status::Status;
use crate::DOORBELL_OFFSET;

/// The admin queue pair's rings in guest memory, for one admin pass.
struct AdminRings<'m> {
    sq: DmaSlice<'m>,
    cq: DmaSlice<'m>,
}

/// Posts queued events to outstanding Asynchronous Event Requests, as far as the
/// CQ has room (none while paused: the events wait, for `resume` or the successor).
fn post_events(st: &mut State, q: &mut AdminQueues, cq_ring: &DmaSlice<'_>) -> usize {
    let mut posted = 0;
    while !st.paused && q.cq.free() > 0 && !st.events.is_empty() && !st.aer.is_empty() {
        let (Some(ev), cid) = (st.events.pop_front(), st.aer.remove(0)) else {
            break;
        };
        if !q.cq.post(cq_ring, ev, q.sq.head, 0, cid, Status::SUCCESS) {
            break;
        }
        posted += 1;
    }
    posted
}

impl Inner {
    /// Whether [`Inner::admin_poll`] has something to do: commands, events or
    /// finished commands to post, or an expired Keep Alive Timer.
    pub fn admin_pending(&self, st: &State) -> bool {
        let Some(q) = st.admin else { return false };
        if st.paused {
            return !st.done.is_empty();
        }
        if st.keep_alive.is_some_and(|t| Instant::now() > t) {
            return true;
        }
        let tail = self
            .shared
            .doorbells
            .all()
            .load_u32(DOORBELL_OFFSET as usize + db_index(0, false))
            .map(u32::from_le)
            .unwrap_or(0);
        tail != u32::from(q.sq.head)
            || (!st.events.is_empty() && !st.aer.is_empty())
            || !st.done.is_empty()
    }

    /// One pass over the admin queue. Returns the number of commands handled.
    pub fn admin_poll(&self, st: &mut State) -> usize {
        let Some(mut q) = st.admin else { return 0 };
        if !self.admin_alive(st) {
            return 0;
        }
        let Some(tail) = self.admin_doorbells(&mut q) else {
            return 0;
        };
        // Paused (`handover/`): only commands that finished already are posted;
        // nothing new is fetched and events wait.
        let fetch = !st.paused;
        let pending_aer = fetch && !st.events.is_empty() && !st.aer.is_empty();
        let new_cmds = fetch && tail != q.sq.head;
        if !new_cmds && !pending_aer && st.done.is_empty() {
            return 0;
        }
        let (_, map) = self.mem.snapshot();
        let Some(rings) = self.admin_rings(&map, &q, new_cmds.then_some(tail)) else {
            return 0;
        };
        let first = q.cq.tail;
        let mut posted = self.post_finished(st, &mut q, &rings.cq);
        // Events wait for an Asynchronous Event Request: those outstanding now, and
        // (after the commands) those this pass fetches, or an event queued while
        // that request's doorbell was on its way would wait for the next admin
        // command.
        posted += post_events(st, &mut q, &rings.cq);
        if fetch && !self.run_admin_commands(st, &mut q, &map, &rings, tail, &mut posted) {
            return posted;
        }
        posted += post_events(st, &mut q, &rings.cq);
        if st.admin.is_some() {
            st.admin = Some(q);
        }
        if posted > 0 {
            // Unshared client memory: what we posted goes over before the interrupt.
            let written = ring_ranges(q.cq.base, first, q.cq.tail, q.cq.size, CQE_SIZE);
            if map.push(&written).is_err() {
                self.shared
                    .set_fatal("cannot send admin CQ entries to the client");
                return posted;
            }
            self.shared.irqs.signal(0);
        }
        posted.max(1)
    }

    /// Whether an admin pass may run: not once the controller is fatal. An
    /// expired Keep Alive Timer makes it so (NVMe 1.4 §7.12: the host stopped
    /// sending Keep Alive within KATO).
    fn admin_alive(&self, st: &mut State) -> bool {
        if self.shared.fatal.load(Ordering::Acquire) {
            return false;
        }
        if st.keep_alive.is_some_and(|t| Instant::now() > t) {
            st.keep_alive = None;
            self.shared.set_fatal(&format!(
                "keep alive timeout expired (KATO {} ms)",
                st.features.kato
            ));
            return false;
        }
        true
    }

    /// The admin SQ tail doorbell; the CQ head doorbell goes into `q`. `None`: a
    /// doorbell beyond its queue's size, which makes the controller fatal.
    fn admin_doorbells(&self, q: &mut AdminQueues) -> Option<u16> {
        let page = self.shared.doorbells.all();
        let db = |qid, cq| {
            page.load_u32(DOORBELL_OFFSET as usize + db_index(qid, cq))
                .map(u32::from_le)
                .unwrap_or(0)
        };
        let tail = db(0, false);
        let head = db(0, true);
        if tail >= u32::from(q.sq.size) || head >= u32::from(q.cq.size) {
            self.shared.set_fatal("admin doorbell beyond queue size");
            return None;
        }
        q.cq.head = head as u16;
        Some(tail as u16)
    }

    /// The admin rings in guest memory, with the entries up to `new_tail` fetched
    /// first from unshared client memory (docs/decisions/0020-dma-messages.md).
    /// `None`: unmapped or unreachable, which makes the controller fatal.
    fn admin_rings<'m>(
        &self,
        map: &'m MemoryMap,
        q: &AdminQueues,
        new_tail: Option<u16>,
    ) -> Option<AdminRings<'m>> {
        let (Ok(sq), Ok(cq)) = (
            map.translate(q.sq.base, q.sq.ring_bytes(), Access::Read),
            map.translate(q.cq.base, q.cq.ring_bytes(), Access::Write),
        ) else {
            self.shared.set_fatal("admin queue memory unmapped");
            return None;
        };
        if let Some(tail) = new_tail {
            let new = ring_ranges(q.sq.base, q.sq.head, tail, q.sq.size, SQE_SIZE);
            if map.fetch(&new).is_err() {
                self.shared
                    .set_fatal("cannot fetch admin SQ entries from the client");
                return None;
            }
        }
        Some(AdminRings { sq, cq })
    }

    /// Posts admin commands that finished after they left `exec_admin` (Format
    /// NVM), as far as the CQ has room.
    fn post_finished(&self, st: &mut State, q: &mut AdminQueues, cq_ring: &DmaSlice<'_>) -> usize {
        let mut posted = 0;
        while q.cq.free() > 0 {
            let Some((cid, status)) = st.done.pop_front() else {
                break;
            };
            if !status.is_ok() {
                self.record_admin_error(cid, status, 0);
            }
            if !q.cq.post(cq_ring, 0, q.sq.head, 0, cid, status) {
                break;
            }
            posted += 1;
        }
        posted
    }

    /// Fetches and executes the commands up to `tail` as far as the CQ has room
    /// for their completions, counting them in `posted`. False: the controller
    /// went fatal, and the pass ends there.
    fn run_admin_commands(
        &self,
        st: &mut State,
        q: &mut AdminQueues,
        map: &MemoryMap,
        rings: &AdminRings<'_>,
        tail: u16,
        posted: &mut usize,
    ) -> bool {
        while q.sq.head != tail && q.cq.free() > 0 {
            let Some(sqe) = Sqe::fetch(&rings.sq, q.sq.head) else {
                self.shared.set_fatal("cannot read admin SQ entry");
                return false;
            };
            q.sq.advance();
            st.admin_commands = st.admin_commands.wrapping_add(1);
            let Some((dw0, status)) = self.exec_admin_pcie(st, map, &sqe) else {
                // Completes later (Format NVM).
                continue;
            };
            if !status.is_ok() {
                tracing::debug!(
                    opcode = sqe.opcode(),
                    cdw10 = format_args!("{:#x}", sqe.cdw(10)),
                    status = format_args!("{:#x}", status.0),
                    "nvme: admin command failed"
                );
                self.record_admin_error(sqe.cid(), status, sqe.nsid());
            }
            if !q.cq.post(&rings.cq, dw0, q.sq.head, 0, sqe.cid(), status) {
                self.shared.set_fatal("cannot write admin CQ entry");
                return false;
            }
            *posted += 1;
        }
        true
    }

    fn record_admin_error(&self, cid: u16, status: Status, nsid: u32) {
        self.shared.record_error(ErrorEntry {
            count: 0,
            sqid: 0,
            cid,
            status,
            lba: 0,
            nsid,
        });
    }
}
