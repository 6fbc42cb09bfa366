//! One virtqueue's request engine: preallocated slots, pop -> parse -> submit ->
//! complete, all on the thread that owns the queue.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bdev::{Batch as _, BlockInfo, IoChannel, IoOp, IoRequest, IoStatus};
use frontend_core::{Protocol, QueueCore};
use guest_mem::DirtyLog;
use trace::{Mailbox, TraceControl};
use virtio_queue::{Queue, QueueOwnedT, QueueT};

use crate::chain::ChainWalk;
use crate::config::BlkConfig;
use crate::guest::Mem;
use crate::inflight::InflightQueue;
use crate::request::{parse, Outcome, Seg, Slot, VirtioBlk, S_IOERR, S_OK, S_UNSUPP};

/// The namespace id a virtio-blk disk's counters are kept under (a device has one
/// disk; 0 would mean "no valid namespace" to the recorder).
pub const DISK_NSID: u32 = 1;

/// Descriptors beyond `seg_max` data segments that a well-formed chain may carry
/// (header, status, and a split header or status).
const EXTRA_DESCS: usize = 4;

/// What one [`QueueWorker::process`] call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Chains taken from the avail ring plus backend completions seen.
    pub work: usize,
    /// Entries put on the used ring (the caller decides whether to notify).
    pub used: usize,
}

/// The queue can no longer be processed until the front end resets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueError {
    /// The avail index moved further than the queue size (or cannot be read).
    AvailIndex,
    /// The used ring cannot be written.
    UsedRing,
}

/// What a queue completed, read from its recorder's counters (each request is
/// counted once, there).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Requests completed (put on the used ring or dropped with a broken ring).
    pub requests: u64,
    /// Completed with VIRTIO_BLK_S_IOERR.
    pub errors: u64,
    /// Completed with VIRTIO_BLK_S_UNSUPP.
    pub unsupported: u64,
}

pub struct QueueWorker {
    cfg: Arc<BlkConfig>,
    /// The disk `chan` is on: requests are checked against its size.
    info: BlockInfo,
    chan: Box<dyn IoChannel>,
    slots: Vec<Slot>,
    free: Vec<u16>,
    ready: Vec<u16>,
    done: Vec<(u64, IoStatus)>,
    segs: Vec<Seg>,
    broken: Option<QueueError>,
    /// The front end's inflight log for this queue (vhost-user INFLIGHT_SHMFD).
    inflight: Option<InflightQueue>,
    /// Order in which chains were taken, recorded in the inflight log.
    counter: u64,
    /// Scratch for recovery: `(counter, head)` of requests to resubmit.
    resubmit: Vec<(u64, u16)>,
    /// The VMM's dirty-page log while it migrates the guest (`dirty.rs`).
    dirty: Option<Arc<DirtyLog>>,
    /// Counters and layer times of this queue (docs/decisions/0007-tracing.md,
    /// 0015-front-end-core.md): the one place its requests are counted.
    rec: QueueCore<VirtioBlk>,
}

impl QueueWorker {
    /// Preallocates one slot per possible queue entry (`cfg.opts.queue_size`). The
    /// queue's recorder has a trace switch of its own; see [`Self::traced`].
    pub fn new(cfg: Arc<BlkConfig>, chan: Box<dyn IoChannel>) -> Self {
        Self::traced(cfg, chan, 0, Arc::new(TraceControl::default()))
    }

    /// Like [`Self::new`], for virtqueue `queue` of a device whose queues share the
    /// trace switch `ctl`.
    pub fn traced(
        cfg: Arc<BlkConfig>,
        chan: Box<dyn IoChannel>,
        queue: u16,
        ctl: Arc<TraceControl>,
    ) -> Self {
        let n = usize::from(cfg.opts.queue_size.max(1));
        let max_segs = cfg.opts.seg_max as usize + EXTRA_DESCS;
        QueueWorker {
            // A slot can complete twice in one poll (reaped, popped again, done
            // inline), so room for two rounds of the ring.
            rec: QueueCore::new(queue, DISK_NSID, 2 * n, ctl),
            slots: (0..n).map(|_| Slot::new(max_segs)).collect(),
            free: (0..n as u16).rev().collect(),
            ready: Vec::with_capacity(n),
            done: Vec::with_capacity(n),
            segs: Vec::with_capacity(max_segs),
            info: cfg.info.clone(),
            cfg,
            chan,
            broken: None,
            inflight: None,
            counter: 1,
            resubmit: Vec::with_capacity(n),
            dirty: None,
        }
    }

