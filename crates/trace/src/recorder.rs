//! The hot-path side: one [`QueueRecorder`] per queue, owned by its poller.

use std::sync::Arc;

use hdrhistogram::Histogram;

use crate::clock;
use crate::control::{Mailbox, TraceControl, TraceSettings};
use crate::counters::{bump, new_block, CountBlock, IoCounters};
use crate::hist::{depth_hist, tick_hist, HistSnapshot};
use crate::snapshot::{LayerHists, NsSnapshot, OpCounts, QueueSnapshot, StatusCount};
use crate::ticks::TickBuckets;
use crate::{OpClass, LAYERS, TOTAL};

/// Distinct error statuses counted per namespace; further ones share `OVERFLOW`.
const MAX_STATUSES: usize = 32;
/// Status reported for errors beyond [`MAX_STATUSES`] distinct ones.
pub const OVERFLOW_STATUS: u16 = 0xffff;
const NUM_STAMPED: usize = LAYERS.len() + 1;

/// A request's own clock values; `kick == 0` means "not sampled". Batch-wide stamps
/// (completion posted, interrupt signalled) are kept by the recorder.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamps {
    /// Doorbell/kick of the batch this request was fetched in.
    pub kick: u64,
    /// Just before the request went to the backend (fetch and parse are done).
    pub submitted: u64,
    /// Backend reported completion.
    pub completed: u64,
}

/// Layer histograms of one namespace: reads and writes, each layer plus total, in
/// raw clock ticks (scaled to ns only in [`QueueRecorder::snapshot`]).
struct TraceHists {
    by_op: [[TickBuckets; NUM_STAMPED]; 2],
}

impl TraceHists {
    fn new() -> Box<TraceHists> {
        let row = || std::array::from_fn(|_| TickBuckets::new());
        Box::new(TraceHists {
            by_op: [row(), row()],
        })
    }
}

/// What a namespace's counters do not hold: errors by status (touched only when a
/// request fails) and trace data.
struct NsRecorder {
    errors: Vec<(u16, u64)>,
    trace: Option<Box<TraceHists>>,
    /// Traced reads and writes of this poll whose `notify` time (the same for the
    /// whole batch) is still to be recorded, with one `record_n`.
    notify_due: [u64; 2],
}

impl NsRecorder {
    fn new() -> NsRecorder {
        NsRecorder {
            errors: Vec::with_capacity(MAX_STATUSES),
            trace: None,
            notify_due: [0; 2],
        }
    }

    fn count_error(&mut self, status: u16) {
        if let Some(e) = self.errors.iter_mut().find(|e| e.0 == status) {
            e.1 += 1;
            return;
        }
        let status = if self.errors.len() + 1 >= MAX_STATUSES {
            OVERFLOW_STATUS
        } else {
            status
        };
        match self.errors.iter_mut().find(|e| e.0 == status) {
            Some(e) => e.1 += 1,
            None => self.errors.push((status, 1)),
        }
    }
}

/// A traced request that completed in this poll, waiting for the batch's post and
/// notify stamps, with its first two layers already as tick deltas. Computing them
/// when the request completes reads the stamps one by one; copying the `Stamps`
/// whole (a wide load over stamps the device stored one by one a moment before)
/// stalls on store forwarding: 3 ns of the ~11 ns recording cost per request in
/// `recorder_cost`.
#[derive(Clone, Copy)]
struct Finished {
    ns: u32,
    write: bool,
    queue: u64,
    backend: u64,
    completed: u64,
}

/// Metrics and trace data of one queue. Methods marked hot are called per request
/// or per poll on the owning thread; everything else is control work.
pub struct QueueRecorder {
    queue: u16,
    ctl: Arc<TraceControl>,
    mailbox: Arc<Mailbox>,
    seen: u64,
    settings: TraceSettings,
    countdown: u32,
    /// Index 0: requests with no valid namespace; index i: namespace i. `counts`
    /// has the same length; `counters` is the readers' handle to it.
    ns: Vec<NsRecorder>,
    counts: CountBlock,
    counters: Arc<IoCounters>,
    depth: Histogram<u64>,
    inflight: u32,
    finished: Vec<Finished>,
    dropped: u64,
}

