//! From raw runs to cells: median and min–max per (datapath, backend, client count,
//! workload), and
//! the comparison with each baseline datapath taken per repetition (the two ran
//! minutes apart at most, on the machine in the same state) before their median;
//! a cell on an encrypted backend is compared the same way with its datapath's cell
//! on the clear one (`ram-luks` with `ram`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::matrix::{bs_name, Backend, DatapathKind, Matrix, Point};
use super::run::{RunRecord, Skipped};

pub use super::stat::Stat;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    pub datapath: DatapathKind,
    pub backend: Backend,
    /// Concurrent clients; IOPS are theirs together, latencies over all their I/Os
    /// (mean) or the worst client's (percentiles).
    pub clients: u32,
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
    /// The rest of the latency percentile curve (µs): fastest I/O, p99.9, p99.99,
    /// slowest.
    #[serde(default)]
    pub min_us: Option<Stat>,
    #[serde(default)]
    pub p99_9_us: Option<Stat>,
    #[serde(default)]
    pub p99_99_us: Option<Stat>,
    #[serde(default)]
    pub max_us: Option<Stat>,
    /// Mean time per layer of traced runs (`trace = true`), in request order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<super::layers::LayerStat>,
    /// The IOPS of the slowest and of the fastest client of a run.
    pub client_iops_min: Option<Stat>,
    pub client_iops_max: Option<Stat>,
    /// Slowest ÷ fastest client of a run (1: every client got the same).
    pub fairness: Option<Stat>,
    /// Cores the server's processes kept busy over a run.
    pub server_cores: Option<Stat>,
    /// The server processes' threads at the end of a run.
    #[serde(default)]
    pub server_threads: Option<Stat>,
    /// Server CPU per I/O, µs: what one more client costs the host shows here.
    pub server_us_per_io: Option<Stat>,
    /// CPU per I/O by role and thread (the matrix's `cpu = "roles"`/`"threads"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<super::cpu_table::CpuCell>,
    /// Live handovers during the runs (a variant's `handovers`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handovers: Option<super::handovers::Handovers>,
    /// Against each baseline that ran this backend and workload (not itself), then
    /// against this datapath on the clear backend of an encrypted one.
    pub vs: Vec<Versus>,
    /// Why the numbers do not measure the datapath (a guest under TCG), from the
    /// runs' `not_meaningful`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_meaningful: Option<String>,
}

/// One cell against one baseline, per repetition.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Versus {
    pub baseline: DatapathKind,
    /// The baseline's backend where it is not the cell's (the clear one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<Backend>,
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

type Key = (DatapathKind, Backend, u32, Point);