    /// Where readers ask for this queue's counters and trace data (answered at the
    /// end of a poll, see [`Self::finish_poll`]).
    pub fn mailbox(&self) -> Arc<Mailbox> {
        self.rec.mailbox()
    }

    /// What the queue completed so far.
    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            requests: self.rec.counters().totals().ops.total(),
            errors: self.rec.error_count(DISK_NSID, S_IOERR),
            unsupported: self.rec.error_count(DISK_NSID, S_UNSUPP),
        }
    }

    /// The queue's counters and trace data now (for a worker nobody polls, tests).
    pub fn snapshot(&self) -> trace::QueueSnapshot {
        self.rec.snapshot()
    }

    /// Ends a poll: `signal` puts the interrupt (call eventfd) out if one is due and
    /// says whether it did. Takes the batch's "posted" and "signalled" stamps (only
    /// when a traced request finished in this poll), folds them in and answers a
    /// snapshot request. Call once after every [`Self::process_with`], and on polls
    /// that had nothing to process, with `|| false`.
    #[inline]
    pub fn finish_poll(&mut self, signal: impl FnOnce() -> bool) {
        self.rec.begin_poll();
        let inflight = self.in_flight() as u32;
        self.rec.end_poll(inflight, signal);
    }

    /// Switches to another handle of the disk (an online resize: the same data at
    /// another size, `info`), whose requests are checked against the new size from
    /// the next chain on. Only with nothing in flight, so no completion is owed by
    /// the old channel; otherwise the channel is handed back.
    pub fn set_disk(
        &mut self,
        chan: Box<dyn IoChannel>,
        info: BlockInfo,
    ) -> Result<(), Box<dyn IoChannel>> {
        if self.in_flight() != 0 {
            return Err(chan);
        }
        self.chan = chan;
        self.info = info;
        Ok(())
    }

    /// The size requests are checked against now.
    pub fn disk_bytes(&self) -> u64 {
        self.info.size_bytes()
    }

    /// Before the reactor sleeps with requests in flight: whether the backend will
    /// wake it on completion ([`Worker::notifier`]); `false`: keep polling.
    pub fn arm_notifier(&mut self) -> bool {
        matches!(
            self.chan.arm_notifier(),
            bdev::Armed::Fd | bdev::Armed::Timer
        )
    }

    /// The latest instant the backend must be polled again without its notifier
    /// (requests it holds back until a time; [`bdev::IoChannel::wake_by`]).
    pub fn wake_by(&self) -> Option<std::time::Instant> {
        self.chan.wake_by()
    }

    /// The backend's completion notifier (after [`Worker::arm_notifier`]).
    pub fn notifier(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.chan.notifier()
    }

    /// Whether the backend's requests take a round trip to complete
    /// ([`bdev::IoChannel::slow_completions`]).
    pub fn slow_completions(&self) -> bool {
        self.chan.slow_completions()
    }

    /// Requests handed to the backend and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn broken(&self) -> Option<QueueError> {
        self.broken
    }

    /// Forgets a broken state after the front end re-initialised the queue.
    pub fn reset(&mut self) {
        self.broken = None;
    }

    /// Logs taken chains in `log` from now on (or stops logging).
    pub fn set_inflight(&mut self, log: Option<InflightQueue>) {
        self.inflight = log;
    }

    /// Marks the guest pages completed requests wrote in `log` from now on (or
    /// stops marking): data of reads, status bytes. Used-ring writes are the
    /// transport's to log (it knows where the VMM wants them logged).
    pub fn set_dirty_log(&mut self, log: Option<Arc<DirtyLog>>) {
        self.dirty = log;
    }

    /// The dirty-page log in use.
    pub fn dirty_log(&self) -> Option<&Arc<DirtyLog>> {
        self.dirty.as_ref()
    }

    /// Starts a queue that the front end (re)initialised while an inflight log is
    /// set: brings the log in line with the used ring, resubmits the requests a
    /// previous process took but never completed (oldest first), and continues the
    /// avail ring after them. Call with nothing in flight, before the first
    /// [`Self::process`] on the new rings. Returns the number resubmitted.
    pub fn recover(&mut self, q: &mut Queue, mem: &Arc<Mem>) -> usize {
        let Some(log) = self.inflight.clone() else {
            return 0;
        };
        if self.in_flight() != 0 {
            return 0;
        }
        let Ok(used) = q.used_idx(&**mem, std::sync::atomic::Ordering::Acquire) else {
            trace::limited!(
                self.cfg.log,
                warn,
                "virtqueue used ring is unreadable; queue stopped until reset"
            );
            self.broken = Some(QueueError::UsedRing);
            return 0;
        };
        let size = q.size();
        self.counter = log.recover(used.0, size, &mut self.resubmit);
        let n = self.resubmit.len().min(self.free.len());
        q.set_next_used(used.0);
        q.set_next_avail(used.0.wrapping_add(n as u16));
        let table = q.desc_table();
        self.ready.clear();
        for i in 0..n {
            let head = self.resubmit[i].1;
            let Some(idx) = self.free.pop() else { break };
            let slot = &mut self.slots[usize::from(idx)];
            let walk = ChainWalk::new(mem, table, size, head);
            parse(
                head,
                walk,
                mem,
                (&self.cfg, &self.info),
                &mut self.segs,
                slot,
            );
            self.ready.push(idx);
        }
        if n > 0 {
            trace::limited!(
                self.cfg.log,
                info,
                requests = n,
                "resubmitting requests in flight at the last disconnect"
            );
        }
        let mut p = Progress::default();
        self.submit(q, mem, &mut p);
        self.chan.flush();
        n
    }

    /// Completes finished backend requests and, with `pop`, takes new chains from the
    /// avail ring (as many as there are free slots). Ring memory is read through `mem`;
    /// each request keeps its own clone of `mem` until it completes.
    pub fn process(&mut self, q: &mut Queue, mem: &Arc<Mem>, pop: bool) -> Progress {
        let mut mem = mem.clone();
        let p = self.process_with(q, &mut mem, &mut |_| {}, pop);
        self.finish_poll(|| false);
        p
    }

    /// Like [`process`](Self::process) for memory the front end can change while the
    /// queue runs: `latest` replaces `mem` with the newest snapshot, and is called
    /// after the avail index was read and before any chain published up to it is
    /// parsed. The front end maps a buffer (and waits for our ack) before it publishes
    /// a request pointing into it, so a snapshot taken before the avail index read may
    /// lack that buffer.
    pub fn process_with(
        &mut self,
        q: &mut Queue,
        mem: &mut Arc<Mem>,
        latest: &mut dyn FnMut(&mut Arc<Mem>),
        pop: bool,
    ) -> Progress {
        let mut p = Progress::default();
        let mem = &mut *mem;
        // Trace start/stop take effect here (one load when nothing changed).
        self.rec.begin_poll();
        self.reap(q, mem, &mut p);
        if pop && self.broken.is_none() {
            let before = self.in_flight() as u32;
            self.pop(q, mem, latest, &mut p);
            if !self.ready.is_empty() {
                // Depth seen by this batch: what it brought plus what was waiting.
                self.rec.depth(before + self.ready.len() as u32);
            }
            self.submit(q, mem, &mut p);
            self.chan.flush();
            // Inline-then-async backends may already have finished something.
            self.reap(q, mem, &mut p);
        }
        if self.in_flight() != 0 {
            // Reaping may have queued resubmissions (short transfers, backlog); push
            // them even while the queue is stopped and draining.
            self.chan.flush();
        }
        p
    }

    fn reap(&mut self, q: &mut Queue, mem: &Arc<Mem>, p: &mut Progress) {
        if self.in_flight() == 0 {
            return;
        }
        let done = &mut self.done;
        done.clear();
        self.chan.poll(&mut |tag, st| {
            if done.len() < done.capacity() {
                done.push((tag, st));
            }
        });
        for i in 0..self.done.len() {
            let (tag, st) = self.done[i];
            let Ok(idx) = u16::try_from(tag) else {
                continue;
            };
            if let Some(slot) = self.slots.get_mut(usize::from(idx)) {
                slot.stamps.completed = QueueCore::<VirtioBlk>::stamp(slot.stamps.kick);
                p.work += 1;
                let status = VirtioBlk::from_io(st, slot.op);
                self.complete(q, mem, idx, status, p);
            }
        }
    }

    fn pop(
        &mut self,
        q: &mut Queue,
        mem: &mut Arc<Mem>,
        latest: &mut dyn FnMut(&mut Arc<Mem>),
        p: &mut Progress,
    ) {
        self.ready.clear();
        if self.free.is_empty() || !q.ready() || q.avail_ring() == 0 {
            return;
        }
        // Read the avail index first, then take the memory snapshot: every chain up
        // to that index was published after its buffers were in the memory table.
        // Chains published later may need a newer snapshot: they wait for the next call.
        let avail = match q.avail_idx(&**mem, Ordering::Acquire) {
            Ok(a) => a,
            Err(e) => {
                self.corrupt(&e);
                return;
            }
        };
        latest(mem);
        // Back-pressure: what the backend cannot take now stays in the avail ring.
        let room = u16::try_from(self.chan.room()).unwrap_or(u16::MAX);
        let mut budget = avail.0.wrapping_sub(q.next_avail()).min(room);
        if budget == 0 {
            return;
        }
        // One avail-seen stamp serves the whole batch.
        let kick = self.rec.kick();
        let mut iter = match q.iter(&**mem) {
            Ok(it) => it,
            Err(virtio_queue::Error::QueueNotReady) => return,
            Err(e) => {
                self.corrupt(&e);
                return;
            }
        };
        while let Some(idx) = self.free.last().copied() {
            if budget == 0 {
                break;
            }
            let Some(chain) = iter.next() else { break };
            budget -= 1;
            self.free.pop();
            let slot = &mut self.slots[usize::from(idx)];
            let head = chain.head_index();
            if let Some(log) = &self.inflight {
                log.take(head, self.counter);
                self.counter += 1;
            }
            parse(
                head,
                chain,
                mem,
                (&self.cfg, &self.info),
                &mut self.segs,
                slot,
            );
            slot.stamps.kick = self.rec.sample(kick);
            self.ready.push(idx);
            p.work += 1;
        }
    }

    fn corrupt(&mut self, e: &virtio_queue::Error) {
        trace::limited!(self.cfg.log, warn, error = %e, "virtqueue avail ring is corrupt; queue stopped until reset");
        self.broken = Some(QueueError::AvailIndex);
    }

    /// Completes the chains that failed to parse and hands the rest to the backend
    /// as one batch: the channel orders its own work (a RAM disk copies one
    /// request while the next one's data is on its way), and each inline
    /// completion goes on the used ring as soon as the channel reports it
    /// (docs/decisions/0033-backend-batches.md).
    fn submit(&mut self, q: &mut Queue, mem: &Arc<Mem>, p: &mut Progress) {
        let mut kept = 0;
        for i in 0..self.ready.len() {
            let idx = self.ready[i];
            match self.slots[usize::from(idx)].outcome {
                Outcome::Finish(s) => self.complete(q, mem, idx, s, p),
                Outcome::Submit => {
                    self.ready[kept] = idx;
                    kept += 1;
                }
            }
        }
        self.ready.truncate(kept);
        if let Some(&first) = self.ready.first() {
            let slot = &mut self.slots[usize::from(first)];
            slot.stamps.submitted = QueueCore::<VirtioBlk>::stamp(slot.stamps.kick);
            let QueueWorker {
                chan,
                slots,
                ready,
                free,
                rec,
                cfg,
                inflight,
                broken,
                dirty,
                ..
            } = self;
            let post = Post {
                cfg,
                rec,
                free,
                inflight,
                broken,
                dirty,
                q,
                mem,
                p,
            };
            let mut chains = Chains { ready, slots, post };
            if chains.ready.len() == 1 {
                // Nothing to order: one request goes as one.
                let started = chains.request(0).map(|(tag, req)| chan.submit(tag, &req));
                if let Some(st) = started {
                    chains.started(0, st);
                }
            } else {
                chan.submit_batch(&mut chains);
            }
        }
        self.ready.clear();
    }

    fn complete(&mut self, q: &mut Queue, mem: &Arc<Mem>, idx: u16, status: u8, p: &mut Progress) {
        Post {
            cfg: &self.cfg,
            rec: &mut self.rec,
            free: &mut self.free,
            inflight: &self.inflight,
            broken: &mut self.broken,
            dirty: &self.dirty,
            q,
            mem,
            p,
        }
        .complete(&mut self.slots, idx, status);
    }
}

