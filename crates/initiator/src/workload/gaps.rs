//! The longest pauses between consecutive completions of a job: what a client
//! sees of a server that stops for a while (a live handover, a restart). Kept as a
//! fixed top-K list, so the completion path costs one comparison.

use serde::Serialize;

/// One pause: when it ended (seconds since the job started) and how long it was.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Gap {
    pub at_s: f64,
    pub ns: u64,
}

/// The `k` longest gaps seen, shortest first.
#[derive(Clone, Debug, Default)]
pub(crate) struct TopGaps {
    k: usize,
    v: Vec<Gap>,
}

impl TopGaps {
    pub fn new(k: usize) -> TopGaps {
        TopGaps {
            k,
            v: Vec::with_capacity(k),
        }
    }

    /// The smallest gap that would enter the list.
    fn floor(&self) -> u64 {
        if self.v.len() < self.k {
            0
        } else {
            self.v.first().map_or(u64::MAX, |g| g.ns)
        }
    }

    pub fn record(&mut self, ns: u64, at_s: f64) {
        if self.k == 0 || ns <= self.floor() {
            return;
        }
        if self.v.len() == self.k {
            self.v.remove(0);
        }
        let at = self.v.partition_point(|g| g.ns < ns);
        self.v.insert(at, Gap { at_s, ns });
    }

    /// Merges jobs' lists: the `k` longest of all, longest first.
    pub fn merge(k: usize, lists: impl IntoIterator<Item = TopGaps>) -> Vec<Gap> {
        let mut all: Vec<Gap> = lists.into_iter().flat_map(|l| l.v).collect();
        all.sort_by_key(|g| std::cmp::Reverse(g.ns));
        all.truncate(k);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_k_longest() {
        let mut t = TopGaps::new(3);
        for (i, ns) in [5u64, 1, 9, 7, 3, 8, 2].iter().enumerate() {
            t.record(*ns, i as f64);
        }
        let m = TopGaps::merge(3, [t]);
        assert_eq!(m.iter().map(|g| g.ns).collect::<Vec<_>>(), vec![9, 8, 7]);
        assert_eq!(m[0].at_s, 2.0);
        let mut none = TopGaps::new(0);
        none.record(100, 0.0);
        assert!(TopGaps::merge(0, [none]).is_empty());
    }
}
