//! One poll of a queue group, in the stages of `virtio-blk`'s worker: reap backend
//! completions, then for each SQ fetch its new commands and submit them (reads and
//! writes in batches, everything else at once), then post what completed and signal
//! the interrupt. Guest memory (CQ ring, shadow doorbells) is translated once per
//! poll into a [`Pass`]; a command pins the snapshot it was translated against until
//! its last backend request completes.
//!
//! With mirrors of unshared client memory (docs/decisions/0020-dma-messages.md)
//! three stages talk to the client: new SQ entries come over before they are read,
//! a batch's write data before it is submitted, and completions go out at the end
//! (`completions.rs`). PRP lists and SGL segments come over as they are walked.
//! Each of these costs one branch when the map has no mirror.

use std::sync::atomic::Ordering;

use guest_mem::{Access, DmaSlice, MemView, MemoryMap};
use smallvec::SmallVec;
use trace::Stamps;

use super::completions::Completions;
use super::exec::{decode_rw, exec, facts, map_rw, Exec};
use super::shadow::{keep_behind, read_db, shadow_page, Shadow};
use super::{IoSq, NsTable, QueueGroup, Slot};
use crate::decode::{OP_READ, OP_WRITE};
use crate::iov::Iov;
use crate::log::bump;
use crate::queue::{ring_ranges, CqRing, Sqe, SQE_SIZE};
use crate::shared::Shared;
use crate::status::{Nvme, Status};
use bdev::{IoOp, IoRequest, Prefetch};
use frontend_core::Protocol;

/// Commands taken from one SQ per poll, so one busy queue cannot starve the others.
const BUDGET: u32 = 128;
/// Reads and writes parsed before they are submitted together (see `submit_batch`).
const BATCH: usize = 32;

/// The controller went fatal (CSTS.CFS, reason logged) during this poll; the poll
/// stops where it is.
pub(crate) struct Fatal;

/// What one poll reads once: the controller, the memory map commands are translated
/// against, the doorbells and the CQ ring.
pub(crate) struct Pass<'m> {
    pub shared: &'m Shared,
    pub view: &'m MemView,
    pub map: &'m MemoryMap,
    page: DmaSlice<'m>,
    shadow: Option<Shadow>,
    shadow_db: Option<DmaSlice<'m>>,
    cq_ring: DmaSlice<'m>,
    /// The CQ lies in unshared client memory: completions go out at the end.
    pub cq_remote: bool,
}

impl<'m> Pass<'m> {
    /// Translates the CQ ring; with shadow doorbells also reads the CQ head (see
    /// [`Pass::read_cq_head`]).
    fn begin(
        shared: &'m Shared,
        view: &'m MemView,
        shadow: Option<Shadow>,
        cq: &mut CqRing,
    ) -> Result<Pass<'m>, Fatal> {
        let map = view.map();
        let page = shared.doorbells.all();
        let shadow_db = shadow_page(map, shadow);
        let Ok(cq_ring) = map.translate(cq.base, cq.ring_bytes(), Access::Write) else {
            shared.set_fatal("I/O CQ memory unmapped");
            return Err(Fatal);
        };
        let cq_remote = map.touches_remote(cq.base, cq.ring_bytes() as u64);
        let pass = Pass {
            shared,
            view,
            map,
            page,
            shadow,
            shadow_db,
            cq_ring,
            cq_remote,
        };
        // The CQ's EventIdx follows its head on every poll (`end_poll`).
        if pass.shadow_db.is_some() {
            pass.read_cq_head(cq)?;
        }
        Ok(pass)
    }

    /// Reads the CQ head doorbell into `cq`. Without shadow doorbells only when the
    /// CQ seems too full to fetch more (a stale head only under-counts the room):
    /// SPDK's driver rings the CQ head right after the next SQ tail, on the same
    /// cache line, so reading it on every poll takes that line back from the host's
    /// core and the SQ tail read that follows waits for it again
    /// (docs/decisions/0027-prefetch-next-copy.md, stop 32).
    fn read_cq_head(&self, cq: &mut CqRing) -> Result<(), Fatal> {
        let head = read_db(&self.page, self.shadow_db.as_ref(), cq.qid, true);
        if head >= u32::from(cq.size) {
            return Err(self.fatal("CQ head doorbell beyond queue size"));
        }
        cq.head = head as u16;
        Ok(())
    }

    pub fn fatal(&self, why: &str) -> Fatal {
        self.shared.set_fatal(why);
        Fatal
    }

    pub fn cq_ring(&self) -> &DmaSlice<'m> {
        &self.cq_ring
    }

    pub fn shadow(&self) -> Option<Shadow> {
        self.shadow
    }

    fn sq_tail(&self, qid: u16) -> u32 {
        read_db(&self.page, self.shadow_db.as_ref(), qid, false)
    }
}