/// What putting a request on the used ring touches.
struct Post<'a> {
    cfg: &'a BlkConfig,
    rec: &'a mut QueueCore<VirtioBlk>,
    free: &'a mut Vec<u16>,
    inflight: &'a Option<InflightQueue>,
    broken: &'a mut Option<QueueError>,
    dirty: &'a Option<Arc<DirtyLog>>,
    q: &'a mut Queue,
    mem: &'a Arc<Mem>,
    p: &'a mut Progress,
}

/// A poll's parsed chains as the backend's batch: their slots' requests, each
/// start completed (inline) or left in flight as the channel reports it.
struct Chains<'a> {
    ready: &'a [u16],
    slots: &'a mut [Slot],
    post: Post<'a>,
}

impl bdev::Batch for Chains<'_> {
    fn request(&self, i: usize) -> Option<(u64, IoRequest<'_>)> {
        let idx = *self.ready.get(i)?;
        Some((u64::from(idx), self.slots.get(usize::from(idx))?.request()))
    }

    fn started(&mut self, i: usize, inline: Option<IoStatus>) {
        let Some(&idx) = self.ready.get(i) else {
            return;
        };
        let Some(slot) = self.slots.get_mut(usize::from(idx)) else {
            return;
        };
        if let Some(st) = inline {
            // Inline backend: it completed inside the call.
            slot.stamps.completed = QueueCore::<VirtioBlk>::stamp(slot.stamps.kick);
            let status = VirtioBlk::from_io(st, slot.op);
            self.post.complete(self.slots, idx, status);
        }
        if let Some(next) = self
            .ready
            .get(i + 1)
            .and_then(|&n| self.slots.get_mut(usize::from(n)))
        {
            next.stamps.submitted = QueueCore::<VirtioBlk>::stamp(next.stamps.kick);
        }
    }
}

