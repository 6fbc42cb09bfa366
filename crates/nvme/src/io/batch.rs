//! Reads and writes parsed in one poll, handed to their namespaces' channels as
//! batches (`bdev::Batch`): each channel orders its own work (a RAM disk copies
//! one request while the next one's data is on its way, io_uring queues them all
//! for one system call), and every inline completion is posted as soon as the
//! channel reports it, so a polling host resubmits while the rest of the batch
//! runs (docs/decisions/0028-post-each-completion.md,
//! 0033-backend-batches.md).

use bdev::{Batch as _, IoRequest, IoStatus};
use frontend_core::Protocol;
use smallvec::SmallVec;

use super::completions::Completions;
use super::exec::io_op;
use super::ns_table::NsTable;
use super::pass::{Fatal, Pass};
use super::sq::{IoSq, Slot};
use crate::decode::OP_WRITE;
use crate::iov::Iov;
use crate::status::{Nvme, Status};

/// Reads and writes parsed before they are submitted together.
pub(super) const BATCH: usize = 32;

/// Reads and writes parsed and waiting to be submitted together, their iovecs one
/// after the other in `iov`.
pub(super) struct Batch<'m> {
    pub cmds: SmallVec<[u32; BATCH]>,
    pub iov: Iov<'m>,
}

impl Batch<'_> {
    pub fn new() -> Self {
        Batch {
            cmds: SmallVec::new(),
            iov: Iov::new(),
        }
    }

    pub fn full(&self) -> bool {
        self.cmds.len() == BATCH || !self.iov.has_room()
    }

    pub fn clear(&mut self) {
        self.cmds.clear();
        self.iov.clear();
    }
}

/// The tag of command `idx` of SQ `qid` in its backend requests.
pub(super) fn tag(qid: u16, idx: u32) -> u64 {
    (u64::from(qid) << 32) | u64::from(idx)
}

/// The backend request of a parsed read or write in `iov`.
fn request<'b>(slot: &Slot, iov: &'b Iov<'_>) -> IoRequest<'b> {
    IoRequest {
        op: io_op(slot.opcode),
        offset: slot.offset,
        len: slot.bytes,
        iov: iov.segments(slot.segs),
        fua: slot.fua,
    }
}

/// With mirrors of unshared client memory: the batch's write data comes over before
/// the backend reads it (one message round for the whole batch), and each read's
/// guest ranges are kept for the push before its completion. A write whose data
/// the client refused fails with Data Transfer Error.
#[cold]
fn sync_batch(pass: &Pass<'_>, sq: &mut IoSq, batch: &Batch<'_>) {
    let mut ranges: Vec<crate::iov::Run> = Vec::new();
    for &idx in &batch.cmds {
        let Some(slot) = sq.slots.get(idx as usize) else {
            continue;
        };
        let runs = batch.iov.runs_of(slot.runs);
        if !pass.map.any_remote(runs) {
            continue;
        }
        if slot.opcode == OP_WRITE {
            ranges.extend_from_slice(runs);
        } else {
            sq.keep_runs(idx, runs);
            if let Some(slot) = sq.slots.get_mut(idx as usize) {
                slot.push = true;
            }
        }
    }
    if ranges.is_empty() || pass.map.fetch(&ranges).is_ok() {
        return;
    }
    for &idx in &batch.cmds {
        let Some(slot) = sq.slots.get_mut(idx as usize) else {
            continue;
        };
        if slot.opcode == OP_WRITE && pass.map.fetch(batch.iov.runs_of(slot.runs)).is_err() {
            slot.status = Status::DATA_TRANSFER_ERROR;
        }
    }
}