/// What a poll did so far.
#[derive(Default)]
struct Progress {
    /// Commands fetched.
    fetched: u32,
    /// Something reached a channel, which must be flushed.
    submitted: bool,
    /// The CQ head doorbell was read in this poll.
    cq_head_read: bool,
}

/// Whether to go on to the next SQ.
enum Next {
    Sq,
    /// The client changed its memory map after this poll's snapshot: the commands
    /// left wait for the next poll, which translates against the new one.
    Remap,
}

/// Reads and writes parsed and waiting to be submitted together, their iovecs one
/// after the other in `iov`.
struct Batch<'m> {
    cmds: SmallVec<[u32; BATCH]>,
    iov: Iov<'m>,
}

impl Batch<'_> {
    fn full(&self) -> bool {
        self.cmds.len() == BATCH || !self.iov.has_room()
    }

    fn clear(&mut self) {
        self.cmds.clear();
        self.iov.clear();
    }
}

impl QueueGroup {
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
        let mut p = Progress::default();
        let _ = self.stages(&mut p);
        p.fetched as usize + self.out.posted()
    }

    fn stages(&mut self, p: &mut Progress) -> Result<(), Fatal> {
        let QueueGroup {
            shared,
            view,
            sqs,
            ns,
            shadow,
            out,
            own: _,
        } = self;
        let pass = Pass::begin(shared, view, *shadow, &mut out.cq)?;
        if out.inflight > 0 {
            ns.reap(out, sqs, &pass)?;
        }
        let inflight_before = out.inflight;
        let mut batch = Batch {
            cmds: SmallVec::new(),
            iov: Iov::new(),
        };
        for sq in sqs.iter_mut() {
            match fetch_and_submit(&pass, sq, ns, out, &mut batch, p)? {
                Next::Sq => {}
                Next::Remap => break,
            }
        }
        if p.submitted {
            ns.flush();
        }
        out.end_poll(&pass, sqs, p.fetched + inflight_before)
    }
}

impl QueueGroup {
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
        let _ = self.settle_stages();
        let idle = self.out.inflight == 0;
        if idle {
            self.out.release_held_irq(&self.shared);
            self.view.park();
        }
        idle
    }

    fn settle_stages(&mut self) -> Result<(), Fatal> {
        let QueueGroup {
            shared,
            view,
            sqs,
            ns,
            shadow,
            out,
            own: _,
        } = self;
        let pass = Pass::begin(shared, view, *shadow, &mut out.cq)?;
        let inflight = out.inflight;
        if inflight > 0 {
            for c in ns.all_mut() {
                c.chan.flush();
            }
            ns.reap(out, sqs, &pass)?;
        }
        out.end_poll(&pass, sqs, inflight)
    }
}

impl NsTable {
    /// Stage 1: backend completions become CQEs.
    fn reap(
        &mut self,
        out: &mut Completions,
        sqs: &mut [IoSq],
        pass: &Pass<'_>,
    ) -> Result<(), Fatal> {
        for c in self.all_mut() {
            if c.inflight == 0 {
                continue;
            }
            let mut k = 0u32;
            let mut r = Ok(());
            c.chan.poll(&mut |tag, st| {
                k += 1;
                if r.is_ok() {
                    r = out.backend_done(pass, sqs, tag, st);
                }
            });
            c.inflight = c.inflight.saturating_sub(k);
            r?;
        }
        self.drop_retired();
        Ok(())
    }
}

