//! report.html: the summary's figures inline as SVG and its tables, in one file with
//! no external script or style. Each figure is also written on its own to
//! `figures/ID.svg` (for slides, or rsvg-convert to PNG).
//!
//! Figures: per backend, IOPS and mean latency as bars per workload (one bar per
//! datapath, whiskers from min to max over the repetitions); and where the matrix
//! has several QDs and several job counts for one rw/bs, a heatmap of median IOPS over
//! QD × jobs per datapath and backend; these show the cells of the fewest clients.
//! Where the matrix has several client counts, per backend and workload, "many
//! clients on one server": the clients' IOPS together and the server's CPU per I/O
//! as bars over the client count, one bar per datapath. Per backend and kind of
//! workload, latency percentile curves and, from traced runs, the time per layer
//! (`latency`).

pub mod latency;
pub mod svg;
pub mod svg_log_lines;
pub mod svg_stacked;

use std::fmt::Write as _;

use super::matrix::{bs_name, Backend, Point};
use super::summary::{point_label, Cell, Stat, Summary};
use svg::{Bar, Series};

pub struct Figure {
    pub id: String,
    pub caption: String,
    pub svg: String,
}

fn bar(s: Option<Stat>) -> Option<Bar> {
    s.map(|s| Bar {
        median: s.median,
        min: s.min,
        max: s.max,
    })
}

/// Every figure of a summary, in the report's order.
pub fn figures(s: &Summary) -> Vec<Figure> {
    let mut out = Vec::new();
    let mut backends: Vec<Backend> = s.cells.iter().map(|c| c.backend).collect();
    backends.dedup();
    for b in backends {
        let cells: Vec<&Cell> = s.cells.iter().filter(|c| c.backend == b).collect();
        let fewest = cells.iter().map(|c| c.clients).min().unwrap_or(1);
        let single: Vec<&Cell> = cells
            .iter()
            .copied()
            .filter(|c| c.clients == fewest)
            .collect();
        out.extend(bar_figures(b, &single));
        out.extend(heatmaps(b, &single));
        out.extend(latency::figures(b, &single));
        out.extend(many_clients(b, &cells));
    }
    out
}

/// The id of a "many clients" figure of `what` (`iops`, `cpu`).
pub fn many_clients_id(b: Backend, p: &Point, what: &str) -> String {
    format!("many-{b}-{}-{what}", p.slug())
}

/// Per workload with several client counts: IOPS of all clients together, and the
/// server's CPU per I/O where a server was measured, over the client count.
fn many_clients(b: Backend, cells: &[&Cell]) -> Vec<Figure> {
    let mut out = Vec::new();
    let mut points: Vec<Point> = Vec::new();
    for c in cells {
        if !points.contains(&c.point) {
            points.push(c.point);
        }
    }
    for p in points {
        let here: Vec<&Cell> = cells.iter().copied().filter(|c| c.point == p).collect();
        let mut counts: Vec<u32> = here.iter().map(|c| c.clients).collect();
        counts.sort_unstable();
        counts.dedup();
        if counts.len() < 2 {
            continue;
        }
        let mut paths = Vec::new();
        for c in &here {
            if !paths.contains(&c.datapath) {
                paths.push(c.datapath.clone());
            }
        }
        let labels: Vec<String> = counts
            .iter()
            .map(|n| match n {
                1 => "1 client".to_string(),
                n => format!("{n} clients"),
            })
            .collect();
        // A datapath without any value keeps its place (and colour), named as such.
        let series = |f: &dyn Fn(&Cell) -> Option<Stat>, none: &str| -> Vec<Series> {
            paths
                .iter()
                .map(|d| Series {
                    name: match here.iter().any(|c| c.datapath == *d && f(c).is_some()) {
                        true => d.to_string(),
                        false => format!("{d} ({none})"),
                    },
                    bars: counts
                        .iter()
                        .map(|n| {
                            here.iter()
                                .find(|c| c.datapath == *d && c.clients == *n)
                                .and_then(|c| bar(f(c)))
                        })
                        .collect(),
                })
                .collect()
        };
        let what = point_label(&p);
        let id = many_clients_id(b, &p, "iops");
        let title = format!("{b}, {what}: IOPS of N clients together");
        out.push(Figure {
            svg: svg::bars(&id, &title, "IOPS", &labels, &series(&|c| c.iops, "failed")),
            caption: format!(
                "{b}, {what}: the IOPS of N concurrent clients together, each with its own device \
                 (udrive: one server; qemu-storage-daemon: one process per client; io-uring: \
                 no server), median with min–max over the repetitions"
            ),
            id,
        });
        if here.iter().any(|c| c.server_us_per_io.is_some()) {
            let id = many_clients_id(b, &p, "cpu");
            let title = format!("{b}, {what}: server CPU per I/O");
            out.push(Figure {
                svg: svg::bars(
                    &id,
                    &title,
                    "µs",
                    &labels,
                    &series(&|c| c.server_us_per_io, "no server"),
                ),
                caption: format!(
                    "{b}, {what}: CPU time of the server's processes per I/O (µs), over the \
                     client count; busy polling spends its cores whatever the load"
                ),
                id,
            });
        }
    }
    out
}