/// Submits a batch of parsed reads and writes: each run of commands to one
/// namespace goes to its channel as one `bdev::Batch`. A command that cannot reach
/// its backend (its data never came over, or its namespace went) finishes here.
///
/// Trace stamps: one clock read between two starts is both the earlier command's
/// "completed" and the later one's "submitted" stamp, without moving any command's
/// fetch or parse into its backend layer: a traced batch of n reads the clock n + 1
/// times instead of 2n. The commands' `queue` layer includes the starts (and posts)
/// before theirs.
pub(super) fn submit_batch(
    pass: &Pass<'_>,
    sq: &mut IoSq,
    batch: &Batch<'_>,
    ns: &mut NsTable,
    out: &mut Completions,
) -> Result<(), Fatal> {
    if pass.map.has_remote() {
        sync_batch(pass, sq, batch);
    }
    let mut last = None;
    let mut cmds = &batch.cmds[..];
    while let Some(&first) = cmds.first() {
        let Some(slot) = sq.slots.get_mut(first as usize) else {
            cmds = &cmds[1..];
            continue;
        };
        let nsid = slot.nsid;
        // `decode_rw` found the namespace, and the table only changes off the reactor.
        let chan = ns.get_mut(nsid).filter(|_| slot.status.is_ok());
        let Some(c) = chan else {
            if slot.status.is_ok() {
                slot.status = Status::INVALID_NAMESPACE;
            }
            let status = slot.status;
            out.finish(pass, sq, first, status)?;
            cmds = &cmds[1..];
            continue;
        };
        let same = |&i: &u32| {
            sq.slots
                .get(i as usize)
                .is_some_and(|s| s.nsid == nsid && s.status.is_ok())
        };
        let n = 1 + cmds[1..].iter().take_while(|i| same(i)).count();
        let mut run = Run {
            cmds: &cmds[..n],
            iov: &batch.iov,
            sq: &mut *sq,
            out: &mut *out,
            pass,
            last,
            pending: 0,
            fatal: None,
        };
        run.stamp_submitted(0);
        if n == 1 {
            // Nothing to order: one request goes as one (a batch call would add
            // two indirect calls to every QD1 command).
            let started = run.request(0).map(|(tag, req)| c.chan.submit(tag, &req));
            if let Some(st) = started {
                run.started(0, st);
            }
        } else {
            c.chan.submit_batch(&mut run);
        }
        c.inflight += run.pending;
        last = run.last;
        if let Some(f) = run.fatal {
            return Err(f);
        }
        cmds = &cmds[n..];
    }
    Ok(())
}

/// One channel's run of a batch as the backend sees it: requests built from the
/// commands' slots; each start is posted (inline) or held (asynchronous) as the
/// channel reports it.
struct Run<'r, 'm> {
    cmds: &'r [u32],
    iov: &'r Iov<'m>,
    sq: &'r mut IoSq,
    out: &'r mut Completions,
    pass: &'r Pass<'r>,
    /// The last clock read, if it was taken right after the previous start.
    last: Option<u64>,
    /// Requests the channel now owes a completion.
    pending: u32,
    /// Posting failed: the controller is fatal, nothing more is posted.
    fatal: Option<Fatal>,
}

impl Run<'_, '_> {
    /// Command `i`'s "submitted" stamp, if it is traced: the last clock read if it
    /// was taken right after the previous start.
    fn stamp_submitted(&mut self, i: usize) {
        let Some(slot) = self
            .cmds
            .get(i)
            .and_then(|&c| self.sq.slots.get_mut(c as usize))
        else {
            return;
        };
        if slot.stamps.kick != 0 {
            slot.stamps.submitted = self.last.unwrap_or_else(trace::clock::now);
        }
    }
}

impl bdev::Batch for Run<'_, '_> {
    fn request(&self, i: usize) -> Option<(u64, IoRequest<'_>)> {
        let idx = *self.cmds.get(i)?;
        let slot = self.sq.slots.get(idx as usize)?;
        Some((tag(self.sq.ring.qid, idx), request(slot, self.iov)))
    }

    fn started(&mut self, i: usize, inline: Option<IoStatus>) {
        let Some(&idx) = self.cmds.get(i) else {
            return;
        };
        let Some(slot) = self.sq.slots.get_mut(idx as usize) else {
            return;
        };
        let traced = slot.stamps.kick != 0;
        self.last = traced.then(trace::clock::now);
        let Some(st) = inline else {
            self.pending += 1;
            self.out.hold(self.pass.view, slot, 1);
            self.stamp_submitted(i + 1);
            return;
        };
        slot.status = Nvme::from_io(st, io_op(slot.opcode));
        slot.stamps.completed = self.last.unwrap_or(0);
        let status = slot.status;
        if self.fatal.is_none() {
            if let Err(f) = self.out.finish(self.pass, self.sq, idx, status) {
                self.fatal = Some(f);
            }
        }
        self.stamp_submitted(i + 1);
    }
}
