//! Showing a layer breakdown: the text table, JSON, and a stacked-bar PNG of the
//! mean time per layer for reads and writes (`udrive trace`, `udrive perf --trace`).

use std::path::Path;

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;
use trace::{Breakdown, TOTAL};

/// Where the chart's font comes from (Debian package `fonts-dejavu-core`); the
/// `UDRIVE_FONT` environment variable names another TrueType file.
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Text table: count, mean, p50, p99, p99.9, max per layer, reads then writes.
pub fn table(b: &Breakdown) -> String {
    b.to_string()
}

pub fn json(b: &Breakdown) -> Result<String> {
    Ok(serde_json::to_string_pretty(b)?)
}

/// plotters' text rendering without system libraries (ab_glyph) needs the font's
/// bytes registered once, for the life of the process.
fn register_font() -> Result<()> {
    static DONE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let path = std::env::var("UDRIVE_FONT").unwrap_or_else(|_| DEFAULT_FONT.into());
        let bytes = std::fs::read(&path).map_err(|e| {
            format!(
                "cannot read font {path}: {e}; install the Debian package fonts-dejavu-core \
                 or set UDRIVE_FONT to a TrueType file"
            )
        })?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{path} is not a usable TrueType font"))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// Layers to stack for one op: every row but `total`, means in µs (a negative
/// derived `transport` mean, possible with clock skew, is drawn as 0).
fn stack(b: &Breakdown) -> Vec<(String, Vec<(String, f64)>)> {
    b.ops
        .iter()
        .map(|o| {
            let layers = o
                .rows
                .iter()
                .filter(|r| r.layer != TOTAL)
                .map(|r| (r.layer.clone(), (r.mean_ns / 1000.0).max(0.0)))
                .collect();
            (o.op.clone(), layers)
        })
        .collect()
}

/// Writes a stacked-bar chart of mean time per layer (one bar per op) to `path`.
pub fn plot(b: &Breakdown, title: &str, path: &Path) -> Result<()> {
    if b.ops.is_empty() {
        bail!("nothing to plot: the trace holds no reads or writes");
    }
    register_font()?;
    let bars = stack(b);
    let mut names: Vec<String> = Vec::new();
    for (_, layers) in &bars {
        for (n, _) in layers {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    let ymax = bars
        .iter()
        .map(|(_, l)| l.iter().map(|(_, v)| v).sum::<f64>())
        .fold(0.0f64, f64::max)
        .max(0.001)
        * 1.25;
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(path, (800, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..bars.len() as f64, 0f64..ymax)?;
        let labels: Vec<String> = bars.iter().map(|(op, _)| op.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(bars.len() * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - i as f64 - 0.5).abs() < 0.01 {
                    labels.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("mean time (µs)")
            .draw()?;
        for (li, name) in names.iter().enumerate() {
            let color = Palette99::pick(li).to_rgba();
            let rects: Vec<Rectangle<(f64, f64)>> = bars
                .iter()
                .enumerate()
                .filter_map(|(i, (_, layers))| {
                    let below: f64 = layers
                        .iter()
                        .take_while(|(n, _)| n != name)
                        .map(|(_, v)| v)
                        .sum();
                    let v = layers.iter().find(|(n, _)| n == name)?.1;
                    Some(Rectangle::new(
                        [(i as f64 + 0.25, below), (i as f64 + 0.75, below + v)],
                        color.filled(),
                    ))
                })
                .collect();
            chart
                .draw_series(rects)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw()
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("cannot write the chart to {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use trace::{LayerRow, OpBreakdown, Side};

    fn row(layer: &str, mean: f64) -> LayerRow {
        LayerRow {
            layer: layer.into(),
            side: Side::Server,
            count: 10,
            mean_ns: mean,
            p50_ns: mean as u64,
            p99_ns: mean as u64,
            p99_9_ns: mean as u64,
            max_ns: mean as u64,
        }
    }

    fn sample() -> Breakdown {
        let rows = |b: f64| {
            vec![
                row("queue", 300.0),
                row("backend", b),
                row("complete", 100.0),
                row("notify", 50.0),
                row("total", 450.0 + b),
            ]
        };
        Breakdown {
            ops: vec![
                OpBreakdown {
                    op: "read".into(),
                    rows: rows(1000.0),
                },
                OpBreakdown {
                    op: "write".into(),
                    rows: rows(2000.0),
                },
            ],
        }
    }

    #[test]
    fn png_is_written() {
        if std::fs::metadata(DEFAULT_FONT).is_err() && std::env::var("UDRIVE_FONT").is_err() {
            panic!("font {DEFAULT_FONT} missing: apt-get install fonts-dejavu-core");
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.png");
        plot(&sample(), "test", &p).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 2000, "a chart, not an empty image");
    }

    #[test]
    fn empty_breakdown_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = plot(&Breakdown::default(), "x", &dir.path().join("e.png")).unwrap_err();
        assert!(e.to_string().contains("no reads or writes"), "{e}");
    }

    #[test]
    fn table_has_every_layer() {
        let t = table(&sample());
        for l in [
            "queue", "backend", "complete", "notify", "total", "read", "write", "p99.9",
        ] {
            assert!(t.contains(l), "{l} missing in\n{t}");
        }
        let j: Breakdown = serde_json::from_str(&json(&sample()).unwrap()).unwrap();
        assert_eq!(j, sample());
    }
}