/// Stages 2 and 3 for one SQ: fetch its new commands (at most `BUDGET`, and never
/// more than its CQ or the backends have room for), execute them, post those that
/// completed at once.
fn fetch_and_submit<'m>(
    pass: &Pass<'m>,
    sq: &mut IoSq,
    ns: &mut NsTable,
    out: &mut Completions,
    batch: &mut Batch<'m>,
    p: &mut Progress,
) -> Result<Next, Fatal> {
    let ring = pass
        .map
        .translate(sq.ring.base, sq.ring.ring_bytes(), Access::Read);
    let tail = pass.sq_tail(sq.ring.qid);
    // The next entry's line is requested together with the doorbell's: the host
    // writes the entry, then rings, so both lines come from its core, and two
    // misses in flight at once cost about one (docs/decisions/0027-prefetch-
    // next-copy.md, stop 32). After the doorbell's load, so that a new tail comes
    // with the entry written before it. Harmless when nothing new is there.
    if let Ok(r) = &ring {
        r.prefetch_line(usize::from(sq.ring.head) * SQE_SIZE);
    }
    if tail >= u32::from(sq.ring.size) {
        return Err(pass.fatal("SQ tail doorbell beyond queue size"));
    }
    let tail = tail as u16;
    if tail == sq.ring.head {
        return Ok(Next::Sq);
    }
    // The map may have changed after this poll's refresh but before the host rang
    // (e.g. DMA_MAP, then a command using it): take the new one first.
    if !pass.view.is_current() {
        return Ok(Next::Remap);
    }
    if pass.shadow().is_some() {
        bump(&out.pcie.shadow_reads, 1);
    }
    if pass.map.has_remote() {
        fetch_entries(pass, sq, tail)?;
    }
    let Ok(sq_ring) = ring else {
        return Err(pass.fatal("I/O SQ memory unmapped"));
    };
    prefetch_entries(&sq_ring, sq.ring.head, tail, sq.ring.size);
    // One doorbell-seen stamp serves the whole batch.
    let kick = out.rec.kick();
    // Back-pressure: what the backends cannot take now stays in the SQ.
    let mut budget = BUDGET.min(u32::try_from(ns.room()).unwrap_or(u32::MAX));
    batch.clear();
    while sq.ring.head != tail && budget > 0 && cq_room(pass, out, batch, p)? {
        let Some(idx) = sq.free.pop() else { break };
        let Some(sqe) = Sqe::fetch(&sq_ring, sq.ring.head) else {
            return Err(pass.fatal("cannot read SQ entry"));
        };
        sq.ring.advance();
        budget -= 1;
        p.fetched += 1;
        let rw = matches!(sqe.opcode(), OP_READ | OP_WRITE);
        // Anything but a read or write keeps its place: the batch before it goes to
        // the backend first.
        if !batch.cmds.is_empty() && (!rw || batch.full()) {
            p.submitted = true;
            submit_batch(pass, sq, batch, ns, out)?;
            batch.clear();
        }
        let Some(slot) = sq.slots.get_mut(idx as usize) else {
            continue;
        };
        slot.stamps = Stamps {
            kick: out.rec.sample(kick),
            ..Stamps::default()
        };
        let done = if rw {
            if !batch.iov.has_room() {
                // Segments of failed walks only; no command holds any.
                batch.iov.clear();
            }
            batch.iov.next_command();
            let facts = ns.get(sqe.nsid()).map(|c| facts(pass.shared, c));
            let decoded = decode_rw(facts, &sqe, slot);
            // The batch's first read starts loading as soon as its range is known,
            // under the walk of its data pointer: with more entries to parse
            // first, its first blocks; else only its first lines (docs/decisions/
            // 0027-prefetch-next-copy.md, stop 32).
            if let (Ok(_), true, Some(c)) = (&decoded, batch.cmds.is_empty(), ns.get_mut(slot.nsid))
            {
                let when = if sq.ring.head == tail {
                    Prefetch::Now
                } else {
                    Prefetch::Soon
                };
                c.chan.prefetch(&hint(slot), when);
            }
            match decoded.and_then(|access| map_rw(pass.map, &sqe, slot, access, &mut batch.iov)) {
                Ok(()) => {
                    batch.cmds.push(idx);
                    None
                }
                Err(st) => Some(st),
            }
        } else {
            p.submitted = true;
            let tag = (u64::from(sq.ring.qid) << 32) | u64::from(idx);
            match exec(
                pass.map,
                pass.shared,
                ns.get_mut(sqe.nsid()),
                &sqe,
                tag,
                slot,
            ) {
                Exec::Done(st) => Some(st),
                Exec::Pending(n) => {
                    out.hold(pass.view, slot, n);
                    None
                }
            }
        };
        if let Some(st) = done {
            out.finish(pass, sq, idx, st)?;
        }
    }
    if !batch.cmds.is_empty() {
        p.submitted = true;
        submit_batch(pass, sq, batch, ns, out)?;
    }
    let in_use = (sq.slots.len() - sq.free.len()) as u32;
    if let Some(s) = pass.shadow() {
        let ring = (sq.ring.head, sq.ring.size);
        keep_behind(pass.map, s, (sq.ring.qid, false), ring, in_use, &mut sq.ei);
    }
    Ok(Next::Sq)
}

