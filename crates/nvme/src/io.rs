//! I/O queue groups: one completion queue plus the submission queues that post to
//! it, polled as one [`engine::Poller`] on one reactor. No locks, no allocation per
//! command: slots are preallocated per SQ and iovecs live on the stack.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bdev::{Armed, BlockInfo, IoChannel, IoOp, IoRequest, IoStatus};
use crossbeam_channel::Sender;
use guest_mem::{Access, DmaSlice, DmaSpace, MemPins, MemView, MemoryMap, Pin};
use smallvec::SmallVec;
use std::os::fd::BorrowedFd;
use trace::{OpClass, QueueRecorder, Stamps};

use crate::ctrl::Shared;
use crate::iov::Iov;
use crate::log::{bump, Counters, ErrorEntry};
use crate::namespaces::Ns;
use crate::queue::{db_index, CqRing, SqRing, Sqe};
use crate::status::Status;
use crate::DOORBELL_OFFSET;

use crate::decode::{decode, Facts, IoCmd};
use crate::decode::{OP_DSM, OP_FLUSH, OP_READ, OP_WRITE, OP_WRITE_ZEROES};

/// Commands taken from one SQ per poll, so one busy queue cannot starve the others.
const BUDGET: u32 = 128;
/// Reads and writes parsed before they are submitted together (see `submit_batch`).
const BATCH: usize = 32;
const MAX_DSM_RANGES: usize = 256;

/// Shadow doorbell buffer and EventIdx buffer (Doorbell Buffer Config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shadow {
    pub db: u64,
    pub ei: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    cid: u16,
    opcode: u8,
    /// Backend requests still outstanding (DSM may issue several).
    pending: u16,
    status: Status,
    nsid: u32,
    slba: u64,
    bytes: u64,
    /// Read/Write, parsed and waiting in a batch: byte offset, FUA and where its
    /// iovec is in the batch's `Iov`.
    offset: u64,
    fua: bool,
    segs: (u16, u16),
    /// Trace stamps; `kick == 0` when this command is not traced.
    stamps: Stamps,
    /// Keeps the memory map this command was translated against while the backend
    /// has it.
    pin: Pin,
}

pub(crate) struct IoSq {
    pub ring: SqRing,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// EventIdx we last wrote (`NO_EI`: unknown). Written only when it changes: the
    /// driver reads it after every command, and a store per poll would keep its
    /// cache line bouncing between the driver's CPU and ours.
    ei: u16,
}

/// No EventIdx written yet (queue indices stay below 4096).
const NO_EI: u16 = u16::MAX;

/// One namespace as a queue group sees it: its facts in the current LBA format and
/// this group's channel on the backend. `inflight` counts backend requests this
/// channel still owes a completion.
pub(crate) struct NsChan {
    info: BlockInfo,
    /// A Format NVM is erasing the namespace: commands get Format In Progress.
    formatting: bool,
    chan: Box<dyn IoChannel>,
    inflight: u32,
}

impl NsChan {
    pub fn open(ns: &Ns) -> std::io::Result<NsChan> {
        Ok(NsChan {
            info: ns.info.clone(),
            formatting: ns.formatting,
            chan: ns.dev.channel()?,
            inflight: 0,
        })
    }
}

/// A change of the namespace table, applied to each group while it is off its
/// reactor (see `Inner::change_groups`).
pub(crate) enum NsChange {
    Add(u32, NsChan),
    Remove(u32),
    /// Format NVM: new facts and whether the erase is still running. The channel
    /// stays: backends address bytes, so a new block size needs no new channel.
    Format {
        nsid: u32,
        info: BlockInfo,
        formatting: bool,
    },
}

pub(crate) struct QueueGroup {
    shared: Arc<Shared>,
    view: MemView,
    pub cq: CqRing,
    pub sqs: Vec<IoSq>,
    /// Active namespaces by `nsid - 1`.
    ns: Vec<Option<NsChan>>,
    /// Removed namespaces whose channels still have requests in flight: polled until
    /// those complete, then dropped. New commands never reach them.
    retiring: Vec<NsChan>,
    pub shadow: Option<Shadow>,
    /// The CQ's EventIdx as last written (see `IoSq::ei`).
    cq_ei: u16,
    /// Completions posted but not yet signalled (Interrupt Coalescing), and when
    /// the first of them was.
    irq_held: u32,
    irq_since: Option<Instant>,
    pub counters: Arc<Counters>,
    inflight: u32,
    /// The memory snapshots commands in flight were translated against.
    pins: MemPins,
    /// Metrics and trace data of this group (owned by the polling thread).
    pub rec: QueueRecorder,
}

