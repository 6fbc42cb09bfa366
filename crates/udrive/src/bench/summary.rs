//! From raw runs to cells: median and min–max per (datapath, backend, workload), and
//! the comparison with each baseline datapath taken per repetition (the two ran
//! minutes apart at most, on the machine in the same state) before their median.

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
    /// The median latency: on a shared machine a few preempted I/Os of milliseconds
    /// move the mean, not this.
    pub p50_us: Option<Stat>,
    pub p99_us: Option<Stat>,
    /// Against each baseline that ran this backend and workload (not itself).
    pub vs: Vec<Versus>,
}

/// One cell against one baseline, per repetition.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Versus {
    pub baseline: DatapathKind,
    /// IOPS ÷ the baseline's.
    pub iops_ratio: Option<Stat>,
    /// Mean latency ÷ the baseline's.
    pub mean_ratio: Option<Stat>,
    /// Mean latency − the baseline's, µs (what this datapath adds).
    pub mean_added_us: Option<Stat>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub description: String,
    pub reps: u32,
    pub time_s: f64,
    pub ramp_s: f64,
    pub baselines: Vec<DatapathKind>,
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
        m.entry((r.datapath.clone(), r.backend, r.point))
            .or_default()
            .push(r);
    }
    m
}

/// Per repetition: `op(this cell's value, the baseline's)`, where both ran.
fn per_rep(
    mine: &[&RunRecord],
    base: &[&RunRecord],
    f: impl Fn(&RunRecord) -> Option<f64>,
    op: impl Fn(f64, f64) -> f64,
) -> Option<Stat> {
    let v: Vec<f64> = mine
        .iter()
        .filter_map(|r| {
            let b = base.iter().find(|b| b.rep == r.rep)?;
            Some(op(f(r)?, f(b)?))
        })
        .collect();
    Stat::of(&v)
}

fn versus(
    m: &Matrix,
    all: &BTreeMap<Key, Vec<&RunRecord>>,
    key: &Key,
    ok: &[&RunRecord],
) -> Vec<Versus> {
    let (d, b, p) = key;
    let mut out = Vec::new();
    for bl in m.baselines.iter().filter(|bl| *bl != d) {
        let Some(base) = all.get(&(bl.clone(), *b, *p)) else {
            continue;
        };
        let base: Vec<&RunRecord> = base.iter().copied().filter(|r| r.error.is_none()).collect();
        let mean = |r: &RunRecord| r.lat_us("mean");
        out.push(Versus {
            baseline: bl.clone(),
            iops_ratio: per_rep(ok, &base, RunRecord::iops, |a, b| a / b),
            mean_ratio: per_rep(ok, &base, mean, |a, b| a / b),
            mean_added_us: per_rep(ok, &base, mean, |a, b| a - b),
        });
    }
    out
}

pub fn summarize(
    m: &Matrix,
    runs: &[RunRecord],
    skipped: Vec<Skipped>,
    host: BTreeMap<String, String>,
) -> Summary {
    let cells_in = by_cell(runs);
    let mut order = Vec::new();
    for r in runs {
        let s = format!("{} {} {}", r.rep, r.datapath, r.backend);
        if order.last() != Some(&s) {
            order.push(s);
        }
    }
    let mut cells = Vec::new();
    for (key, rs) in &cells_in {
        let ok: Vec<&RunRecord> = rs.iter().copied().filter(|r| r.error.is_none()).collect();
        let col = |f: &dyn Fn(&RunRecord) -> Option<f64>| -> Vec<f64> {
            ok.iter().filter_map(|r| f(r)).collect()
        };
        cells.push(Cell {
            datapath: key.0.clone(),
            backend: key.1,
            point: key.2,
            n: ok.len(),
            failed: rs.len() - ok.len(),
            iops: Stat::of(&col(&RunRecord::iops)),
            mean_us: Stat::of(&col(&|r| r.lat_us("mean"))),
            p50_us: Stat::of(&col(&|r| r.lat_us("p50"))),
            p99_us: Stat::of(&col(&|r| r.lat_us("p99"))),
            vs: versus(m, &cells_in, key, &ok),
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
        baselines: m.baselines.clone(),
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
    let think = match p.think_us {
        0 => String::new(),
        t => format!(" think {t} µs"),
    };
    format!("{rw} {} QD{} ×{}{think}", bs_name(p.bs), p.qd, p.jobs)
}

/// Decimals for a number of thousands: low rates (a think time) keep their digits.
fn kilo_digits(s: Option<Stat>) -> usize {
    match s.map_or(0.0, |s| s.median) {
        m if m < 10e3 => 2,
        m if m < 100e3 => 1,
        _ => 0,
    }
}

fn opt(s: Option<Stat>, scale: f64, nd: usize) -> String {
    s.map_or("—".into(), |s| s.fmt(scale, nd))
}

/// summary.md: per backend, a table of the cells and one per baseline.
pub fn markdown(s: &Summary) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# udrive bench\n\n{}\n", s.description);
    let _ = writeln!(
        o,
        "{} repetitions × {} s (warm-up {} s), server CPUs {}, client CPUs {}; median (min–max); \
         comparisons with a baseline taken per repetition.\n",
        s.reps, s.time_s, s.ramp_s, s.cpus.server, s.cpus.client
    );
    let mut backends: Vec<Backend> = s.cells.iter().map(|c| c.backend).collect();
    backends.dedup();
    for b in backends {
        let cells: Vec<&Cell> = s.cells.iter().filter(|c| c.backend == b).collect();
        let _ = writeln!(o, "## {b}\n");
        let _ = writeln!(
            o,
            "| workload | datapath | n | IOPS (k) | mean (µs) | p50 (µs) | p99 (µs) |"
        );
        let _ = writeln!(o, "|---|---|---|---|---|---|---|");
        for c in &cells {
            let failed = if c.failed > 0 {
                format!(" ({} failed)", c.failed)
            } else {
                String::new()
            };
            let _ = writeln!(
                o,
                "| {} | {} | {}{failed} | {} | {} | {} | {} |",
                point_label(&c.point),
                c.datapath,
                c.n,
                opt(c.iops, 1e-3, kilo_digits(c.iops)),
                opt(c.mean_us, 1.0, 2),
                opt(c.p50_us, 1.0, 2),
                opt(c.p99_us, 1.0, 2),
            );
        }
        o.push('\n');
        for bl in &s.baselines {
            versus_table(&mut o, b, bl, &cells);
        }
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

/// The cells of one backend against one baseline, if any was compared.
fn versus_table(o: &mut String, b: Backend, bl: &DatapathKind, cells: &[&Cell]) {
    let rows: Vec<(&Cell, &Versus)> = cells
        .iter()
        .filter_map(|c| Some((*c, c.vs.iter().find(|v| v.baseline == *bl)?)))
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(o, "### {b}: against {bl}\n");
    let _ = writeln!(
        o,
        "| workload | datapath | IOPS ÷ {bl} | mean ÷ {bl} | mean − {bl} (µs) |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|");
    for (c, v) in rows {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} |",
            point_label(&c.point),
            c.datapath,
            opt(v.iops_ratio, 1.0, 2),
            opt(v.mean_ratio, 1.0, 2),
            opt(v.mean_added_us, 1.0, 2)
        );
    }
    o.push('\n');
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