impl QueueRecorder {
    /// `namespaces`: highest namespace id this queue can see; `max_batch`: requests
    /// that can complete in one poll (sizes the preallocated buffer).
    pub fn new(
        queue: u16,
        namespaces: u32,
        max_batch: usize,
        ctl: Arc<TraceControl>,
    ) -> QueueRecorder {
        clock::init();
        let n = (namespaces as usize).saturating_add(1);
        let counts = new_block(n, None);
        QueueRecorder {
            queue,
            ctl,
            mailbox: Arc::new(Mailbox::default()),
            seen: u64::MAX,
            settings: TraceSettings::default(),
            countdown: 1,
            ns: (0..n).map(|_| NsRecorder::new()).collect(),
            counters: Arc::new(IoCounters::new(counts.clone())),
            counts,
            depth: depth_hist(),
            inflight: 0,
            finished: Vec::with_capacity(max_batch),
            dropped: 0,
        }
    }

    /// Makes room for namespace ids up to `highest` (control path: a namespace was
    /// added while the queue exists). A namespace added during a trace is traced
    /// from the next start on.
    pub fn ensure_namespaces(&mut self, highest: u32) {
        let want = (highest as usize).saturating_add(1);
        if self.ns.len() < want {
            self.ns.resize_with(want, NsRecorder::new);
            self.counts = new_block(want, Some(&self.counts));
            self.counters.replace(self.counts.clone());
        }
    }

    /// The queue's request counters, for readers on any thread. Every completion
    /// passed to [`Self::complete`] is counted there, once.
    pub fn counters(&self) -> Arc<IoCounters> {
        self.counters.clone()
    }

    /// Completions of namespace `nsid` with error `status` so far (for rate-limiting
    /// log lines and protocol-specific stats; statuses beyond the per-namespace
    /// limit are counted under [`OVERFLOW_STATUS`]).
    pub fn error_count(&self, nsid: u32, status: u16) -> u64 {
        self.ns
            .get(nsid as usize)
            .and_then(|ns| ns.errors.iter().find(|e| e.0 == status))
            .map_or(0, |e| e.1)
    }

    /// The mailbox readers use to get snapshots of this queue.
    pub fn mailbox(&self) -> Arc<Mailbox> {
        self.mailbox.clone()
    }

    /// Hot, once per poll: picks up trace start/stop. Allocates the layer histograms
    /// only when a new trace starts.
    #[inline]
    pub fn begin_poll(&mut self) {
        let raw = self.ctl.raw();
        if raw != self.seen {
            self.apply(raw);
        }
    }

    #[cold]
    fn apply(&mut self, raw: u64) {
        let new = TraceSettings::decode(raw);
        if new.enabled && new.epoch != self.settings.epoch {
            for ns in self.ns.iter_mut() {
                ns.trace = Some(TraceHists::new());
            }
            self.dropped = 0;
        }
        self.settings = new;
        self.countdown = 1;
        self.seen = raw;
    }

    /// Hot, once per batch of new requests: the doorbell-seen stamp, or 0 when off.
    #[inline]
    pub fn kick(&self) -> u64 {
        if self.settings.enabled {
            clock::now()
        } else {
            0
        }
    }

    /// Hot, per request: the `kick` stamp if this request is sampled, else 0.
    #[inline]
    pub fn sample(&mut self, kick: u64) -> u64 {
        if kick == 0 {
            return 0;
        }
        self.countdown -= 1;
        if self.countdown == 0 {
            self.countdown = self.settings.sample_every;
            kick
        } else {
            0
        }
    }

    /// Hot: a stamp for a sampled request (`kick != 0`), else 0 without reading
    /// the clock.
    #[inline]
    pub fn stamp(kick: u64) -> u64 {
        if kick == 0 {
            0
        } else {
            clock::now()
        }
    }

    /// Hot, per request: counts a finished request. `nsid` out of range counts under
    /// namespace 0; `status` 0 is success.
    #[inline]
    pub fn complete(&mut self, nsid: u32, op: OpClass, bytes: u64, status: u16, s: Stamps) {
        let idx = if (nsid as usize) < self.counts.len() {
            nsid as usize
        } else {
            0
        };
        let c = &self.counts[idx];
        bump(&c.ops[op as usize], 1);
        if status == 0 {
            bump(&c.bytes[op as usize], bytes);
        } else {
            bump(&c.errors, 1);
            if let Some(ns) = self.ns.get_mut(idx) {
                ns.count_error(status);
            }
        }
        // Requests rejected before reaching the backend have no layer times.
        let stamped = s.kick != 0 && s.submitted != 0 && s.completed != 0;
        if stamped && matches!(op, OpClass::Read | OpClass::Write) {
            if self.finished.len() < self.finished.capacity() {
                self.finished.push(Finished {
                    ns: idx as u32,
                    write: op == OpClass::Write,
                    queue: s.submitted.saturating_sub(s.kick),
                    backend: s.completed.saturating_sub(s.submitted),
                    completed: s.completed,
                });
            } else {
                self.dropped += 1;
            }
        }
    }

