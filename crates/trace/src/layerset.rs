//! Layer histograms for reads and writes with caller-chosen layer names: what an
//! initiator (or any other single-threaded measurer) records.

use hdrhistogram::Histogram;

use crate::breakdown::{Breakdown, LayerRow, OpBreakdown, Side};
use crate::hist::{latency_hist, HistSnapshot};

/// Read and write rows of `names.len()` layers each; the last name is usually
/// `total`. Recording is allocation-free.
pub struct LayerSet {
    names: &'static [&'static str],
    by_op: [Vec<Histogram<u64>>; 2],
}

impl LayerSet {
    pub fn new(names: &'static [&'static str]) -> LayerSet {
        let row = || names.iter().map(|_| latency_hist()).collect();
        LayerSet {
            names,
            by_op: [row(), row()],
        }
    }

    /// Records one request: `ns[i]` is the time spent in layer `names[i]`.
    #[inline]
    pub fn record(&mut self, write: bool, ns: &[u64]) {
        for (h, v) in self.by_op[usize::from(write)].iter_mut().zip(ns) {
            h.saturating_record((*v).max(1));
        }
    }

    /// Adds another set with the same names.
    pub fn add(&mut self, other: &LayerSet) {
        for (mine, theirs) in self.by_op.iter_mut().zip(other.by_op.iter()) {
            for (a, b) in mine.iter_mut().zip(theirs.iter()) {
                // Same fixed bounds everywhere, so adding cannot fail.
                let _ = a.add(b);
            }
        }
    }

    /// The table, every row marked as measured by `side`; ops with no requests are
    /// left out.
    pub fn breakdown(&self, side: Side) -> Breakdown {
        let ops = ["read", "write"]
            .iter()
            .zip(self.by_op.iter())
            .filter(|(_, row)| row.first().is_some_and(|h| !h.is_empty()))
            .map(|(op, row)| OpBreakdown {
                op: op.to_string(),
                rows: self
                    .names
                    .iter()
                    .zip(row.iter())
                    .map(|(n, h)| LayerRow::from_hist(n, side, &HistSnapshot::from_hist(h)))
                    .collect(),
            })
            .collect();
        Breakdown { ops }
    }
}
