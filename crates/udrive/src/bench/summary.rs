//! From raw runs to cells: median and min–max per (datapath, backend, workload), and
//! ratios against the baseline datapath taken per repetition (the two ran minutes
//! apart at most, on the machine in the same state) before their median.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::matrix::{bs_name, Backend, DatapathKind, Matrix, Point};
use super::run::{RunRecord, Skipped};

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

    fn fmt(&self, scale: f64, nd: usize) -> String {
        format!(
            "{:.nd$} ({:.nd$}–{:.nd$})",
            self.median * scale,
            self.min * scale,
            self.max * scale
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    pub datapath: DatapathKind,
    pub backend: Backend,
    pub point: Point,
    /// Runs that produced numbers.
    pub n: usize,
    pub failed: usize,
    pub iops: Option<Stat>,
    pub mean_us: Option<Stat>,
    pub p99_us: Option<Stat>,
    /// IOPS ÷ the baseline's in the same repetition.
    pub iops_vs_baseline: Option<Stat>,
    /// Mean latency ÷ the baseline's in the same repetition.
    pub mean_vs_baseline: Option<Stat>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub description: String,
    pub reps: u32,
    pub time_s: f64,
    pub ramp_s: f64,
    pub baseline: Option<DatapathKind>,
    pub cpus: super::matrix::Cpus,
    /// `rep datapath backend` of each server's stint, in execution order.
    pub order: Vec<String>,
    pub cells: Vec<Cell>,
    pub skipped: Vec<Skipped>,
    /// Host facts next to the numbers: load average before and after, versions.
    pub host: BTreeMap<String, String>,
}

type Key = (DatapathKind, Backend, Point);

fn by_cell(runs: &[RunRecord]) -> BTreeMap<Key, Vec<&RunRecord>> {
    let mut m: BTreeMap<Key, Vec<&RunRecord>> = BTreeMap::new();
    for r in runs {
        m.entry((r.datapath.clone(), r.backend, r.point)).or_default().push(r);
    }
    m
}

/// Per repetition: this cell's value ÷ the baseline's, where both ran.
fn ratios(mine: &[&RunRecord], base: &[&RunRecord], f: impl Fn(&RunRecord) -> Option<f64>) -> Option<Stat> {
    let v: Vec<f64> = mine
        .iter()
        .filter_map(|r| {
            let b = base.iter().find(|b| b.rep == r.rep)?;
            Some(f(r)? / f(b)?)
        })
        .collect();
    Stat::of(&v)
}

pub fn summarize(m: &Matrix, runs: &[RunRecord], skipped: Vec<Skipped>, host: BTreeMap<String, String>) -> Summary {
    let cells_in = by_cell(runs);
    let mut order = Vec::new();
    for r in runs {
        let s = format!("{} {} {}", r.rep, r.datapath, r.backend);
        if order.last() != Some(&s) {
            order.push(s);
        }
    }
    let mut cells = Vec::new();
    for ((d, b, p), rs) in &cells_in {
        let ok: Vec<&RunRecord> = rs.iter().copied().filter(|r| r.error.is_none()).collect();
        let col = |f: &dyn Fn(&RunRecord) -> Option<f64>| -> Vec<f64> { ok.iter().filter_map(|r| f(r)).collect() };
        let base: Option<Vec<&RunRecord>> = m
            .baseline
            .as_ref()
            .filter(|bl| *bl != d)
            .and_then(|bl| cells_in.get(&(bl.clone(), *b, *p)))
            .map(|v| v.iter().copied().filter(|r| r.error.is_none()).collect());
        cells.push(Cell {
            datapath: d.clone(),
            backend: *b,
            point: *p,
            n: ok.len(),
            failed: rs.len() - ok.len(),
            iops: Stat::of(&col(&RunRecord::iops)),
            mean_us: Stat::of(&col(&|r| r.lat_us("mean"))),
            p99_us: Stat::of(&col(&|r| r.lat_us("p99"))),
            iops_vs_baseline: base.as_ref().and_then(|bs| ratios(&ok, bs, RunRecord::iops)),
            mean_vs_baseline: base.as_ref().and_then(|bs| ratios(&ok, bs, |r| r.lat_us("mean"))),
        });
    }
    // The matrix's order, not the map's: datapaths as listed, workloads as listed.
    let points = m.points();
    let pos = |c: &Cell| {
        (
            m.backends.iter().position(|b| *b == c.backend),
            points.iter().position(|p| *p == c.point),
            m.datapaths.iter().position(|d| *d == c.datapath),
        )
    };
    cells.sort_by_key(pos);
    Summary {
        description: m.description.clone(),
        reps: m.reps,
        time_s: m.time,
        ramp_s: m.ramp,
        baseline: m.baseline.clone(),
        cpus: m.cpus.clone(),
        order,
        cells,
        skipped,
        host,
    }
}

/// A workload's name for tables and figures: `randread 4k QD1 ×1`.
pub fn point_label(p: &Point) -> String {
    let rw = match p.rw {
        super::matrix::Rw::Randrw => format!("randrw {}%", p.rwmixread),
        rw => rw.to_string(),
    };
    format!("{rw} {} QD{} ×{}", bs_name(p.bs), p.qd, p.jobs)
}

fn opt(s: Option<Stat>, scale: f64, nd: usize) -> String {
    s.map_or("—".into(), |s| s.fmt(scale, nd))
}

/// summary.md: one table per backend.
pub fn markdown(s: &Summary) -> String {
    let mut o = String::new();
    let base = s.baseline.as_ref().map_or("—".to_string(), |b| b.to_string());
    let _ = writeln!(o, "# udrive bench\n\n{}\n", s.description);
    let _ = writeln!(
        o,
        "{} repetitions × {} s (warm-up {} s), server CPUs {}, client CPUs {}; median (min–max); \
         ratios against `{base}` per repetition.\n",
        s.reps, s.time_s, s.ramp_s, s.cpus.server, s.cpus.client
    );
    let mut backends: Vec<Backend> = s.cells.iter().map(|c| c.backend).collect();
    backends.dedup();
    for b in backends {
        let _ = writeln!(o, "## {b}\n");
        let _ = writeln!(o, "| workload | datapath | n | IOPS (k) | mean (µs) | p99 (µs) | IOPS ÷ {base} | mean ÷ {base} |");
        let _ = writeln!(o, "|---|---|---|---|---|---|---|---|");
        for c in s.cells.iter().filter(|c| c.backend == b) {
            let _ = writeln!(
                o,
                "| {} | {} | {}{} | {} | {} | {} | {} | {} |",
                point_label(&c.point),
                c.datapath,
                c.n,
                if c.failed > 0 { format!(" ({} failed)", c.failed) } else { String::new() },
                opt(c.iops, 1e-3, 0),
                opt(c.mean_us, 1.0, 2),
                opt(c.p99_us, 1.0, 2),
                opt(c.iops_vs_baseline, 1.0, 2),
                opt(c.mean_vs_baseline, 1.0, 2),
            );
        }
        o.push('\n');
    }
    if !s.skipped.is_empty() {
        let _ = writeln!(o, "## Skipped\n");
        for k in &s.skipped {
            let on = k.backend.map_or(String::new(), |b| format!(" on {b}"));
            let _ = writeln!(o, "- {}{on}: {}", k.datapath, k.reason);
        }
        o.push('\n');
    }
    let _ = writeln!(o, "## Host\n");
    for (k, v) in &s.host {
        let _ = writeln!(o, "- {k}: {v}");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(Stat::of(&[3.0, 1.0, 2.0]).unwrap().median, 2.0);
        let s = Stat::of(&[4.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 4.0));
        assert!(Stat::of(&[f64::NAN]).is_none());
    }
}