    /// Hot, per poll that fetched requests: the queue depth seen by this batch.
    #[inline]
    pub fn depth(&mut self, depth: u32) {
        if depth > 0 {
            self.depth.saturating_record(u64::from(depth));
        }
    }

    /// Hot: requests submitted to the backend and not yet completed.
    #[inline]
    pub fn set_inflight(&mut self, n: u32) {
        self.inflight = n;
    }

    /// Hot: whether traced requests finished in this poll and wait for the batch
    /// stamps (so the device reads the clock only then).
    #[inline]
    pub fn has_finished(&self) -> bool {
        !self.finished.is_empty()
    }

    /// Hot, once per poll, after completions were posted (`posted`) and the interrupt
    /// signalled (`signalled`; equal to `posted` when none was sent). Folds the
    /// poll's traced requests into the histograms and answers a snapshot request.
    #[inline]
    pub fn end_poll(&mut self, posted: u64, signalled: u64) {
        if !self.finished.is_empty() {
            self.fold(posted, signalled);
        }
        if self.mailbox.wanted() {
            self.answer();
        }
    }

    fn fold(&mut self, posted: u64, signalled: u64) {
        // Tick deltas, no scaling per request (see `snapshot`).
        let notify = signalled.saturating_sub(posted);
        for f in self.finished.drain(..) {
            let Some(ns) = self.ns.get_mut(f.ns as usize) else {
                continue;
            };
            let Some(t) = ns.trace.as_mut() else {
                continue;
            };
            let d = [f.queue, f.backend, posted.saturating_sub(f.completed)];
            let total = d[0] + d[1] + d[2] + notify;
            let row = &mut t.by_op[usize::from(f.write)];
            for (h, v) in row.iter_mut().zip(d) {
                h.record(v);
            }
            row[NUM_STAMPED - 1].record(total);
            ns.notify_due[usize::from(f.write)] += 1;
        }
        for ns in self.ns.iter_mut() {
            let due = std::mem::take(&mut ns.notify_due);
            if let Some(t) = ns.trace.as_mut() {
                for (row, n) in t.by_op.iter_mut().zip(due) {
                    if n > 0 {
                        row[NUM_STAMPED - 2].record_n(notify, n);
                    }
                }
            }
        }
    }

    #[cold]
    fn answer(&mut self) {
        self.mailbox.answer(self.snapshot());
    }

