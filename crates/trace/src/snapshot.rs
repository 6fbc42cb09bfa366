//! Serde types the control socket returns (`get_stats`, `trace_read`).

use serde::{Deserialize, Serialize};

use crate::control::TraceSettings;
use crate::hist::HistSnapshot;

/// Per operation type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCounts {
    pub read: u64,
    pub write: u64,
    pub flush: u64,
    pub other: u64,
}

impl OpCounts {
    pub(crate) fn from_array(a: [u64; 4]) -> OpCounts {
        OpCounts {
            read: a[0],
            write: a[1],
            flush: a[2],
            other: a[3],
        }
    }

    pub fn total(&self) -> u64 {
        self.read + self.write + self.flush + self.other
    }

    pub fn add(&mut self, o: &OpCounts) {
        self.read += o.read;
        self.write += o.write;
        self.flush += o.flush;
        self.other += o.other;
    }

    pub fn pairs(&self) -> [(&'static str, u64); 4] {
        [
            ("read", self.read),
            ("write", self.write),
            ("flush", self.flush),
            ("other", self.other),
        ]
    }
}

/// Completions with one error status (the device's own code, e.g. NVMe
/// `SCT << 8 | SC`; 0xffff collects statuses beyond the per-namespace limit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusCount {
    pub status: u16,
    pub count: u64,
}

/// Layer histograms of one op type, in request order, the last being `total`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerHists {
    pub op: String,
    pub layers: Vec<(String, HistSnapshot)>,
}

/// One namespace as seen by one queue. `nsid` 0 collects requests that named no
/// valid namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NsSnapshot {
    pub nsid: u32,
    pub ops: OpCounts,
    /// Bytes of successful requests.
    pub bytes: OpCounts,
    pub errors: Vec<StatusCount>,
    /// Doorbell seen -> interrupt signalled (the layers' `total`) of traced reads
    /// and writes (empty when tracing was never started).
    pub latency: HistSnapshot,
    /// Empty unless a trace was started.
    pub layers: Vec<LayerHists>,
}

/// One queue (for NVMe: one completion queue with its submission queues).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub queue: u16,
    /// Requests at the backend when the snapshot was taken.
    pub inflight: u32,
    /// Requests outstanding when a batch was fetched, one observation per batch.
    pub depth: HistSnapshot,
    pub trace: TraceSettings,
    /// Traced requests not recorded because the per-poll buffer was full.
    pub dropped_samples: u64,
    pub namespaces: Vec<NsSnapshot>,
}

/// One device (NVMe controller, virtio-blk device).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceStats {
    /// The name operators know it by (socket stem, config name).
    pub name: String,
    /// "nvme" or "virtio-blk".
    pub kind: String,
    pub queues: Vec<QueueSnapshot>,
}

/// One reactor thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReactorSnapshot {
    pub reactor: usize,
    /// Poll iterations, and those that found work.
    pub polls: u64,
    pub busy_polls: u64,
    /// Work items (requests fetched + completions posted) over all busy polls.
    pub work_items: u64,
    /// Thread CPU time.
    pub cpu_ns: u64,
    /// Sleeps begun because every poller let it (adaptive/event modes); absent in
    /// snapshots from before it was reported.
    #[serde(default)]
    pub sleeps: u64,
}

/// Everything `get_stats` returns.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    pub devices: Vec<DeviceStats>,
    pub reactors: Vec<ReactorSnapshot>,
}

/// How trace data of two snapshots of one queue combine.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TraceMerge {
    Merge,
    KeepMine,
    TakeTheirs,
}

impl NsSnapshot {
    fn clear_trace(&mut self) {
        self.latency = HistSnapshot::default();
        self.layers.clear();
    }

    fn absorb(&mut self, o: &NsSnapshot, how: TraceMerge) {
        self.ops.add(&o.ops);
        self.bytes.add(&o.bytes);
        for e in &o.errors {
            match self.errors.iter_mut().find(|x| x.status == e.status) {
                Some(x) => x.count += e.count,
                None => self.errors.push(*e),
            }
        }
        match how {
            TraceMerge::KeepMine => return,
            TraceMerge::TakeTheirs => {
                self.latency = o.latency.clone();
                self.layers = o.layers.clone();
                return;
            }
            TraceMerge::Merge => {}
        }
        self.latency = HistSnapshot::merge([&self.latency, &o.latency]);
        for l in &o.layers {
            match self.layers.iter_mut().find(|x| x.op == l.op) {
                Some(mine) => {
                    for (name, h) in &l.layers {
                        match mine.layers.iter_mut().find(|(n, _)| n == name) {
                            Some((_, m)) => *m = HistSnapshot::merge([&*m, h]),
                            None => mine.layers.push((name.clone(), h.clone())),
                        }
                    }
                }
                None => self.layers.push(l.clone()),
            }
        }
    }
}

impl QueueSnapshot {
    /// Adds `o` (the same queue id at another time: a deleted incarnation, or the
    /// live one) into `self`. Counters add up; trace data is merged when both belong
    /// to the same trace, else only that of the trace with epoch `current` is kept.
    pub fn absorb(&mut self, o: &QueueSnapshot, current: u32) {
        let mine = self.trace.epoch == current;
        let theirs = o.trace.epoch == current;
        let how = match (mine, theirs) {
            (true, false) => TraceMerge::KeepMine,
            (false, true) => TraceMerge::TakeTheirs,
            _ if self.trace.epoch == o.trace.epoch => TraceMerge::Merge,
            _ => TraceMerge::KeepMine,
        };
        for ns in &o.namespaces {
            match self.namespaces.iter_mut().find(|x| x.nsid == ns.nsid) {
                Some(m) => m.absorb(ns, how),
                None => {
                    let mut n = ns.clone();
                    if how == TraceMerge::KeepMine {
                        n.clear_trace();
                    }
                    self.namespaces.push(n);
                }
            }
        }
        if how == TraceMerge::TakeTheirs {
            for m in self.namespaces.iter_mut() {
                if !o.namespaces.iter().any(|x| x.nsid == m.nsid) {
                    m.clear_trace();
                }
            }
            self.trace = o.trace;
        }
        self.namespaces.sort_by_key(|n| n.nsid);
        self.depth = HistSnapshot::merge([&self.depth, &o.depth]);
        self.inflight = o.inflight;
        self.dropped_samples += o.dropped_samples;
    }

    /// Drops latency and layer data (they belong to an earlier trace).
    pub fn clear_trace(&mut self) {
        for ns in self.namespaces.iter_mut() {
            ns.clear_trace();
        }
    }
}
