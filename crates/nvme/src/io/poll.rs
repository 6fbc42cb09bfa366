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

use guest_mem::{Access, DmaSlice, MemView};
use trace::Stamps;

use super::batch::{submit_batch, tag, Batch, BATCH};
use super::completions::Completions;
use super::exec::{decode_rw, exec, facts, io_op, map_rw, Exec};
use super::ns_table::NsTable;
use super::pass::{Fatal, Pass};
use super::shadow::{keep_behind, Shadow};
use super::sq::{IoSq, Slot};
use crate::decode::{OP_READ, OP_WRITE};
use crate::log::bump;
use crate::queue::{ring_ranges, SqRing, Sqe, SQE_SIZE};
use crate::shared::Shared;
use crate::status::Status;

/// Commands taken from one SQ per poll, so one busy queue cannot starve the others.
const BUDGET: u32 = 128;

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

/// The parts of a queue group one poll works on, borrowed from it.
pub(super) struct Group<'g> {
    pub shared: &'g Shared,
    pub view: &'g MemView,
    pub shadow: Option<Shadow>,
    pub sqs: &'g mut [IoSq],
    pub ns: &'g mut NsTable,
    pub out: &'g mut Completions,
}

/// Stages 1 to 4 of one poll (the caller checked the controller is not fatal and
/// refreshed the view); returns the commands fetched, also when the poll stopped
/// because the controller went fatal.
#[inline]
pub(super) fn run(g: Group<'_>) -> u32 {
    let mut p = Progress::default();
    let _ = stages(g, &mut p);
    p.fetched
}

fn stages(g: Group<'_>, p: &mut Progress) -> Result<(), Fatal> {
    let pass = Pass::begin(g.shared, g.view, g.shadow, &g.out.cq)?;
    g.out.event_idx_if_unknown(&pass);
    if g.out.inflight > 0 {
        g.ns.reap(g.out, g.sqs, &pass)?;
    }
    let inflight_before = g.out.inflight;
    let mut batch = Batch::new();
    for sq in g.sqs.iter_mut() {
        match fetch_and_submit(&pass, sq, g.ns, g.out, &mut batch, p)? {
            Next::Sq => {}
            Next::Remap => break,
        }
    }
    if p.submitted {
        g.ns.flush();
    }
    g.out.end_poll(&pass, g.sqs, p.fetched + inflight_before)
}