enum Exec {
    Done(Status),
    Pending(u16),
}

/// The shadow doorbell page (Doorbell Buffer Config makes both buffers one
/// page-aligned page), translated once per poll.
fn shadow_page<'a>(map: &'a MemoryMap, shadow: Option<Shadow>) -> Option<DmaSlice<'a>> {
    shadow.and_then(|s| map.translate(s.db, 4096, Access::Read).ok())
}

/// Current doorbell value: from the shadow buffer when configured (falling back to
/// the doorbell page if the host unmapped it), else from the doorbell page.
fn read_db(page: &DmaSlice<'_>, shadow: Option<&DmaSlice<'_>>, qid: u16, cq: bool) -> u32 {
    let idx = db_index(qid, cq);
    if let Some(v) = shadow.and_then(|s| s.load_u32(idx)) {
        return u32::from_le(v);
    }
    page.load_u32(DOORBELL_OFFSET as usize + idx)
        .map(u32::from_le)
        .unwrap_or(0)
}

pub(crate) fn write_event_idx(map: &MemoryMap, shadow: Shadow, qid: u16, cq: bool, v: u16) {
    if let Some(w) = shadow
        .ei
        .checked_add(db_index(qid, cq) as u64)
        .and_then(|a| map.translate(a, 4, Access::Write).ok())
    {
        w.store_u32(0, u32::from(v).to_le());
    }
}

pub(crate) fn write_shadow_db(map: &MemoryMap, shadow: Shadow, qid: u16, cq: bool, v: u16) {
    if let Some(w) = shadow
        .db
        .checked_add(db_index(qid, cq) as u64)
        .and_then(|a| map.translate(a, 4, Access::Write).ok())
    {
        w.store_u32(0, u32::from(v).to_le());
    }
}

/// The EventIdx that asks a driver not to ring while we poll: the entry just behind
/// the one we expect next. Drivers ring when an update moves their index past
/// EventIdx (`event_idx` in `[old, new)`), which one behind never is.
fn behind(idx: u16, size: u16) -> u16 {
    idx.checked_sub(1).unwrap_or(size.saturating_sub(1))
}

/// Whether an awake group should move EventIdx (last written `ei`) up to `idx`.
/// Not on every command: the driver reads EventIdx after each of its updates, so
/// a store per command moves that cache line between its CPU and ours each time
/// (measured: ~0.05-0.15 µs per QD1 I/O). A driver rings only when its index laps
/// a lagging EventIdx, which needs more than `size - 1 - lag` entries in use; so
/// the lag allowed is half the entries `in_use` leaves free (at most a quarter of
/// the queue). Before sleeping the group sets EventIdx exactly (`prepare_sleep`).
fn ei_stale(ei: u16, idx: u16, size: u16, in_use: u32) -> bool {
    if ei == NO_EI || ei >= size {
        return true;
    }
    let size = u32::from(size);
    let lag = (u32::from(idx) + size - u32::from(ei) - 1) % size;
    let slack = (size.saturating_sub(1).saturating_sub(in_use) / 2).min(size / 4);
    lag > slack
}

/// Resolves a command's data pointer (PRP or SGL per PSDT) into `iov`.
pub(crate) fn data_ptr<'a>(
    map: &'a MemoryMap,
    sqe: &Sqe,
    len: u64,
    access: Access,
    iov: &mut Iov<'a>,
) -> Result<(), Status> {
    match sqe.psdt() {
        0 => crate::prp::walk(map, sqe.prp1(), sqe.prp2(), len, access, iov),
        1 | 2 => crate::sgl::walk(map, sqe.sgl1(), len, access, iov),
        _ => Err(Status::INVALID_FIELD),
    }
}

fn is_write(op: u8) -> bool {
    matches!(op, OP_WRITE | OP_WRITE_ZEROES | OP_DSM)
}

impl QueueGroup {
    pub fn new(
        shared: Arc<Shared>,
        mem: Arc<DmaSpace>,
        cq: CqRing,
        shadow: Option<Shadow>,
        namespaces: &[Option<Ns>],
    ) -> std::io::Result<Box<QueueGroup>> {
        let ns = namespaces
            .iter()
            .map(|d| d.as_ref().map(NsChan::open).transpose())
            .collect::<std::io::Result<Vec<_>>>()?;
        // At most one completion per CQ entry is posted per poll.
        let rec = QueueRecorder::new(
            cq.qid,
            u32::try_from(namespaces.len()).unwrap_or(u32::MAX),
            usize::from(cq.size),
            shared.trace.clone(),
        );
        Ok(Box::new(QueueGroup {
            shared,
            view: MemView::new(mem),
            cq,
            sqs: Vec::new(),
            ns,
            retiring: Vec::new(),
            shadow,
            cq_ei: NO_EI,
            irq_held: 0,
            irq_since: None,
            counters: Arc::new(Counters::default()),
            inflight: 0,
            pins: MemPins::with_capacity(4),
            rec,
        }))
    }

