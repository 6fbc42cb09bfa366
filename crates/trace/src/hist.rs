//! HDR histograms with fixed bounds (so adding never resizes) and their serde form.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// 1 ns .. 100 s at 2 significant digits (~1 % error, ~30 KiB each).
pub(crate) fn latency_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 2).expect("static histogram bounds are valid")
}

/// Raw clock ticks, 1 .. 10^12 (100 s up to a 10 GHz counter) at 2 significant
/// digits: the layer histograms record unconverted tick deltas and are scaled to ns
/// when a snapshot is taken.
pub(crate) fn tick_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 1_000_000_000_000, 2).expect("static histogram bounds are valid")
}

/// Queue depths 1 .. 65536, exact up to 128.
pub(crate) fn depth_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 65_536, 2).expect("static histogram bounds are valid")
}

/// A histogram as data: summary plus the recorded buckets (value, count), so
/// snapshots of many queues can be merged again.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HistSnapshot {
    pub count: u64,
    pub mean: f64,
    pub min: u64,
    pub p50: u64,
    pub p99: u64,
    pub p99_9: u64,
    pub max: u64,
    /// (value, count) of every non-empty bucket, ascending; the value is the bucket's
    /// highest equivalent value.
    pub buckets: Vec<(u64, u64)>,
}

impl HistSnapshot {
    pub fn from_hist(h: &Histogram<u64>) -> HistSnapshot {
        if h.is_empty() {
            return HistSnapshot::default();
        }
        HistSnapshot {
            count: h.len(),
            mean: h.mean(),
            min: h.min(),
            p50: h.value_at_quantile(0.50),
            p99: h.value_at_quantile(0.99),
            p99_9: h.value_at_quantile(0.999),
            max: h.max(),
            buckets: h
                .iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
        }
    }

    /// A histogram of clock ticks as nanoseconds: every value is scaled by `to_ns`
    /// and the mean by `ns_per_tick`, a linear map that keeps the layers' means
    /// adding up exactly as they did in ticks.
    pub fn from_ticks(
        h: &Histogram<u64>,
        to_ns: impl Fn(u64) -> u64,
        ns_per_tick: f64,
    ) -> HistSnapshot {
        if h.is_empty() {
            return HistSnapshot::default();
        }
        HistSnapshot {
            count: h.len(),
            mean: h.mean() * ns_per_tick,
            min: to_ns(h.min()),
            p50: to_ns(h.value_at_quantile(0.50)),
            p99: to_ns(h.value_at_quantile(0.99)),
            p99_9: to_ns(h.value_at_quantile(0.999)),
            max: to_ns(h.max()),
            buckets: h
                .iter_recorded()
                .map(|v| (to_ns(v.value_iterated_to()), v.count_at_value()))
                .collect(),
        }
    }

    /// Merges snapshots (e.g. of all queues of a device) into one.
    pub fn merge<'a>(parts: impl IntoIterator<Item = &'a HistSnapshot>) -> HistSnapshot {
        let mut h = latency_hist();
        for p in parts {
            for &(v, n) in &p.buckets {
                h.saturating_record_n(v.max(1), n);
            }
        }
        HistSnapshot::from_hist(&h)
    }

    /// Observations at or below `le` (for Prometheus histogram buckets).
    pub fn count_le(&self, le: u64) -> u64 {
        self.buckets
            .iter()
            .take_while(|(v, _)| *v <= le)
            .map(|(_, n)| n)
            .sum()
    }
}