/// Requests the lines of SQ entries after `head` up to `tail` (at most a batch; the
/// one at `head` was requested with the doorbell): each is a line the host wrote on
/// its core, and requested together their misses overlap instead of each waiting in
/// turn while the one before it is parsed.
fn prefetch_entries(ring: &DmaSlice<'_>, head: u16, tail: u16, size: u16) {
    let size = u32::from(size);
    let new = (u32::from(tail) + size - u32::from(head)) % size.max(1);
    for k in 1..new.min(BATCH as u32) {
        let i = (u32::from(head) + k) % size;
        ring.prefetch_line(i as usize * SQE_SIZE);
    }
}

/// Whether the CQ has room for one more command beyond those in flight, waiting to
/// be posted or parsed in `batch`: every command fetched has its CQ entry spoken
/// for. The head doorbell is read again (once per poll) before saying no.
#[inline]
fn cq_room(
    pass: &Pass<'_>,
    out: &mut Completions,
    batch: &Batch<'_>,
    p: &mut Progress,
) -> Result<bool, Fatal> {
    let needed = out.inflight + out.deferred() + batch.cmds.len() as u32;
    if out.cq.free() > needed {
        return Ok(true);
    }
    if p.cq_head_read {
        return Ok(false);
    }
    p.cq_head_read = true;
    pass.read_cq_head(&mut out.cq)?;
    Ok(out.cq.free() > needed)
}

/// With the SQ ring in unshared client memory: fetches the entries the host added
/// since the last fetch (one message for the lot).
#[cold]
fn fetch_entries(pass: &Pass<'_>, sq: &mut IoSq, tail: u16) -> Result<(), Fatal> {
    let (head, size) = (sq.ring.head, sq.ring.size);
    // Entries from `head` up to `synced` came over already (it is reset to the
    // head whenever the group is placed, see `QueueGroup::resync`).
    let ahead = |i: u16| (u32::from(i) + u32::from(size) - u32::from(head)) % u32::from(size);
    let from = if ahead(sq.synced) <= ahead(tail) {
        sq.synced
    } else {
        head
    };
    if from != tail {
        let ranges = ring_ranges(sq.ring.base, from, tail, size, SQE_SIZE);
        if pass.map.fetch(&ranges).is_err() {
            return Err(pass.fatal("cannot fetch SQ entries from the client"));
        }
    }
    sq.synced = tail;
    Ok(())
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

/// A decoded read or write as a prefetch hint, before its data pointer is walked
/// (a read's hint needs only its range).
fn hint(slot: &Slot) -> IoRequest<'static> {
    IoRequest {
        op: if slot.opcode == OP_WRITE {
            IoOp::Write
        } else {
            IoOp::Read
        },
        offset: slot.offset,
        len: slot.bytes,
        iov: &[],
        fua: slot.fua,
    }
}