    pub fn add_sq(&mut self, ring: SqRing) {
        let n = u32::from(ring.size);
        self.sqs.push(IoSq {
            ring,
            slots: vec![Slot::default(); n as usize],
            free: (0..n).rev().collect(),
            ei: NO_EI,
        });
    }

    /// Applies a namespace change. Called on the control path while the group is off
    /// its reactor; a removed namespace's channel keeps being polled until the
    /// requests it holds complete.
    pub fn apply(&mut self, change: NsChange) {
        match change {
            NsChange::Add(nsid, chan) => {
                self.rec.ensure_namespaces(nsid);
                let i = (nsid as usize).saturating_sub(1);
                if self.ns.len() <= i {
                    self.ns.resize_with(i + 1, || None);
                }
                if let Some(old) = self.ns[i].replace(chan) {
                    self.retire(old);
                }
            }
            NsChange::Remove(nsid) => {
                let i = (nsid as usize).wrapping_sub(1);
                if let Some(old) = self.ns.get_mut(i).and_then(Option::take) {
                    self.retire(old);
                }
                while self.ns.last().is_some_and(Option::is_none) {
                    self.ns.pop();
                }
            }
            NsChange::Format {
                nsid,
                info,
                formatting,
            } => {
                let i = (nsid as usize).wrapping_sub(1);
                if let Some(c) = self.ns.get_mut(i).and_then(Option::as_mut) {
                    c.info = info;
                    c.formatting = formatting;
                }
            }
        }
    }

