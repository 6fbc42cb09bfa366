//! Median and range of a quantity over runs: what every table and figure shows.

use serde::{Deserialize, Serialize};

/// Median and range of one quantity over a cell's runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Stat {
    pub fn of(v: &[f64]) -> Option<Stat> {
        let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        if s.is_empty() {
            return None;
        }
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        Some(Stat {
            median,
            min: s[0],
            max: s[n - 1],
        })
    }

    pub fn fmt(&self, scale: f64, nd: usize) -> String {
        format!(
            "{:.nd$} ({:.nd$}–{:.nd$})",
            self.median * scale,
            self.min * scale,
            self.max * scale
        )
    }
}
