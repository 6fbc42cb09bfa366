//! Where a traced run's time goes: each cell's mean time per layer over its runs
//! (`trace = true` in the matrix; `perf --trace`, with the server's layers when
//! udrive serves), and their table in summary.md.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::matrix::Backend;
use super::run::RunRecord;
use super::summary::{cell_label, Cell, Stat};

/// The layers in request order: the client's submit, the server's four (or, with
/// no server's table, the client's `device`), the derived transport, the client's
/// reap. A layer not named here goes last.
pub const ORDER: [&str; 8] = [
    "submit",
    "queue",
    "backend",
    "complete",
    "notify",
    "transport",
    "device",
    "reap",
];

/// One layer's mean time over a cell's traced runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerStat {
    /// The op the runs traced most (`read`, `write`).
    pub op: String,
    pub layer: String,
    /// Who measured it: the client, the server, or derived (`transport`: what
    /// the client waited minus what the server measured; may be negative).
    pub side: trace::Side,
    pub mean_us: Stat,
}

/// The layers of a cell's runs: those of the op most runs traced most, each layer
/// where it first appears, its mean per run in µs.
pub fn stats(runs: &[&RunRecord]) -> Vec<LayerStat> {
    let tables: Vec<trace::OpBreakdown> = runs.iter().filter_map(|r| r.layers()).collect();
    let mut ops: Vec<(&str, usize)> = Vec::new();
    for t in &tables {
        match ops.iter_mut().find(|(o, _)| *o == t.op) {
            Some((_, n)) => *n += 1,
            None => ops.push((&t.op, 1)),
        }
    }
    let Some((op, _)) = ops.iter().max_by_key(|(_, n)| *n) else {
        return Vec::new();
    };
    let same: Vec<&trace::OpBreakdown> = tables.iter().filter(|t| t.op == *op).collect();
    let mut out: Vec<LayerStat> = Vec::new();
    for row in same.iter().flat_map(|t| t.rows.iter()) {
        if out.iter().any(|l| l.layer == row.layer) {
            continue;
        }
        let v: Vec<f64> = same
            .iter()
            .filter_map(|t| Some(t.row(&row.layer)?.mean_ns / 1e3))
            .collect();
        if let Some(mean_us) = Stat::of(&v) {
            out.push(LayerStat {
                op: op.to_string(),
                layer: row.layer.clone(),
                side: row.side,
                mean_us,
            });
        }
    }
    out
}

/// Every layer the cells have (but the total), in request order.
pub fn names(cells: &[&Cell]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for l in cells.iter().flat_map(|c| c.layers.iter()) {
        if l.layer != trace::TOTAL && !v.contains(&l.layer) {
            v.push(l.layer.clone());
        }
    }
    let rank = |n: &String| ORDER.iter().position(|o| o == n).unwrap_or(ORDER.len());
    v.sort_by_key(rank);
    v
}

/// summary.md's table of the cells' layers, if any cell was traced.
pub fn table(o: &mut String, b: Backend, cells: &[&Cell]) {
    let traced: Vec<&Cell> = cells
        .iter()
        .copied()
        .filter(|c| !c.layers.is_empty())
        .collect();
    if traced.is_empty() {
        return;
    }
    let names = names(&traced);
    let _ = writeln!(
        o,
        "### {b}: time per layer (mean µs, median over the runs)\n"
    );
    let _ = writeln!(
        o,
        "| workload | datapath | op | {} | total |",
        names.join(" | ")
    );
    let _ = writeln!(o, "|---|---|---|{}---|", "---|".repeat(names.len()));
    for c in traced {
        let cell = |n: &str| {
            c.layers
                .iter()
                .find(|l| l.layer == n)
                .map_or("—".to_string(), |l| format!("{:.2}", l.mean_us.median))
        };
        let row: Vec<String> = names.iter().map(|n| cell(n)).collect();
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} |",
            cell_label(c),
            c.datapath,
            c.layers[0].op,
            row.join(" | "),
            cell(trace::TOTAL)
        );
    }
    o.push('\n');
}