fn bar_figures(b: Backend, cells: &[&Cell]) -> Vec<Figure> {
    let mut points: Vec<Point> = Vec::new();
    let mut paths = Vec::new();
    for c in cells {
        if !points.contains(&c.point) {
            points.push(c.point);
        }
        if !paths.contains(&c.datapath) {
            paths.push(c.datapath.clone());
        }
    }
    let labels: Vec<String> = points.iter().map(point_label).collect();
    let series = |f: &dyn Fn(&Cell) -> Option<Stat>| -> Vec<Series> {
        paths
            .iter()
            .map(|d| Series {
                name: d.to_string(),
                bars: points
                    .iter()
                    .map(|p| {
                        cells
                            .iter()
                            .find(|c| c.datapath == *d && c.point == *p)
                            .and_then(|c| bar(f(c)))
                    })
                    .collect(),
            })
            .collect()
    };
    let iops_id = format!("bars-{b}-iops");
    let lat_id = format!("bars-{b}-lat");
    vec![
        Figure {
            svg: svg::bars(
                &iops_id,
                &format!("{b}: IOPS"),
                "IOPS",
                &labels,
                &series(&|c| c.iops),
            ),
            caption: format!("{b}: IOPS per workload, median with min–max over the repetitions"),
            id: iops_id,
        },
        Figure {
            svg: svg::bars(
                &lat_id,
                &format!("{b}: mean latency"),
                "µs",
                &labels,
                &series(&|c| c.mean_us),
            ),
            caption: format!("{b}: mean latency (µs) per workload, median with min–max"),
            id: lat_id,
        },
    ]
}

/// A kind of workload, all but its QD and jobs: `randrw70-4k-think2000`.
pub fn kind_slug(p: &Point) -> String {
    let mix = if p.rw == super::matrix::Rw::Randrw {
        p.rwmixread.to_string()
    } else {
        String::new()
    };
    let think = match p.think_us {
        0 => String::new(),
        t => format!("-think{t}"),
    };
    format!("{}{mix}-{}{think}", p.rw, bs_name(p.bs))
}

/// The id of a heatmap figure (also the test's way to name what it expects).
pub fn heatmap_id(d: &str, b: Backend, p: &Point) -> String {
    format!("heat-{d}-{b}-{}", kind_slug(p))
}