fn by_cell(runs: &[RunRecord]) -> BTreeMap<Key, Vec<&RunRecord>> {
    let mut m: BTreeMap<Key, Vec<&RunRecord>> = BTreeMap::new();
    for r in runs {
        m.entry((r.datapath.clone(), r.backend, r.clients, r.point))
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
    let (d, b, n, p) = key;
    let others = m.baselines.iter().filter(|bl| *bl != d);
    let mut against: Vec<(DatapathKind, Option<Backend>)> =
        others.map(|bl| (bl.clone(), None)).collect();
    if let Some(clear) = b.clear() {
        against.push((d.clone(), Some(clear)));
    }
    let mut out = Vec::new();
    for (bl, on) in against {
        let Some(base) = all.get(&(bl.clone(), on.unwrap_or(*b), *n, *p)) else {
            continue;
        };
        let base: Vec<&RunRecord> = base.iter().copied().filter(|r| r.error.is_none()).collect();
        let mean = |r: &RunRecord| r.lat_us("mean");
        out.push(Versus {
            baseline: bl,
            backend: on,
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
        let c = match r.clients {
            1 => String::new(),
            n => format!(" ×{n}"),
        };
        let s = format!("{} {} {}{c}", r.rep, r.datapath, r.backend);
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
        let range = |r: &RunRecord| r.client_iops_range();
        cells.push(Cell {
            datapath: key.0.clone(),
            backend: key.1,
            clients: key.2,
            point: key.3,
            n: ok.len(),
            failed: rs.len() - ok.len(),
            iops: Stat::of(&col(&RunRecord::iops)),
            mean_us: Stat::of(&col(&|r| r.lat_us("mean"))),
            p50_us: Stat::of(&col(&|r| r.lat_us("p50"))),
            p99_us: Stat::of(&col(&|r| r.lat_us("p99"))),
            min_us: Stat::of(&col(&|r| r.lat_us("min"))),
            p99_9_us: Stat::of(&col(&|r| r.lat_us("p99_9"))),
            p99_99_us: Stat::of(&col(&|r| r.lat_us("p99_99"))),
            max_us: Stat::of(&col(&|r| r.lat_us("max"))),
            layers: super::layers::stats(&ok),
            client_iops_min: Stat::of(&col(&|r| Some(range(r)?.0))),
            client_iops_max: Stat::of(&col(&|r| Some(range(r)?.1))),
            fairness: Stat::of(&col(&|r| {
                let (lo, hi) = range(r)?;
                (hi > 0.0).then(|| lo / hi)
            })),
            server_cores: Stat::of(&col(&|r| r.server_cpu?.cores())),
            server_threads: Stat::of(&col(&|r| Some(f64::from(r.server_cpu?.threads?)))),
            server_us_per_io: Stat::of(&col(&RunRecord::server_us_per_io)),
            cpu: super::cpu_table::stats(&ok),
            handovers: super::handovers::of(&ok),
            vs: versus(m, &cells_in, key, &ok),
            not_meaningful: ok
                .iter()
                .find_map(|r| Some(r.perf.get("not_meaningful")?.as_str()?.to_string())),
        });
    }
    // The matrix's order, not the map's: datapaths as listed, workloads as listed.
    let points = m.points();
    let pos = |c: &Cell| {
        (
            m.backends.iter().position(|b| *b == c.backend),
            points.iter().position(|p| *p == c.point),
            m.clients.iter().position(|n| *n == c.clients),
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
        t if t >= 1_000_000 => format!(" think {} s", f64::from(t) / 1e6),
        t => format!(" think {t} µs"),
    };
    format!("{rw} {} QD{} ×{}{think}", bs_name(p.bs), p.qd, p.jobs)
}

/// A cell's workload with its client count when it has several:
/// `randread 4k QD1 ×1, 4 clients`.
pub fn cell_label(c: &Cell) -> String {
    match c.clients {
        1 => point_label(&c.point),
        n => format!("{}, {n} clients", point_label(&c.point)),
    }
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
            "| workload | datapath | n | IOPS (k) | mean (µs) | p50 (µs) | p99 (µs) | server CPU (% of a core) | threads |"
        );
        let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|");
        for c in &cells {
            let failed = if c.failed > 0 {
                format!(" ({} failed)", c.failed)
            } else {
                String::new()
            };
            let mark = if c.not_meaningful.is_some() {
                " †"
            } else {
                ""
            };
            let _ = writeln!(
                o,
                "| {} | {}{mark} | {}{failed} | {} | {} | {} | {} | {} | {} |",
                cell_label(c),
                c.datapath,
                c.n,
                opt(c.iops, 1e-3, kilo_digits(c.iops)),
                opt(c.mean_us, 1.0, 2),
                opt(c.p50_us, 1.0, 2),
                opt(c.p99_us, 1.0, 2),
                opt(c.server_cores, 100.0, 2),
                opt(c.server_threads, 1.0, 0),
            );
        }
        o.push('\n');
        not_meaningful_notes(&mut o, &cells);
        many_clients_table(&mut o, b, &cells);
        super::layers::table(&mut o, b, &cells);
        let cpu_rows: Vec<super::cpu_table::Row> = cells
            .iter()
            .filter_map(|c| {
                Some(super::cpu_table::Row {
                    workload: cell_label(c),
                    datapath: c.datapath.to_string(),
                    cpu: c.cpu.as_ref()?,
                })
            })
            .collect();
        super::cpu_table::tables(&mut o, b, &cpu_rows);
        handovers_table(&mut o, b, &cells);
        for bl in &s.baselines {
            versus_table(&mut o, b, bl, &cells);
        }
        clear_table(&mut o, b, &cells);
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

/// Under a table, why its † rows measure nothing (once per datapath and reason).
fn not_meaningful_notes(o: &mut String, cells: &[&Cell]) {
    let mut seen: Vec<(&DatapathKind, &str)> = Vec::new();
    for c in cells {
        if let Some(why) = &c.not_meaningful {
            if !seen.contains(&(&c.datapath, why.as_str())) {
                seen.push((&c.datapath, why));
            }
        }
    }
    for (d, why) in &seen {
        let _ = writeln!(o, "† {d}: not meaningful: {why}.");
    }
    if !seen.is_empty() {
        o.push('\n');
    }
}

/// The cells of one backend against one baseline, if any was compared.
fn versus_table(o: &mut String, b: Backend, bl: &DatapathKind, cells: &[&Cell]) {
    let rows: Vec<(&Cell, &Versus)> = cells
        .iter()
        .filter_map(|c| {
            let v =
                c.vs.iter()
                    .find(|v| v.baseline == *bl && v.backend.is_none())?;
            Some((*c, v))
        })
        .collect();
    ratio_table(o, &format!("{b}: against {bl}"), &bl.to_string(), &rows);
}

/// The cells of an encrypted backend against the same datapath on the clear one.
fn clear_table(o: &mut String, b: Backend, cells: &[&Cell]) {
    let Some(clear) = b.clear() else {
        return;
    };
    let rows: Vec<(&Cell, &Versus)> = cells
        .iter()
        .filter_map(|c| Some((*c, c.vs.iter().find(|v| v.backend == Some(clear))?)))
        .collect();
    let heading = format!("{b}: against {clear}, same datapath");
    ratio_table(o, &heading, &clear.to_string(), &rows);
}

/// A table of ratios against `base`, if there is any row.
fn ratio_table(o: &mut String, heading: &str, base: &str, rows: &[(&Cell, &Versus)]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(o, "### {heading}\n");
    let _ = writeln!(
        o,
        "| workload | datapath | IOPS ÷ {base} | mean ÷ {base} | mean − {base} (µs) |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|");
    for (c, v) in rows {
        let mark = if c.not_meaningful.is_some() {
            " †"
        } else {
            ""
        };
        let _ = writeln!(
            o,
            "| {} | {}{mark} | {} | {} | {} |",
            cell_label(c),
            c.datapath,
            opt(v.iops_ratio, 1.0, 2),
            opt(v.mean_ratio, 1.0, 2),
            opt(v.mean_added_us, 1.0, 2)
        );
    }
    o.push('\n');
}

/// The cells of one backend side by side over their client counts, if any cell has
/// more than one client: what sharing one server costs.
fn many_clients_table(o: &mut String, b: Backend, cells: &[&Cell]) {
    if cells.iter().all(|c| c.clients == 1) {
        return;
    }
    let _ = writeln!(
        o,
        "### {b}: many clients on one server
"
    );
    let _ = writeln!(
        o,
        "| workload | datapath | clients | IOPS (k), all | per client (k), slowest | fastest | slowest ÷ fastest | mean (µs) | p99 (µs), worst client | server cores | server CPU µs/I/O | threads |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows: Vec<&&Cell> = cells.iter().collect();
    // Per workload and datapath, the client counts in a row.
    rows.sort_by_key(|c| {
        let p = cells.iter().position(|x| x.point == c.point);
        let d = cells.iter().position(|x| x.datapath == c.datapath);
        (p, d, c.clients)
    });
    for c in rows {
        let k = |s: Option<Stat>| opt(s, 1e-3, kilo_digits(s));
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            point_label(&c.point),
            c.datapath,
            c.clients,
            k(c.iops),
            k(c.client_iops_min),
            k(c.client_iops_max),
            opt(c.fairness, 1.0, 2),
            opt(c.mean_us, 1.0, 2),
            opt(c.p99_us, 1.0, 2),
            opt(c.server_cores, 1.0, 2),
            opt(c.server_us_per_io, 1.0, 2),
            opt(c.server_threads, 1.0, 0),
        );
    }
    o.push('\n');
}

/// The cells of one backend with live handovers, if any.
fn handovers_table(o: &mut String, b: Backend, cells: &[&Cell]) {
    let rows: Vec<(&Cell, &super::handovers::Handovers)> = cells
        .iter()
        .filter_map(|c| Some((*c, c.handovers.as_ref()?)))
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(o, "### {b}: live handovers\n");
    let _ = writeln!(
        o,
        "| workload | datapath | handovers per run | pause, median (ms) | longest pause (ms) | `udrive upgrade` (ms) | I/O + verify errors |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|");
    for (c, h) in rows {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} |",
            cell_label(c),
            c.datapath,
            h.per_run,
            opt(h.pause_ms, 1.0, 2),
            opt(h.pause_max_ms, 1.0, 2),
            opt(h.upgrade_ms, 1.0, 2),
            h.errors
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