    /// Whether this group's channel on namespace `nsid` has requests in flight.
    pub fn ns_busy(&self, nsid: u32) -> bool {
        let i = (nsid as usize).wrapping_sub(1);
        self.ns
            .get(i)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.inflight > 0)
    }

    fn retire(&mut self, c: NsChan) {
        if c.inflight > 0 {
            self.retiring.push(c);
        }
    }

    /// Detaches SQ `qid` after letting its in-flight commands finish.
    pub fn remove_sq(&mut self, qid: u16) {
        self.drain();
        self.sqs.retain(|s| s.ring.qid != qid);
    }

    /// Waits (bounded) for asynchronous backend requests; their completions are
    /// dropped because the queue is going away.
    pub fn drain(&mut self) {
        let start = Instant::now();
        while self.inflight > 0 && start.elapsed() < Duration::from_secs(5) {
            let mut n = 0u32;
            for c in self.ns.iter_mut().flatten().chain(self.retiring.iter_mut()) {
                c.chan.flush();
                let mut k = 0u32;
                c.chan.poll(&mut |_, _| k += 1);
                c.inflight = c.inflight.saturating_sub(k);
                n += k;
            }
            self.inflight = self.inflight.saturating_sub(n);
            if n == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if self.inflight == 0 {
            self.pins.clear();
        } else {
            // Their memory stays mapped: a late completion must not write into
            // memory the client was told it got back.
            tracing::warn!(
                requests = self.inflight,
                "backend requests did not complete within 5 s; dropping them"
            );
        }
        self.inflight = 0;
        self.retiring.clear();
        for c in self.ns.iter_mut().flatten() {
            c.inflight = 0;
        }
        for sq in self.sqs.iter_mut() {
            let n = sq.slots.len() as u32;
            sq.free.clear();
            sq.free.extend((0..n).rev());
        }
    }

    /// Off the reactors: hold no memory snapshot, so unmaps need not wait for us.
    pub fn park(&mut self) {
        self.view.park();
    }

    /// Doorbell Buffer Config while the group exists: EventIdx values we remember
    /// are for no buffer.
    pub fn set_shadow(&mut self, shadow: Shadow) {
        self.shadow = Some(shadow);
        self.cq_ei = NO_EI;
        for sq in &mut self.sqs {
            sq.ei = NO_EI;
        }
    }

    /// Before the reactor sleeps: arm the backends' completion notifiers, publish
    /// EventIdx at each SQ's head so the driver rings on its next command, then look
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
        if self.inflight > 0 {
            for c in self.ns.iter_mut().flatten().chain(self.retiring.iter_mut()) {
                if c.inflight > 0 && c.chan.arm_notifier() != Armed::Fd {
                    return false;
                }
            }
        }
        let map = self.view.refresh();
        let page = self.shared.doorbells.all();
        if let Some(s) = self.shadow {
            for sq in &mut self.sqs {
                write_event_idx(map, s, sq.ring.qid, false, sq.ring.head);
                sq.ei = sq.ring.head;
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
        // Asleep we hold no snapshot: an unmap need not wait for us; nor an
        // interrupt held back for coalescing.
        self.view.park();
        if self.irq_held > 0 {
            self.irq_held = 0;
            self.irq_since = None;
            self.shared.irqs.signal(self.cq.vector);
        }
        true
    }

    /// What wakes the group besides doorbell messages: completion notifiers of
    /// channels with requests in flight (armed by `prepare_sleep`).
    pub fn wake_fds<'a>(&'a self, add: &mut dyn FnMut(BorrowedFd<'a>)) {
        if self.inflight == 0 {
            return;
        }
        for c in self.ns.iter().flatten().chain(self.retiring.iter()) {
            if c.inflight > 0 {
                if let Some(fd) = c.chan.notifier() {
                    add(fd);
                }
            }
        }
    }

    pub fn poll(&mut self) -> usize {
        let QueueGroup {
            shared,
            view,
            cq,
            sqs,
            ns,
            retiring,
            shadow,
            cq_ei,
            irq_held,
            irq_since,
            counters,
            inflight,
            pins,
            rec,
        } = self;
        let shared: &Shared = shared;
        if shared.fatal.load(Ordering::Relaxed) {
            return 0;
        }
        rec.begin_poll();
        // Commands in flight keep the snapshots they use pinned (`pins`), so the view
        // moves on as soon as the client changes its map.
        view.refresh();
        let view: &MemView = view;
        let map = view.map();
        let page = shared.doorbells.all();
        let shadow = *shadow;
        let shadow_db = shadow_page(map, shadow);
        let head = read_db(&page, shadow_db.as_ref(), cq.qid, true);
        if head >= u32::from(cq.size) {
            shared.set_fatal("CQ head doorbell beyond queue size");
            return 0;
        }
        cq.head = head as u16;
        let Ok(cq_ring) = map.translate(cq.base, cq.ring_bytes(), Access::Write) else {
            shared.set_fatal("I/O CQ memory unmapped");
            return 0;
        };
        let mut posted = 0usize;
        let mut work = 0usize;
        if *inflight > 0 {
            for c in ns.iter_mut().flatten().chain(retiring.iter_mut()) {
                if c.inflight == 0 {
                    continue;
                }
                let mut k = 0u32;
                c.chan.poll(&mut |tag, st| {
                    k += 1;
                    let done = (&mut *inflight, &mut *pins);
                    if complete(sqs, cq, &cq_ring, counters, rec, shared, done, tag, st) {
                        posted += 1;
                    }
                });
                c.inflight = c.inflight.saturating_sub(k);
            }
            if !retiring.is_empty() {
                retiring.retain(|c| c.inflight > 0);
            }
        }
        let mut iov = Iov::new();
        let mut submitted = false;
        let inflight_before = *inflight;
        let mut fetched = 0u32;
        for sq in sqs.iter_mut() {
            let tail = read_db(&page, shadow_db.as_ref(), sq.ring.qid, false);
            if tail >= u32::from(sq.ring.size) {
                shared.set_fatal("SQ tail doorbell beyond queue size");
                return work + posted;
            }
            let tail = tail as u16;
            if tail == sq.ring.head {
                continue;
            }
            // The map may have changed after the refresh above but before the host
            // rang (e.g. DMA_MAP, then a command using it): take the new one first.
            if !view.is_current() {
                return work + posted;
            }
            if shadow.is_some() {
                bump(&counters.shadow_reads, 1);
            }
            let Ok(sq_ring) = map.translate(sq.ring.base, sq.ring.ring_bytes(), Access::Read)
            else {
                shared.set_fatal("I/O SQ memory unmapped");
                return work + posted;
            };
            // One doorbell-seen stamp serves the whole batch.
            let kick = rec.kick();
            let mut budget = BUDGET;
            // Reads and writes waiting to be submitted together, their iovecs in `iov`.
            let mut batch: SmallVec<[u32; BATCH]> = SmallVec::new();
            iov.clear();
            while sq.ring.head != tail && budget > 0 && cq.free() > *inflight + batch.len() as u32 {
                let Some(idx) = sq.free.pop() else { break };
                let Some(sqe) = Sqe::fetch(&sq_ring, sq.ring.head) else {
                    shared.set_fatal("cannot read SQ entry");
                    return work + posted;
                };
                sq.ring.advance();
                budget -= 1;
                work += 1;
                fetched += 1;
                let tag = (u64::from(sq.ring.qid) << 32) | u64::from(idx);
                let rw = matches!(sqe.opcode(), OP_READ | OP_WRITE);
                // Anything but a read or write keeps its place: the batch before it goes
                // to the backend first.
                if !batch.is_empty() && (!rw || batch.len() == BATCH || !iov.has_room()) {
                    submitted = true;
                    let pending = (&mut *inflight, &mut *pins, view);
                    let Some(n) = submit_batch(
                        sq, &batch, &iov, ns, cq, &cq_ring, counters, rec, shared, pending,
                    ) else {
                        return work + posted;
                    };
                    posted += n;
                    batch.clear();
                    iov.clear();
                }
                let Some(slot) = sq.slots.get_mut(idx as usize) else {
                    continue;
                };
                slot.stamps = Stamps {
                    kick: rec.sample(kick),
                    ..Stamps::default()
                };
                let done = if rw {
                    if !iov.has_room() {
                        // Segments of failed walks only; no command holds any.
                        iov.clear();
                    }
                    iov.next_command();
                    let facts = ns
                        .get((sqe.nsid() as usize).wrapping_sub(1))
                        .and_then(Option::as_ref)
                        .map(|c| facts(shared, &c.info, c.formatting));
                    match prepare_rw(map, facts, &sqe, slot, &mut iov) {
                        Ok(()) => {
                            batch.push(idx);
                            None
                        }
                        Err(st) => Some(st),
                    }
                } else {
                    match exec(map, shared, ns, &sqe, tag, slot) {
                        Exec::Done(st) => {
                            submitted = true;
                            Some(st)
                        }
                        Exec::Pending(n) => {
                            submitted = true;
                            slot.pending = n;
                            slot.pin = pins.pin(view);
                            *inflight += 1;
                            None
                        }
                    }
                };
                if let Some(st) = done {
                    account(counters, rec, shared, sq.ring.qid, slot, st);
                    if !cq.post(&cq_ring, 0, sq.ring.head, sq.ring.qid, slot.cid, st) {
                        shared.set_fatal("cannot write CQ entry");
                        return work + posted;
                    }
                    sq.free.push(idx);
                    posted += 1;
                }
            }
            if !batch.is_empty() {
                submitted = true;
                let pending = (&mut *inflight, &mut *pins, view);
                let Some(n) = submit_batch(
                    sq, &batch, &iov, ns, cq, &cq_ring, counters, rec, shared, pending,
                ) else {
                    return work + posted;
                };
                posted += n;
            }
            let in_use = (sq.slots.len() - sq.free.len()) as u32;
            if let Some(s) = shadow.filter(|_| ei_stale(sq.ei, sq.ring.head, sq.ring.size, in_use))
            {
                let ei = behind(sq.ring.head, sq.ring.size);
                write_event_idx(map, s, sq.ring.qid, false, ei);
                sq.ei = ei;
            }
        }
        if submitted {
            for c in ns.iter_mut().flatten() {
                c.chan.flush();
            }
        }
        let in_use = u32::from(cq.size).saturating_sub(1) - cq.free() + *inflight;
        if let Some(s) = shadow.filter(|_| ei_stale(*cq_ei, cq.head, cq.size, in_use)) {
            let ei = behind(cq.head, cq.size);
            write_event_idx(map, s, cq.qid, true, ei);
            *cq_ei = ei;
        }
        rec.depth(fetched + inflight_before);
        // Batch stamps, read only when a traced command finished in this poll.
        let posted_at = if rec.has_finished() {
            trace::clock::now()
        } else {
            0
        };
        let signalled = cq.ien && interrupt_due(shared, cq, posted, irq_held, irq_since);
        if signalled {
            shared.irqs.signal(cq.vector);
        }
        let signalled_at = if signalled && posted_at != 0 {
            trace::clock::now()
        } else {
            posted_at
        };
        rec.set_inflight(*inflight);
        rec.end_poll(posted_at, signalled_at);
        work + posted
    }
}

/// Whether this poll signals the CQ's interrupt: at once for every batch that
/// posted, or with Interrupt Coalescing once `threshold` completions are held or
/// the oldest held one waited the aggregation time (the clock is read only while
/// completions are held).
fn interrupt_due(
    shared: &Shared,
    cq: &CqRing,
    posted: usize,
    held: &mut u32,
    since: &mut Option<Instant>,
) -> bool {
    let Some((threshold, time)) = shared.coalescing_for(cq.vector) else {
        let due = posted > 0 || *held > 0;
        *held = 0;
        *since = None;
        return due;
    };
    if posted == 0 && *held == 0 {
        return false;
    }
    *held += posted as u32;
    let now = Instant::now();
    let first = *since.get_or_insert(now);
    if *held >= threshold || now.duration_since(first) >= time {
        *held = 0;
        *since = None;
        return true;
    }
    false
}

#[allow(clippy::too_many_arguments)]
fn complete(
    sqs: &mut [IoSq],
    cq: &mut CqRing,
    ring: &DmaSlice<'_>,
    counters: &Counters,
    rec: &mut QueueRecorder,
    shared: &Shared,
    (inflight, pins): (&mut u32, &mut MemPins),
    tag: u64,
    st: IoStatus,
) -> bool {
    let qid = (tag >> 32) as u16;
    let idx = tag as u32;
    let Some(sq) = sqs.iter_mut().find(|s| s.ring.qid == qid) else {
        return false;
    };
    let Some(slot) = sq.slots.get_mut(idx as usize) else {
        return false;
    };
    if slot.pending == 0 {
        return false;
    }
    slot.pending -= 1;
    if slot.pending == 0 {
        slot.stamps.completed = QueueRecorder::stamp(slot.stamps.kick);
    }
    if slot.status.is_ok() {
        slot.status = Status::from_io(st, is_write(slot.opcode));
    }
    if slot.pending > 0 {
        return false;
    }
    *inflight = inflight.saturating_sub(1);
    pins.unpin(slot.pin);
    sq.free.push(idx);
    let status = slot.status;
    account(counters, rec, shared, qid, slot, status);
    if !cq.post(ring, 0, sq.ring.head, qid, slot.cid, status) {
        shared.set_fatal("cannot write CQ entry");
        return false;
    }
    true
}

/// Submits a batch of parsed reads and writes back to back, then posts the CQEs of
/// those the backend completed inline. Parsing them all first lets one clock read
/// between two submit calls be both the earlier command's "completed" and the later
/// one's "submitted" stamp, without moving any command's fetch or parse into its
/// backend layer: a traced batch of n reads the clock n + 1 times instead of 2n.
/// The commands' `queue` layer includes waiting for the submits before theirs, and
/// `complete` the submits after theirs, which is when their CQEs are posted.
/// Returns the CQEs posted, or None if the controller became fatal.
#[allow(clippy::too_many_arguments)]
fn submit_batch(
    sq: &mut IoSq,
    batch: &[u32],
    iov: &Iov<'_>,
    ns: &mut [Option<NsChan>],
    cq: &mut CqRing,
    cq_ring: &DmaSlice<'_>,
    counters: &Counters,
    rec: &mut QueueRecorder,
    shared: &Shared,
    (inflight, pins, view): (&mut u32, &mut MemPins, &MemView),
) -> Option<usize> {
    let qid = sq.ring.qid;
    // The last clock read, if it was taken right after the previous submit call.
    let mut last: Option<u64> = None;
    for &idx in batch {
        let Some(slot) = sq.slots.get_mut(idx as usize) else {
            continue;
        };
        let write = slot.opcode == OP_WRITE;
        // `prepare_rw` found the namespace, and the table only changes off the
        // reactor.
        let Some(c) = ns
            .get_mut((slot.nsid as usize).wrapping_sub(1))
            .and_then(Option::as_mut)
        else {
            slot.status = Status::INVALID_NAMESPACE;
            continue;
        };
        let req = IoRequest {
            op: if write { IoOp::Write } else { IoOp::Read },
            offset: slot.offset,
            len: slot.bytes,
            iov: iov.segments(slot.segs),
            fua: slot.fua,
        };
        let traced = slot.stamps.kick != 0;
        if traced {
            slot.stamps.submitted = last.unwrap_or_else(trace::clock::now);
        }
        let r = c.chan.submit(u64::from(qid) << 32 | u64::from(idx), &req);
        last = traced.then(trace::clock::now);
        match r {
            Some(st) => {
                slot.status = Status::from_io(st, write);
                slot.stamps.completed = last.unwrap_or(0);
            }
            None => {
                slot.pending = 1;
                slot.pin = pins.pin(view);
                c.inflight += 1;
                *inflight += 1;
            }
        }
    }
    let mut posted = 0;
    for &idx in batch {
        let Some(slot) = sq.slots.get(idx as usize) else {
            continue;
        };
        if slot.pending != 0 {
            continue;
        }
        account(counters, rec, shared, qid, slot, slot.status);
        if !cq.post(cq_ring, 0, sq.ring.head, qid, slot.cid, slot.status) {
            shared.set_fatal("cannot write CQ entry");
            return None;
        }
        sq.free.push(idx);
        posted += 1;
    }
    Some(posted)
}

fn account(
    counters: &Counters,
    rec: &mut QueueRecorder,
    shared: &Shared,
    sqid: u16,
    slot: &Slot,
    st: Status,
) {
    let ok = st.is_ok();
    let class = match slot.opcode {
        OP_READ => OpClass::Read,
        OP_WRITE => OpClass::Write,
        OP_FLUSH => OpClass::Flush,
        _ => OpClass::Other,
    };
    // SCT and SC; DNR and More are not part of the error's identity.
    rec.complete(slot.nsid, class, slot.bytes, st.0 & 0x7ff, slot.stamps);
    match slot.opcode {
        OP_READ => {
            bump(&counters.reads, 1);
            if ok {
                bump(&counters.bytes_read, slot.bytes);
            }
        }
        OP_WRITE => {
            bump(&counters.writes, 1);
            if ok {
                bump(&counters.bytes_written, slot.bytes);
            }
        }
        OP_FLUSH => bump(&counters.flushes, 1),
        _ => bump(&counters.other, 1),
    }
    if !ok {
        bump(&counters.errors, 1);
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

fn submit(
    chan: &mut dyn IoChannel,
    tag: u64,
    req: &IoRequest<'_>,
    write: bool,
    stamps: &mut Stamps,
) -> Exec {
    stamps.submitted = QueueRecorder::stamp(stamps.kick);
    match chan.submit(tag, req) {
        Some(st) => {
            stamps.completed = QueueRecorder::stamp(stamps.kick);
            Exec::Done(Status::from_io(st, write))
        }
        None => Exec::Pending(1),
    }
}

fn facts<'a>(shared: &Shared, info: &'a BlockInfo, formatting: bool) -> Facts<'a> {
    Facts {
        info,
        wce: shared.wce.load(Ordering::Relaxed),
        mdts_bytes: shared.mdts_bytes,
        formatting,
    }
}

/// Checks a Read or Write and resolves its data pointer into `iov` (as the iovec's
/// current command), leaving what the submit needs in `slot`.
fn prepare_rw<'a>(
    map: &'a MemoryMap,
    facts: Option<Facts<'_>>,
    sqe: &Sqe,
    slot: &mut Slot,
    iov: &mut Iov<'a>,
) -> Result<(), Status> {
    let op = sqe.opcode();
    *slot = Slot {
        cid: sqe.cid(),
        opcode: op,
        nsid: sqe.nsid(),
        stamps: slot.stamps,
        ..Slot::default()
    };
    let IoCmd::Rw {
        write,
        slba,
        offset,
        bytes,
        fua,
    } = decode(sqe, facts)?
    else {
        return Err(Status::INVALID_OPCODE);
    };
    slot.slba = slba;
    slot.bytes = bytes;
    slot.offset = offset;
    let access = if write { Access::Read } else { Access::Write };
    data_ptr(map, sqe, bytes, access, iov)?;
    slot.segs = iov.range();
    slot.fua = fua;
    Ok(())
}