fn heatmaps(b: Backend, cells: &[&Cell]) -> Vec<Figure> {
    let mut out: Vec<Figure> = Vec::new();
    for c in cells {
        let id = heatmap_id(&c.datapath.to_string(), b, &c.point);
        if out.iter().any(|f| f.id == id) {
            continue;
        }
        let same: Vec<&&Cell> = cells
            .iter()
            .filter(|x| {
                x.datapath == c.datapath && heatmap_id(&x.datapath.to_string(), b, &x.point) == id
            })
            .collect();
        let mut qds: Vec<u32> = same.iter().map(|x| x.point.qd).collect();
        let mut jobs: Vec<u32> = same.iter().map(|x| x.point.jobs).collect();
        qds.sort_unstable();
        qds.dedup();
        jobs.sort_unstable();
        jobs.dedup();
        if qds.len() < 2 || jobs.len() < 2 {
            continue;
        }
        let v: Vec<Vec<Option<f64>>> = jobs
            .iter()
            .map(|&j| {
                qds.iter()
                    .map(|&q| {
                        same.iter()
                            .find(|x| x.point.qd == q && x.point.jobs == j)
                            .and_then(|x| x.iops.map(|s| s.median))
                    })
                    .collect()
            })
            .collect();
        let ql: Vec<String> = qds.iter().map(|q| q.to_string()).collect();
        let jl: Vec<String> = jobs.iter().map(|j| j.to_string()).collect();
        let label = point_label(&c.point);
        let what = label.split(" QD").next().unwrap_or(&label);
        let title = format!("{} on {b}, {what}: median IOPS", c.datapath);
        out.push(Figure {
            svg: svg::heatmap(&id, &title, ("QD per job", &ql), ("jobs", &jl), &v),
            caption: title,
            id,
        });
    }
    out
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}\
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}\
td:first-child,td:nth-child(2){text-align:left}figure{margin:1.5em 0}figcaption{font-size:13px;color:#444}";

/// The subset of Markdown that summary.md uses (headings, tables, list items,
/// paragraphs) as HTML, so the report shows the same tables as the file.
fn md_html(md: &str) -> String {
    let mut o = String::new();
    let mut in_table = false;
    for line in md.lines() {
        let t = line.trim();
        if in_table && !t.starts_with('|') {
            o.push_str("</table>");
            in_table = false;
        }
        if let Some(row) = t.strip_prefix('|') {
            if row.starts_with("---") {
                continue;
            }
            let tag = if in_table { "td" } else { "th" };
            if !in_table {
                o.push_str("<table>");
                in_table = true;
            }
            o.push_str("<tr>");
            for c in row.trim_end_matches('|').split('|') {
                let _ = write!(o, "<{tag}>{}</{tag}>", svg::esc(c.trim()));
            }
            o.push_str("</tr>");
        } else if let Some(h) = t.strip_prefix("### ") {
            let _ = write!(o, "<h4>{}</h4>", svg::esc(h));
        } else if let Some(h) = t.strip_prefix("## ") {
            let _ = write!(o, "<h3>{}</h3>", svg::esc(h));
        } else if let Some(h) = t.strip_prefix("# ") {
            let _ = write!(o, "<h2>{}</h2>", svg::esc(h));
        } else if let Some(li) = t.strip_prefix("- ") {
            let _ = write!(o, "<p>• {}</p>", svg::esc(li));
        } else if !t.is_empty() {
            let _ = write!(o, "<p>{}</p>", svg::esc(t));
        }
    }
    if in_table {
        o.push_str("</table>");
    }
    o
}

/// The whole report.html.
pub fn html(s: &Summary, figs: &[Figure], summary_md: &str) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>udrive bench</title><style>{STYLE}</style></head><body>"
    );
    let _ = write!(
        o,
        "<h1>udrive bench</h1><p>{}</p>",
        svg::esc(&s.description)
    );
    for f in figs {
        let _ = write!(
            o,
            "<figure>{}<figcaption>{}</figcaption></figure>",
            f.svg,
            svg::esc(&f.caption)
        );
    }
    o.push_str(&md_html(summary_md));
    let _ = write!(
        o,
        "<h2>Order of the runs</h2><p>{}</p>",
        svg::esc(&s.order.join(" → "))
    );
    o.push_str("</body></html>\n");
    o
}
