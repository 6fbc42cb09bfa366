//! Per backend and kind of workload (rw, block size, think time), at its fewest jobs
//! and its lowest and highest QD: each datapath's latency percentile curve, and,
//! where the runs were traced, its mean time per layer. Two QDs, not every one, so
//! a thesis-sized matrix gets two figures per kind instead of one per cell.

use super::svg_log_lines::{log_lines, Line};
use super::svg_stacked::{stacked, StackRow};
use super::{kind_slug, Figure};
use crate::bench::layers;
use crate::bench::matrix::{Backend, DatapathKind};
use crate::bench::summary::{point_label, Cell, Stat};

/// The cells of one kind of workload that the figures show.
struct Group<'a> {
    /// `randread-4k-j1`: unique within a backend.
    slug: String,
    /// `randread 4k ×1`.
    label: String,
    qds: Vec<u32>,
    cells: Vec<&'a Cell>,
}

fn groups<'a>(cells: &[&'a Cell]) -> Vec<Group<'a>> {
    let mut kinds: Vec<String> = Vec::new();
    for c in cells {
        let k = kind_slug(&c.point);
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    }
    kinds
        .into_iter()
        .filter_map(|k| {
            let same: Vec<&Cell> = cells
                .iter()
                .copied()
                .filter(|c| kind_slug(&c.point) == k)
                .collect();
            let jobs = same.iter().map(|c| c.point.jobs).min()?;
            let mut qds: Vec<u32> = same
                .iter()
                .filter(|c| c.point.jobs == jobs)
                .map(|c| c.point.qd)
                .collect();
            qds.sort_unstable();
            qds.dedup();
            let qds: Vec<u32> = match (qds.first(), qds.last()) {
                (Some(a), Some(b)) if a != b => vec![*a, *b],
                (Some(a), _) => vec![*a],
                _ => return None,
            };
            let chosen: Vec<&Cell> = same
                .into_iter()
                .filter(|c| c.point.jobs == jobs && qds.contains(&c.point.qd))
                .collect();
            let p = chosen.first()?.point;
            Some(Group {
                slug: format!("{k}-j{jobs}"),
                label: point_label(&p).replace(&format!(" QD{}", p.qd), ""),
                qds,
                cells: chosen,
            })
        })
        .collect()
}

/// The id of the percentile figure (`what` = `pct`, `slug` = `randread-4k-j1`) or
/// a layer figure (`layers`, `randread-4k-j1-qd32`) of backend `b`.
pub fn figure_id(what: &str, b: Backend, slug: &str) -> String {
    format!("{what}-{b}-{slug}")
}

fn datapaths(cells: &[&Cell]) -> Vec<DatapathKind> {
    let mut v: Vec<DatapathKind> = Vec::new();
    for c in cells {
        if !v.contains(&c.datapath) {
            v.push(c.datapath.clone());
        }
    }
    v
}

const PERCENTILES: [&str; 6] = ["min", "p50", "p99", "p99.9", "p99.99", "max"];

fn percentiles(c: &Cell) -> Vec<Option<f64>> {
    [
        c.min_us,
        c.p50_us,
        c.p99_us,
        c.p99_9_us,
        c.p99_99_us,
        c.max_us,
    ]
    .iter()
    .map(|s: &Option<Stat>| s.map(|s| s.median))
    .collect()
}

pub fn figures(b: Backend, cells: &[&Cell]) -> Vec<Figure> {
    let mut out = Vec::new();
    for g in groups(cells) {
        let paths = datapaths(&g.cells);
        let qd_note = match g.qds[..] {
            [lo, hi] => format!("QD{lo} solid, QD{hi} dashed"),
            _ => format!("QD{}", g.qds[0]),
        };
        let mut lines = Vec::new();
        for (di, d) in paths.iter().enumerate() {
            for (qi, q) in g.qds.iter().enumerate() {
                if let Some(c) = g
                    .cells
                    .iter()
                    .find(|c| c.datapath == *d && c.point.qd == *q)
                {
                    lines.push(Line {
                        name: format!("{d} QD{q}"),
                        colour: di,
                        dashed: qi == 1,
                        points: percentiles(c),
                    });
                }
            }
        }
        let id = figure_id("pct", b, &g.slug);
        let title = format!("{b}, {}: latency percentiles", g.label);
        out.push(Figure {
            svg: log_lines(&id, &title, &PERCENTILES, "µs", &lines),
            caption: format!(
                "{title} ({qd_note}), each the median over the repetitions; the worst client's \
                 with several clients"
            ),
            id,
        });
        let traced: Vec<&Cell> = g
            .cells
            .iter()
            .copied()
            .filter(|c| !c.layers.is_empty())
            .collect();
        if traced.is_empty() {
            continue;
        }
        // One figure per QD: a deep queue's waits would flatten QD1's layers.
        let legend = layers::names(&traced);
        for q in &g.qds {
            let rows: Vec<StackRow> = paths
                .iter()
                .filter_map(|d| {
                    let c = traced
                        .iter()
                        .find(|c| c.datapath == *d && c.point.qd == *q)?;
                    let mean = |n: &str| {
                        c.layers
                            .iter()
                            .find(|l| l.layer == n)
                            .map(|l| l.mean_us.median)
                    };
                    Some(StackRow {
                        label: format!("{d} ({})", c.layers[0].op),
                        parts: legend.iter().map(|n| mean(n)).collect(),
                        total: mean(trace::TOTAL),
                    })
                })
                .collect();
            if rows.is_empty() {
                continue;
            }
            let id = figure_id("layers", b, &format!("{}-qd{q}", g.slug));
            let title = format!("{b}, {} QD{q}: time per layer", g.label);
            out.push(Figure {
                svg: stacked(&id, &title, "mean µs per I/O", &legend, &rows),
                caption: format!(
                    "{title}: mean µs per I/O in each layer, median over the traced runs, \
                     the total after each bar. udrive's datapaths show the server's layers \
                     between the client's submit and reap, and transport (what the client \
                     waited beyond the server's time: doorbells, polling, the kernel); a \
                     datapath without udrive's server shows its whole time there as device"
                ),
                id,
            });
        }
    }
    out
}
