//! Request counters: the one place a completed request is counted. The poller that
//! owns a queue writes them (a relaxed load and store per value, no read-modify-write:
//! it is the only writer); any thread reads them, without asking the poller, through
//! [`IoCounters`]. NVMe's SMART page and controller stats, virtio-blk's worker stats,
//! `get_stats` and Prometheus all read these same values.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::snapshot::OpCounts;
use crate::OpClass;

/// One namespace's counters in one queue.
#[derive(Debug, Default)]
pub(crate) struct NsCounts {
    pub ops: [AtomicU64; 4],
    /// Bytes of successful requests.
    pub bytes: [AtomicU64; 4],
    /// Requests that completed with an error status.
    pub errors: AtomicU64,
}

/// Adds `n` to a counter only its owner thread writes.
#[inline]
pub(crate) fn bump(a: &AtomicU64, n: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

impl NsCounts {
    pub fn ops(&self) -> [u64; 4] {
        self.ops.each_ref().map(load)
    }

    pub fn bytes(&self) -> [u64; 4] {
        self.bytes.each_ref().map(load)
    }

    fn copy_from(&self, o: &NsCounts) {
        for (a, b) in self.ops.iter().zip(&o.ops) {
            a.store(load(b), Ordering::Relaxed);
        }
        for (a, b) in self.bytes.iter().zip(&o.bytes) {
            a.store(load(b), Ordering::Relaxed);
        }
        self.errors.store(load(&o.errors), Ordering::Relaxed);
    }
}

/// Counters of one queue by namespace, as the poller writes them.
pub(crate) type CountBlock = Arc<[NsCounts]>;

pub(crate) fn new_block(namespaces: usize, old: Option<&[NsCounts]>) -> CountBlock {
    let block: CountBlock = (0..namespaces).map(|_| NsCounts::default()).collect();
    if let Some(old) = old {
        for (n, o) in block.iter().zip(old) {
            n.copy_from(o);
        }
    }
    block
}

/// A queue's request counters for readers on any thread (the control path: SMART
/// log page, controller stats). Get it from [`crate::QueueRecorder::counters`].
#[derive(Debug)]
pub struct IoCounters {
    /// Replaced (values carried over) when the queue makes room for more
    /// namespaces, which happens on the control path.
    block: Mutex<CountBlock>,
}

impl IoCounters {
    pub(crate) fn new(block: CountBlock) -> IoCounters {
        IoCounters {
            block: Mutex::new(block),
        }
    }

    pub(crate) fn replace(&self, block: CountBlock) {
        *self.block.lock().unwrap_or_else(|e| e.into_inner()) = block;
    }

    /// Sums over every namespace of the queue (namespace 0 included: requests that
    /// named no valid namespace).
    pub fn totals(&self) -> IoTotals {
        let block = self.block.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut t = IoTotals::default();
        for ns in block.iter() {
            t.ops.add(&OpCounts::from_array(ns.ops()));
            t.bytes.add(&OpCounts::from_array(ns.bytes()));
            t.errors = t.errors.wrapping_add(load(&ns.errors));
        }
        t
    }
}

/// Requests counted by a queue (or summed over queues): completions by operation,
/// bytes of the successful ones, and how many failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoTotals {
    pub ops: OpCounts,
    pub bytes: OpCounts,
    pub errors: u64,
}

impl IoTotals {
    pub fn add(&mut self, o: &IoTotals) {
        self.ops.add(&o.ops);
        self.bytes.add(&o.bytes);
        self.errors = self.errors.wrapping_add(o.errors);
    }

    pub fn ops_of(&self, op: OpClass) -> u64 {
        self.ops.pairs()[op as usize].1
    }
}
