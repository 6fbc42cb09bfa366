//! Lines over named points on a logarithmic y axis, as SVG text: latency
//! percentiles span four decades (a p50 of 1 µs, a max of 10 ms), which a linear
//! axis would flatten into the floor.

use std::fmt::Write as _;

use super::svg::{esc, open, short, text_w, y_axis, LEFT, PALETTE, PLOT_H, TOP};

/// One curve: its values at the x labels (None: not measured there).
pub struct Line {
    pub name: String,
    /// Index into the palette: lines of one datapath share a colour.
    pub colour: usize,
    pub dashed: bool,
    pub points: Vec<Option<f64>>,
}

const STEP: f64 = 90.0;

pub fn log_lines(id: &str, title: &str, x: &[&str], y_label: &str, lines: &[Line]) -> String {
    let vals = || {
        lines
            .iter()
            .flat_map(|l| l.points.iter().flatten())
            .copied()
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let lo = vals().fold(f64::INFINITY, f64::min);
    let hi = vals().fold(0.0, f64::max);
    let (d0, mut d1) = match lo.is_finite() {
        true => (lo.log10().floor(), hi.log10().ceil()),
        false => (0.0, 1.0),
    };
    if d1 <= d0 {
        d1 = d0 + 1.0;
    }
    let right = LEFT + 40.0 + STEP * (x.len().max(1) - 1) as f64;
    let legend_w = text_w(lines.iter().map(|l| l.name.as_str())) + 50.0;
    let (w, h) = (right + 20.0 + legend_w, TOP + PLOT_H + 40.0);
    let y = |v: f64| TOP + PLOT_H * (1.0 - (v.log10() - d0) / (d1 - d0));
    let xx = |i: usize| LEFT + 20.0 + STEP * i as f64;
    let mut o = open(id, w, h, title, LEFT);
    log_axis(&mut o, (d0, d1), right, y_label);
    for (i, l) in x.iter().enumerate() {
        let _ = write!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            xx(i),
            TOP + PLOT_H + 16.0,
            esc(l)
        );
    }
    for (li, l) in lines.iter().enumerate() {
        let c = PALETTE[l.colour % PALETTE.len()];
        let dash = if l.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        // A gap (a value not measured) breaks the line.
        let mut d = String::new();
        let mut pen_down = false;
        for (i, p) in l.points.iter().enumerate() {
            match p.filter(|v| v.is_finite() && *v > 0.0) {
                Some(v) => {
                    let _ = write!(
                        d,
                        "{}{:.1} {:.1}",
                        if pen_down { "L" } else { "M" },
                        xx(i),
                        y(v)
                    );
                    pen_down = true;
                    let _ = write!(
                        o,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"><title>{} {}: {}</title></circle>"#,
                        xx(i),
                        y(v),
                        esc(&l.name),
                        esc(x.get(i).copied().unwrap_or("")),
                        short(v)
                    );
                }
                None => pen_down = false,
            }
        }
        if !d.is_empty() {
            let _ = write!(
                o,
                r#"<path d="{d}" stroke="{c}" stroke-width="2" fill="none"{dash}/>"#
            );
        }
        let ly = TOP + 10.0 + li as f64 * 18.0;
        let lx = right + 20.0;
        let _ = write!(
            o,
            r#"<path d="M{lx:.1} {:.1}h22" stroke="{c}" stroke-width="2"{dash}/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
            ly - 4.0,
            lx + 28.0,
            esc(&l.name)
        );
    }
    o.push_str("</svg>");
    o
}

/// A grid line and label at every power of ten from 10^d0 to 10^d1.
fn log_axis(o: &mut String, (d0, d1): (f64, f64), right: f64, y_label: &str) {
    let ticks: Vec<(f64, f64)> = (0..=(d1 - d0) as i32)
        .map(|k| {
            let v = 10f64.powi(d0 as i32 + k);
            (v, TOP + PLOT_H * (1.0 - f64::from(k) / (d1 - d0)))
        })
        .collect();
    y_axis(o, &ticks, &format!("{y_label} (log)"), right);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_breaks_the_line_and_every_decade_has_a_grid_line() {
        let l = Line {
            name: "a".into(),
            colour: 0,
            dashed: true,
            points: vec![Some(0.5), Some(2.0), None, Some(300.0)],
        };
        let s = log_lines("x", "t", &["a", "b", "c", "d"], "µs", &[l]);
        // 0.1 to 1000: five decade lines.
        assert_eq!(s.matches("stroke=\"#ddd\"").count(), 5, "{s}");
        let path = s.split("<path d=\"").nth(1).unwrap();
        assert_eq!(path.split('"').next().unwrap().matches('M').count(), 2);
        assert_eq!(s.matches("<circle").count(), 3);
        assert!(s.contains("stroke-dasharray"));
    }

    #[test]
    fn no_values_draw_an_empty_plot() {
        let s = log_lines("x", "t", &["a"], "µs", &[]);
        assert!(s.ends_with("</svg>") && !s.contains("NaN") && !s.contains("inf"));
    }
}
