//! Per-request layer times as a flat log-linear bucket array, folded into an HDR
//! histogram only when a snapshot is taken.
//!
//! Why not record into `hdrhistogram` directly: its record path (index lookup with
//! range checks, min/max and total-count updates, clamping) costs several ns per
//! value, and a traced request records four values, against a budget of ~8 ns for
//! all of tracing. The grid here is exactly HDR's at 2 significant digits (values
//! below 256 exact, then 128 linear sub-buckets per power of two), so folding a
//! bucket into the HDR histogram puts its count in the same HDR bucket: no precision
//! is lost, and snapshots, merging and Prometheus output stay HDR.

use hdrhistogram::Histogram;

const SUB_BITS: u32 = 7;
const SUB: usize = 1 << SUB_BITS;
/// Highest value kept exactly in its bucket (2^40 ticks: minutes at GHz rates);
/// larger ones are counted in the last bucket.
const MAX_BITS: u32 = 40;
const MAX: u64 = (1 << MAX_BITS) - 1;
const LEN: usize = 2 * SUB + (MAX_BITS as usize - SUB_BITS as usize - 1) * SUB;

/// Counts of tick values on HDR's 2-significant-digit grid.
pub(crate) struct TickBuckets {
    counts: Box<[u64; LEN]>,
}

#[inline]
fn index(v: u64) -> usize {
    let v = v.min(MAX);
    if v < 2 * SUB as u64 {
        return v as usize;
    }
    let shift = 63 - v.leading_zeros() - SUB_BITS;
    let top = (v >> shift) as usize; // SUB..2*SUB
    2 * SUB + (shift as usize - 1) * SUB + (top - SUB)
}

/// A value inside bucket `i` (its lowest), the inverse of [`index`].
fn value_of(i: usize) -> u64 {
    if i < 2 * SUB {
        return i as u64;
    }
    let shift = (i - 2 * SUB) / SUB + 1;
    let top = (i - 2 * SUB) % SUB + SUB;
    (top as u64) << shift
}

impl TickBuckets {
    pub(crate) fn new() -> TickBuckets {
        TickBuckets {
            counts: Box::new([0; LEN]),
        }
    }

    /// Hot: one value.
    #[inline]
    pub(crate) fn record(&mut self, v: u64) {
        // `index` is below LEN for every u64 (tested), so this never panics.
        self.counts[index(v)] += 1;
    }

    /// Hot: `n` equal values.
    #[inline]
    pub(crate) fn record_n(&mut self, v: u64, n: u64) {
        self.counts[index(v)] += n;
    }

    /// Adds the counts to `h` (an HDR histogram with 2 significant digits); 0 is
    /// recorded as 1, HDR's lowest value.
    pub(crate) fn fold_into(&self, h: &mut Histogram<u64>) {
        for (i, &n) in self.counts.iter().enumerate() {
            if n > 0 {
                h.saturating_record_n(value_of(i).max(1), n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hist::tick_hist;

    #[test]
    fn grid_matches_hdr_two_digits() {
        let h = tick_hist();
        let mut vals: Vec<u64> = (0..5000).collect();
        for b in 8..64 {
            for d in [0u64, 1, 3, 1 << (b - 8), 1 << (b - 1)] {
                vals.push((1u64 << b) - 1);
                vals.push((1u64 << b) + d);
            }
        }
        vals.push(u64::MAX);
        for v in vals {
            let i = index(v);
            assert!(i < LEN, "{v}");
            if v <= MAX {
                let lo = value_of(i);
                assert!(lo <= v && index(lo) == i, "{v}: bucket {i} starts at {lo}");
                // Same bucket in HDR: equal lowest equivalent values.
                if v >= 1 {
                    assert_eq!(
                        h.lowest_equivalent(v),
                        h.lowest_equivalent(lo.max(1)),
                        "{v}"
                    );
                }
            } else {
                assert_eq!(i, LEN - 1);
            }
        }
    }

    #[test]
    fn fold_keeps_counts_and_quantiles() {
        let mut b = TickBuckets::new();
        let mut direct = tick_hist();
        for v in [0u64, 1, 7, 300, 301, 1000, 123_456, 10_000_000] {
            b.record(v);
            direct.saturating_record(v.max(1));
        }
        b.record_n(5000, 10);
        direct.saturating_record_n(5000, 10);
        let mut h = tick_hist();
        b.fold_into(&mut h);
        assert_eq!(h.len(), direct.len());
        for q in [0.0, 0.25, 0.5, 0.9, 0.99, 1.0] {
            assert_eq!(
                h.highest_equivalent(h.value_at_quantile(q)),
                direct.highest_equivalent(direct.value_at_quantile(q)),
                "q {q}"
            );
        }
    }
}