/// The backend request of a parsed read or write in `batch`.
fn request<'b>(slot: &Slot, batch: &'b Batch<'_>) -> IoRequest<'b> {
    IoRequest {
        iov: batch.iov.segments(slot.segs),
        ..hint(slot)
    }
}

/// Submits a batch of parsed reads and writes back to back, posting each one's CQE as
/// soon as the backend finished it inline: a polling client resubmits while the rest
/// of the batch is copied (docs/decisions/0028-post-each-completion.md). Parsing them
/// all first lets one clock read between two submit calls be both the earlier
/// command's "completed" and the later one's "submitted" stamp, without moving any
/// command's fetch or parse into its backend layer: a traced batch of n reads the
/// clock n + 1 times instead of 2n. The commands' `queue` layer includes the submits
/// (and posts) before theirs.
fn submit_batch(
    pass: &Pass<'_>,
    sq: &mut IoSq,
    batch: &Batch<'_>,
    ns: &mut NsTable,
    out: &mut Completions,
) -> Result<(), Fatal> {
    if pass.map.has_remote() {
        sync_batch(pass, sq, batch);
    }
    // The last clock read, if it was taken right after the previous submit call.
    let mut last: Option<u64> = None;
    for (i, &idx) in batch.cmds.iter().enumerate() {
        // While this one is copied, the next one's data is on its way to the cache.
        if let Some(next) = batch
            .cmds
            .get(i + 1)
            .and_then(|&n| sq.slots.get(n as usize))
        {
            let same_channel = sq.slots.get(idx as usize).map(|s| s.nsid) == Some(next.nsid);
            if let (true, Some(c)) = (next.status.is_ok(), ns.get_mut(next.nsid)) {
                let when = if same_channel {
                    Prefetch::AfterCurrent
                } else {
                    Prefetch::Soon
                };
                c.chan.prefetch(&request(next, batch), when);
            }
        }
        if let Some(status) = submit_one(sq, idx, batch, ns, out, pass, &mut last) {
            out.finish(pass, sq, idx, status)?;
        }
    }
    Ok(())
}

/// Submits command `idx` of a batch to its namespace's channel; its status when it is
/// done (completed inline, or failed before reaching the backend) and its CQE can go
/// out.
#[inline]
fn submit_one(
    sq: &mut IoSq,
    idx: u32,
    batch: &Batch<'_>,
    ns: &mut NsTable,
    out: &mut Completions,
    pass: &Pass<'_>,
    last: &mut Option<u64>,
) -> Option<Status> {
    let qid = sq.ring.qid;
    let slot = sq.slots.get_mut(idx as usize)?;
    let done = |slot: &Slot| (slot.pending == 0).then_some(slot.status);
    if !slot.status.is_ok() {
        // Its data never came over (see `sync_batch`).
        return done(slot);
    }
    // `decode_rw` found the namespace, and the table only changes off the reactor.
    let Some(c) = ns.get_mut(slot.nsid) else {
        slot.status = Status::INVALID_NAMESPACE;
        return done(slot);
    };
    let req = request(slot, batch);
    let op = req.op;
    let traced = slot.stamps.kick != 0;
    if traced {
        slot.stamps.submitted = last.unwrap_or_else(trace::clock::now);
    }
    let r = c.chan.submit(u64::from(qid) << 32 | u64::from(idx), &req);
    *last = traced.then(trace::clock::now);
    match r {
        Some(st) => {
            slot.status = Nvme::from_io(st, op);
            slot.stamps.completed = last.unwrap_or(0);
        }
        None => {
            c.inflight += 1;
            out.hold(pass.view, slot, 1);
        }
    }
    done(slot)
}