impl Post<'_> {
    fn complete(&mut self, slots: &mut [Slot], idx: u16, status: u8) {
        let Some(slot) = slots.get_mut(usize::from(idx)) else {
            return;
        };
        let bytes = match (slot.outcome, slot.op) {
            (Outcome::Submit, IoOp::Read | IoOp::Write) => slot.len,
            _ => 0,
        };
        // Counted once, here; its `complete` layer ends at the batch's "posted"
        // stamp (`finish_poll`).
        self.rec
            .complete(DISK_NSID, slot.class, bytes, status, slot.stamps);
        if status != S_OK && status != S_UNSUPP {
            let errors = self.rec.error_count(DISK_NSID, status);
            // Rate-limited: the 1st, 2nd, 4th, 8th... error of this queue.
            if errors.is_power_of_two() {
                let cause = if slot.cause.is_empty() {
                    "the backend failed the request"
                } else {
                    slot.cause
                };
                trace::limited!(
                    self.cfg.log,
                    warn,
                    errors,
                    head = slot.head,
                    cause,
                    "virtio-blk request completed with IOERR"
                );
            }
        }
        let used_len = match slot.status {
            Some(st) => {
                let _ = st.write_from(0, &[status]);
                if status == S_OK {
                    slot.used_len
                } else {
                    1
                }
            }
            None => 0,
        };
        if let Some(log) = self.dirty {
            crate::dirty::log_slot(log, slot);
        }
        let head = slot.head;
        slot.release();
        self.free.push(idx);
        if let Some(log) = self.inflight {
            log.before_used(head);
        }
        if self.q.add_used(&**self.mem, head, used_len).is_err() {
            if self.broken.is_none() {
                trace::limited!(
                    self.cfg.log,
                    warn,
                    head,
                    "cannot write the used ring; queue stopped until reset"
                );
            }
            *self.broken = Some(QueueError::UsedRing);
            return;
        }
        if let Some(log) = self.inflight {
            log.used(head, self.q.next_used());
        }
        self.p.used += 1;
    }
}
