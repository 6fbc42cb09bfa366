//! The hot-path side: one [`QueueCore`] per queue (or NVMe queue group), owned by
//! the poller that owns the queue. It wraps the queue's `trace::QueueRecorder` with
//! the protocol's status table, so a front end counts and traces a request with one
//! call and cannot count it twice; and it takes the per-poll stamps the same way
//! for every front end (decision 0007: at most two clock reads per poll, only when a
//! traced request finished in it).

use std::marker::PhantomData;
use std::sync::Arc;

use trace::{IoCounters, Mailbox, OpClass, QueueRecorder, QueueSnapshot, Stamps, TraceControl};

use crate::status::Protocol;

/// Accounting and tracing of one queue of a front end speaking `P`. Everything
/// marked hot runs on the owning thread: plain stores, no locks, no allocation, no
/// read-modify-write.
pub struct QueueCore<P: Protocol> {
    rec: QueueRecorder,
    _protocol: PhantomData<fn() -> P>,
}

impl<P: Protocol> QueueCore<P> {
    /// Queue `queue` seeing namespaces up to `namespaces` (a front end with one disk
    /// passes 1 and files it under namespace 1), completing at most `max_batch`
    /// requests per poll, on the trace switch `ctl` shared by the device's queues.
    pub fn new(queue: u16, namespaces: u32, max_batch: usize, ctl: Arc<TraceControl>) -> Self {
        QueueCore {
            rec: QueueRecorder::new(queue, namespaces, max_batch, ctl),
            _protocol: PhantomData,
        }
    }

    /// Hot, once per poll: picks up trace start/stop.
    #[inline]
    pub fn begin_poll(&mut self) {
        self.rec.begin_poll();
    }

    /// Hot, once per batch of new requests: the doorbell/avail-seen stamp, or 0.
    #[inline]
    pub fn kick(&self) -> u64 {
        self.rec.kick()
    }

    /// Hot, per request fetched: its `kick` stamp if it is sampled, else 0.
    #[inline]
    pub fn sample(&mut self, kick: u64) -> u64 {
        self.rec.sample(kick)
    }

    /// Hot: a stamp for a traced request (`kick != 0`), else 0 without a clock read.
    #[inline]
    pub fn stamp(kick: u64) -> u64 {
        QueueRecorder::stamp(kick)
    }

    /// Hot, per request, when it completes to the guest: the one place it is
    /// counted (operation, bytes if it succeeded, error by status) and its trace
    /// stamps recorded. `nsid` out of range counts under namespace 0.
    #[inline]
    pub fn complete(&mut self, nsid: u32, op: OpClass, bytes: u64, st: P::Status, s: Stamps) {
        self.rec.complete(nsid, op, bytes, P::code(st), s);
    }

    /// Hot, per poll that fetched requests: the queue depth its batch saw.
    #[inline]
    pub fn depth(&mut self, depth: u32) {
        self.rec.depth(depth);
    }

    /// Hot, the last thing of every poll: takes the "posted" stamp (only if a traced
    /// request finished in this poll), lets `signal` put out the interrupt if one is
    /// due (it says whether it did), takes the "signalled" stamp if so, and folds
    /// the poll into the histograms; answers a reader's snapshot request. `inflight`:
    /// requests the backend still has. Returns what `signal` returned.
    #[inline]
    pub fn end_poll(&mut self, inflight: u32, signal: impl FnOnce() -> bool) -> bool {
        let posted = if self.rec.has_finished() {
            trace::clock::now()
        } else {
            0
        };
        let signalled = signal();
        let signalled_at = if signalled && posted != 0 {
            trace::clock::now()
        } else {
            posted
        };
        self.rec.set_inflight(inflight);
        self.rec.end_poll(posted, signalled_at);
        signalled
    }

    /// Completions of namespace `nsid` with error `st` so far.
    pub fn error_count(&self, nsid: u32, st: P::Status) -> u64 {
        self.rec.error_count(nsid, P::code(st))
    }

    /// The request counters, for readers on any thread.
    pub fn counters(&self) -> Arc<IoCounters> {
        self.rec.counters()
    }

    /// Where readers ask for snapshots (see [`crate::collect`]).
    pub fn mailbox(&self) -> Arc<Mailbox> {
        self.rec.mailbox()
    }

    /// The queue's data now (for a queue nobody polls, or tests).
    pub fn snapshot(&self) -> QueueSnapshot {
        self.rec.snapshot()
    }

    /// Control path: room for namespace ids up to `highest`.
    pub fn ensure_namespaces(&mut self, highest: u32) {
        self.rec.ensure_namespaces(highest);
    }
}