/// Quiesce (`QueueGroup::settle`): stages 1 and 4 only, after flushing every
/// channel; nothing is fetched.
pub(super) fn settle(g: Group<'_>) -> Result<(), Fatal> {
    let pass = Pass::begin(g.shared, g.view, g.shadow, &g.out.cq)?;
    g.out.event_idx_if_unknown(&pass);
    let inflight = g.out.inflight;
    if inflight > 0 {
        for c in g.ns.all_mut() {
            c.chan.flush();
        }
        g.ns.reap(g.out, g.sqs, &pass)?;
    }
    g.out.end_poll(&pass, g.sqs, inflight)
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
    let (sq_ring, tail) = match new_entries(pass, sq, out)? {
        Entries::None => return Ok(Next::Sq),
        Entries::Remap => return Ok(Next::Remap),
        Entries::Up(ring, tail) => (ring, tail),
    };
    if let Some(s) = pass.shadow() {
        // EventIdx goes behind this tail before any of these commands completes: a
        // completion tells the driver the new head, and a driver that then fills
        // its free entries would lap an EventIdx still behind the old head and
        // ring. The head it learns is at most this tail, so it never laps that.
        // Its lag is sized by what the driver has shown it puts in at once:
        // commands still with us plus those it just added (with backends that
        // complete at once the first count stays near 0 while a driver refills
        // 32 at a time).
        let in_use = (sq.slots.len() - sq.free.len()) as u32 + sq.ring.ahead(tail);
        sq.peak = sq.peak.max(in_use);
        let ring = (tail, sq.ring.size);
        keep_behind(pass.map, s, sq.ring.qid, ring, sq.peak, &mut sq.ei);
    }
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
        let qid = sq.ring.qid;
        let Some(slot) = sq.slots.get_mut(idx as usize) else {
            continue;
        };
        slot.stamps = Stamps {
            kick: out.rec.sample(kick),
            ..Stamps::default()
        };
        let done = if rw {
            parse_rw(pass, &sqe, idx, slot, ns, batch)
        } else {
            p.submitted = true;
            match exec(
                pass.map,
                pass.shared,
                ns.get_mut(sqe.nsid()),
                &sqe,
                tag(qid, idx),
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
    Ok(Next::Sq)
}

/// What an SQ's doorbell says.
enum Entries<'m> {
    /// Nothing new.
    None,
    /// New entries, but the map changed after this poll's snapshot (see `Next`).
    Remap,
    /// New entries up to this tail, in this ring.
    Up(DmaSlice<'m>, u16),
}

/// Reads the SQ's tail doorbell and, when entries are new, translates the ring and
/// asks for their lines.
fn new_entries<'m>(
    pass: &Pass<'m>,
    sq: &mut IoSq,
    out: &Completions,
) -> Result<Entries<'m>, Fatal> {
    let ring = pass
        .map
        .translate(sq.ring.base, sq.ring.ring_bytes(), Access::Read);
    let tail = pass.sq_tail(sq.ring.qid);
    // The next entry's line is requested together with the doorbell's: the host
    // writes the entry, then rings, so both lines come from its core, and two
    // misses in flight at once cost about one (docs/decisions/0027-prefetch-
    // next-copy.md, "the entries with the doorbell"). After the doorbell's load,
    // so that a new tail comes with the entry written before it. Harmless when
    // nothing new is there.
    if let Ok(r) = &ring {
        r.prefetch_line(usize::from(sq.ring.head) * SQE_SIZE);
    }
    if tail >= u32::from(sq.ring.size) {
        return Err(pass.fatal("SQ tail doorbell beyond queue size"));
    }
    let tail = tail as u16;
    if tail == sq.ring.head {
        return Ok(Entries::None);
    }
    // The map may have changed after this poll's refresh but before the host rang
    // (e.g. DMA_MAP, then a command using it): take the new one first.
    if !pass.view.is_current() {
        return Ok(Entries::Remap);
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
    prefetch_entries(&sq_ring, &sq.ring, tail);
    Ok(Entries::Up(sq_ring, tail))
}

/// Decodes a read or write and maps its data pointer into `batch`; its status if
/// it fails here. The batch's first request is announced to its channel as soon
/// as its range is known, before its data pointer is walked: a backend can start
/// on it under the walk (docs/decisions/0033-backend-batches.md).
fn parse_rw<'m>(
    pass: &Pass<'m>,
    sqe: &Sqe,
    idx: u32,
    slot: &mut Slot,
    ns: &mut NsTable,
    batch: &mut Batch<'m>,
) -> Option<Status> {
    if !batch.iov.has_room() {
        // Segments of failed walks only; no command holds any.
        batch.iov.clear();
    }
    batch.iov.next_command();
    let facts = ns.get(sqe.nsid()).map(|c| facts(pass.shared, c));
    let decoded = decode_rw(facts, sqe, slot);
    if let (Ok(_), true, Some(c)) = (&decoded, batch.cmds.is_empty(), ns.get_mut(slot.nsid)) {
        c.chan.announce(io_op(slot.opcode), slot.offset, slot.bytes);
    }
    match decoded.and_then(|access| map_rw(pass.map, sqe, slot, access, &mut batch.iov)) {
        Ok(()) => {
            batch.cmds.push(idx);
            None
        }
        Err(st) => Some(st),
    }
}

/// Requests the lines of SQ entries after `head` up to `tail` (at most a batch; the
/// one at `head` was requested with the doorbell): each is a line the host wrote on
/// its core, and requested together their misses overlap instead of each waiting in
/// turn while the one before it is parsed.
fn prefetch_entries(ring: &DmaSlice<'_>, sq: &SqRing, tail: u16) {
    let size = u32::from(sq.size);
    for k in 1..sq.ahead(tail).min(BATCH as u32) {
        let i = (u32::from(sq.head) + k) % size;
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
    let from = if sq.ring.ahead(sq.synced) <= sq.ring.ahead(tail) {
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