    /// The queue's data now (for pollers that are not running, or tests).
    pub fn snapshot(&self) -> QueueSnapshot {
        let per_tick = clock::ns_per_tick();
        let ns_of = |b: &TickBuckets| {
            let mut h = tick_hist();
            b.fold_into(&mut h);
            HistSnapshot::from_ticks(&h, clock::ticks_to_ns, per_tick)
        };
        let namespaces = self
            .ns
            .iter()
            .zip(self.counts.iter())
            .enumerate()
            .filter(|(i, (_, c))| *i > 0 || c.ops().iter().any(|&n| n > 0))
            .map(|(i, (ns, c))| NsSnapshot {
                nsid: i as u32,
                ops: OpCounts::from_array(c.ops()),
                bytes: OpCounts::from_array(c.bytes()),
                errors: ns
                    .errors
                    .iter()
                    .map(|&(status, count)| StatusCount { status, count })
                    .collect(),
                latency: ns.trace.as_ref().map_or_else(HistSnapshot::default, |t| {
                    let mut h = tick_hist();
                    for row in &t.by_op {
                        row[NUM_STAMPED - 1].fold_into(&mut h);
                    }
                    HistSnapshot::from_ticks(&h, clock::ticks_to_ns, per_tick)
                }),
                layers: ns.trace.as_ref().map_or_else(Vec::new, |t| {
                    ["read", "write"]
                        .iter()
                        .zip(t.by_op.iter())
                        .map(|(op, row)| LayerHists {
                            op: op.to_string(),
                            layers: LAYERS
                                .iter()
                                .chain(std::iter::once(&TOTAL))
                                .zip(row.iter())
                                .map(|(name, h)| (name.to_string(), ns_of(h)))
                                .collect(),
                        })
                        .collect()
                }),
            })
            .collect();
        QueueSnapshot {
            queue: self.queue,
            inflight: self.inflight,
            depth: HistSnapshot::from_hist(&self.depth),
            trace: self.settings,
            dropped_samples: self.dropped,
            namespaces,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(rec: &mut QueueRecorder, n: usize) {
        rec.begin_poll();
        let kick = rec.kick();
        for _ in 0..n {
            let k = rec.sample(kick);
            let sub = QueueRecorder::stamp(k);
            let done = QueueRecorder::stamp(k);
            rec.complete(
                1,
                OpClass::Read,
                4096,
                0,
                Stamps {
                    kick: k,
                    submitted: sub,
                    completed: done,
                },
            );
        }
        let p = if rec.has_finished() { clock::now() } else { 0 };
        rec.end_poll(p, p);
    }

    #[test]
    fn off_counts_but_does_not_trace() {
        let ctl = Arc::new(TraceControl::default());
        let mut rec = QueueRecorder::new(1, 2, 64, ctl);
        run(&mut rec, 10);
        let s = rec.snapshot();
        let ns1 = s.namespaces.iter().find(|n| n.nsid == 1).unwrap();
        assert_eq!(ns1.ops.read, 10);
        assert_eq!(ns1.bytes.read, 40960);
        assert!(ns1.layers.is_empty());
        assert_eq!(ns1.latency.count, 0);
    }

    #[test]
    fn sampling_one_in_n() {
        let ctl = Arc::new(TraceControl::default());
        let mut rec = QueueRecorder::new(1, 1, 64, ctl.clone());
        ctl.start(10);
        for _ in 0..100 {
            run(&mut rec, 50);
        }
        let s = rec.snapshot();
        let ns1 = s.namespaces.iter().find(|n| n.nsid == 1).unwrap();
        assert_eq!(ns1.ops.read, 5000);
        let total = &ns1.layers[0].layers[4];
        assert_eq!(total.0, "total");
        assert_eq!(total.1.count, 500);
        // A new start clears the layers but not the counters.
        ctl.start(1);
        run(&mut rec, 7);
        let s = rec.snapshot();
        let ns1 = s.namespaces.iter().find(|n| n.nsid == 1).unwrap();
        assert_eq!(ns1.ops.read, 5007);
        assert_eq!(ns1.layers[0].layers[4].1.count, 7);
    }

    #[test]
    fn every_completion_is_counted_once_and_readable_anywhere() {
        let ctl = Arc::new(TraceControl::default());
        let mut rec = QueueRecorder::new(1, 1, 64, ctl);
        let counters = rec.counters();
        run(&mut rec, 3);
        rec.complete(1, OpClass::Write, 512, 0, Stamps::default());
        rec.complete(1, OpClass::Write, 512, 0x281, Stamps::default());
        rec.complete(9, OpClass::Flush, 0, 0, Stamps::default());
        // Read from another thread, without the poller answering.
        let t = std::thread::spawn(move || counters.totals())
            .join()
            .unwrap();
        assert_eq!(
            (t.ops.read, t.ops.write, t.ops.flush, t.ops.other),
            (3, 2, 1, 0)
        );
        assert_eq!((t.bytes.read, t.bytes.write), (3 * 4096, 512));
        assert_eq!(t.errors, 1);
        assert_eq!(rec.error_count(1, 0x281), 1);
        // The snapshot shows the same numbers.
        let s = rec.snapshot();
        let mut sum = OpCounts::default();
        for ns in &s.namespaces {
            sum.add(&ns.ops);
        }
        assert_eq!(sum, t.ops);
        // Growing the namespace table keeps what was counted, for old and new readers.
        rec.ensure_namespaces(4);
        rec.complete(4, OpClass::Read, 4096, 0, Stamps::default());
        let t = rec.counters().totals();
        assert_eq!((t.ops.read, t.bytes.read, t.errors), (4, 4 * 4096, 1));
    }

    #[test]
    fn errors_by_status_are_bounded() {
        let ctl = Arc::new(TraceControl::default());
        let mut rec = QueueRecorder::new(1, 1, 4, ctl);
        for st in 1..=100u16 {
            rec.complete(1, OpClass::Write, 512, st, Stamps::default());
            rec.complete(7, OpClass::Other, 0, 0x0b, Stamps::default());
        }
        let s = rec.snapshot();
        let ns1 = s.namespaces.iter().find(|n| n.nsid == 1).unwrap();
        assert!(ns1.errors.len() <= MAX_STATUSES);
        assert_eq!(ns1.errors.iter().map(|e| e.count).sum::<u64>(), 100);
        assert_eq!(ns1.bytes.write, 0);
        let ns0 = s.namespaces.iter().find(|n| n.nsid == 0).unwrap();
        assert_eq!(
            ns0.errors,
            vec![StatusCount {
                status: 0x0b,
                count: 100
            }]
        );
    }
}