fn exec(
    map: &MemoryMap,
    shared: &Shared,
    ns: &mut [Option<NsChan>],
    sqe: &Sqe,
    tag: u64,
    slot: &mut Slot,
) -> Exec {
    let idx = (sqe.nsid() as usize).wrapping_sub(1);
    let nc = ns.get_mut(idx).and_then(Option::as_mut);
    let r = exec_on(map, shared, nc, sqe, tag, slot);
    if let (Exec::Pending(n), Some(Some(c))) = (&r, ns.get_mut(idx)) {
        c.inflight += u32::from(*n);
    }
    r
}

fn exec_on(
    map: &MemoryMap,
    shared: &Shared,
    nc: Option<&mut NsChan>,
    sqe: &Sqe,
    tag: u64,
    slot: &mut Slot,
) -> Exec {
    let op = sqe.opcode();
    *slot = Slot {
        cid: sqe.cid(),
        opcode: op,
        nsid: sqe.nsid(),
        stamps: slot.stamps,
        ..Slot::default()
    };
    let cmd = decode(
        sqe,
        nc.as_ref().map(|c| facts(shared, &c.info, c.formatting)),
    );
    let cmd = match cmd {
        Ok(c) => c,
        Err(s) => return Exec::Done(s),
    };
    let Some(NsChan {
        info,
        formatting,
        chan,
        ..
    }) = nc
    else {
        return Exec::Done(Status::INVALID_NAMESPACE);
    };
    let info: &BlockInfo = info;
    let chan: &mut dyn IoChannel = chan.as_mut();
    match cmd {
        IoCmd::Flush => {
            let req = IoRequest {
                op: IoOp::Flush,
                offset: 0,
                len: 0,
                iov: &[],
                fua: false,
            };
            submit(chan, tag, &req, true, &mut slot.stamps)
        }
        IoCmd::Rw { write, .. } => {
            let mut iov = Iov::new();
            let f = facts(shared, info, *formatting);
            if let Err(s) = prepare_rw(map, Some(f), sqe, slot, &mut iov) {
                return Exec::Done(s);
            }
            let req = IoRequest {
                op: if write { IoOp::Write } else { IoOp::Read },
                offset: slot.offset,
                len: slot.bytes,
                iov: iov.slices(),
                fua: slot.fua,
            };
            submit(chan, tag, &req, write, &mut slot.stamps)
        }
        IoCmd::WriteZeroes {
            slba,
            offset,
            len,
            fua,
        } => {
            slot.slba = slba;
            let req = IoRequest {
                op: IoOp::WriteZeroes,
                offset,
                len,
                iov: &[],
                fua,
            };
            submit(chan, tag, &req, true, &mut slot.stamps)
        }
        IoCmd::Dsm { ranges, deallocate } => {
            dsm(map, info, chan, sqe, (ranges, deallocate), tag, slot)
        }
    }
}

