//! Horizontal stacked bars as SVG text: one bar per row, one segment per part (a
//! trace's layers, in request order), each part's colour the same in every row.

use std::fmt::Write as _;

use super::svg::{esc, nice_ceil, open, short, swatches, text_w, PALETTE};

pub struct StackRow {
    pub label: String,
    /// One value per part of the legend (None: this row has no such part).
    pub parts: Vec<Option<f64>>,
    /// Written after the bar.
    pub total: Option<f64>,
}

const BAR_AREA: f64 = 460.0;
const ROW_H: f64 = 24.0;
const TOP: f64 = 36.0;

/// Parts below zero (a derived layer such as transport, when the client's clock
/// saw less than the server's) are not drawn; their value is in the row's tooltip.
pub fn stacked(
    id: &str,
    title: &str,
    x_label: &str,
    legend: &[String],
    rows: &[StackRow],
) -> String {
    let drawn = |r: &StackRow| -> f64 { r.parts.iter().flatten().map(|v| v.max(0.0)).sum() };
    let top = rows
        .iter()
        .map(|r| drawn(r).max(r.total.unwrap_or(0.0)))
        .fold(0.0, f64::max);
    let xmax = nice_ceil(top);
    let label_w = text_w(rows.iter().map(|r| r.label.as_str())) + 16.0;
    let legend_w = text_w(legend.iter().map(String::as_str)) + 30.0;
    let w = label_w + BAR_AREA + 70.0 + legend_w;
    let h = (TOP + rows.len() as f64 * ROW_H + 40.0).max(TOP + legend.len() as f64 * 18.0 + 10.0);
    let x = |v: f64| label_w + BAR_AREA * v / xmax;
    let mut o = open(id, w, h, title, 10.0);
    let bottom = TOP + rows.len() as f64 * ROW_H;
    for i in 0..=4 {
        let v = xmax * f64::from(i) / 4.0;
        let _ = write!(
            o,
            r##"<line x1="{0:.1}" x2="{0:.1}" y1="{TOP}" y2="{bottom:.1}" stroke="#ddd"/><text x="{0:.1}" y="{1:.1}" text-anchor="middle">{2}</text>"##,
            x(v),
            bottom + 14.0,
            short(v)
        );
    }
    let _ = write!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        label_w + BAR_AREA / 2.0,
        bottom + 30.0,
        esc(x_label)
    );
    for (ri, r) in rows.iter().enumerate() {
        let ry = TOP + ri as f64 * ROW_H + 3.0;
        let all: Vec<String> = legend
            .iter()
            .zip(&r.parts)
            .filter_map(|(n, v)| Some(format!("{n} {}", short((*v)?))))
            .collect();
        let _ = write!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}<title>{}</title></text>"#,
            label_w - 6.0,
            ry + ROW_H / 2.0 + 2.0,
            esc(&r.label),
            esc(&all.join(", "))
        );
        let mut at = 0.0;
        for (pi, v) in r.parts.iter().enumerate() {
            let Some(v) = v.filter(|v| *v > 0.0) else {
                continue;
            };
            let name = legend.get(pi).map_or("", String::as_str);
            let _ = write!(
                o,
                r#"<rect x="{:.1}" y="{ry:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
                x(at),
                x(at + v) - x(at),
                ROW_H - 6.0,
                PALETTE[pi % PALETTE.len()],
                esc(name),
                short(v)
            );
            at += v;
        }
        if let Some(t) = r.total {
            let _ = write!(
                o,
                r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
                x(at.max(t)) + 4.0,
                ry + ROW_H / 2.0 + 2.0,
                short(t)
            );
        }
    }
    let lx = label_w + BAR_AREA + 70.0;
    swatches(&mut o, lx, TOP, legend.iter().map(String::as_str));
    o.push_str("</svg>");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_per_positive_part_in_the_legend_colour() {
        let legend = vec!["a".to_string(), "b".to_string(), "c".to_string()];
        let rows = [
            StackRow {
                label: "one".into(),
                parts: vec![Some(1.0), Some(2.0), Some(-0.5)],
                total: Some(2.5),
            },
            StackRow {
                label: "two".into(),
                parts: vec![None, Some(4.0), None],
                total: None,
            },
        ];
        let s = stacked("x", "t", "µs", &legend, &rows);
        // Three segments plus three legend boxes.
        assert_eq!(s.matches("<rect x=").count(), 6, "{s}");
        assert!(s.contains("<title>b: 4.00</title>"));
        assert!(s.contains("c -0.50"), "the negative part is in the tooltip");
        assert_eq!(s.matches(PALETTE[1]).count(), 3);
    }
}