fn dsm(
    map: &MemoryMap,
    info: &bdev::BlockInfo,
    chan: &mut dyn IoChannel,
    sqe: &Sqe,
    (nr, deallocate): (usize, bool),
    tag: u64,
    slot: &mut Slot,
) -> Exec {
    let mut buf = [0u8; MAX_DSM_RANGES * 16];
    let Some(ranges) = buf.get_mut(..nr * 16) else {
        return Exec::Done(Status::INVALID_FIELD);
    };
    let mut iov = Iov::new();
    if let Err(s) = data_ptr(map, sqe, (nr * 16) as u64, Access::Read, &mut iov) {
        return Exec::Done(s);
    }
    iov.copy_in(ranges);
    let bs = u64::from(info.block_size);
    let parse = |r: &[u8]| {
        let mut len = [0u8; 4];
        let mut lba = [0u8; 8];
        len.copy_from_slice(r.get(4..8).unwrap_or(&[0; 4]));
        lba.copy_from_slice(r.get(8..16).unwrap_or(&[0; 8]));
        (u64::from_le_bytes(lba), u64::from(u32::from_le_bytes(len)))
    };
    for r in ranges.chunks_exact(16) {
        let (slba, nlb) = parse(r);
        if slba.checked_add(nlb).is_none_or(|e| e > info.num_blocks) {
            slot.slba = slba;
            return Exec::Done(Status::LBA_OUT_OF_RANGE);
        }
    }
    // Deallocation is advisory: without backend support it is a successful no-op.
    if !deallocate || !info.discard {
        return Exec::Done(Status::SUCCESS);
    }
    let mut pending = 0u16;
    let mut status = Status::SUCCESS;
    for r in ranges.chunks_exact(16) {
        let (slba, nlb) = parse(r);
        let (Some(offset), Some(len)) = (slba.checked_mul(bs), nlb.checked_mul(bs)) else {
            continue;
        };
        if len == 0 {
            continue;
        }
        let req = IoRequest {
            op: IoOp::Discard,
            offset,
            len,
            iov: &[],
            fua: false,
        };
        match chan.submit(tag, &req) {
            Some(st) if status.is_ok() => status = Status::from_io(st, true),
            Some(_) => {}
            None => pending += 1,
        }
    }
    if pending > 0 {
        slot.status = status;
        Exec::Pending(pending)
    } else {
        Exec::Done(status)
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
        self.group.as_ref().and_then(|g| g.shared.sleep_after())
    }

    fn prepare_sleep(&mut self) -> bool {
        self.group.as_mut().is_none_or(|g| g.prepare_sleep())
    }

    fn wake_fds<'a>(&'a self, add: &mut dyn FnMut(BorrowedFd<'a>)) {
        if let Some(g) = &self.group {
            g.wake_fds(add);
        }
    }
}

impl Drop for GroupPoller {
    fn drop(&mut self) {
        if let Some(g) = self.group.take() {
            let _ = self.back.try_send(g);
        }
    }
}
