//! Two figures as SVG text: grouped bars with min–max whiskers, and a heatmap. Plain
//! string building: the report must be one self-contained HTML file, and both
//! figures are a few rectangles and labels (the plotters crate that `perf --plot`
//! uses draws bitmaps; its SVG backend would add a feature and still need our own
//! whiskers and heatmap labels).

use std::fmt::Write as _;

/// Colours that stay apart for the colour-blind (Okabe–Ito).
pub(super) const PALETTE: [&str; 8] = [
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000",
];

/// A bar's median and whisker ends.
#[derive(Debug, Clone, Copy)]
pub struct Bar {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// One datapath's bars, one per group (None: not run there).
pub struct Series {
    pub name: String,
    pub bars: Vec<Option<Bar>>,
}

/// The width a line of 11 px sans-serif text takes, at most (~6.5 px per
/// character): legends and labels get room for the longest name.
pub fn text_w<'a>(lines: impl IntoIterator<Item = &'a str>) -> f64 {
    lines
        .into_iter()
        .map(|l| l.chars().count() as f64 * 6.5)
        .fold(0.0, f64::max)
}

pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Three significant digits with a unit: 1234567 -> `1.23M`, 400000 -> `400k`, 0.5 -> `0.50`.
pub fn short(v: f64) -> String {
    let (x, unit) = match v.abs() {
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    match x.abs() {
        a if a >= 100.0 => format!("{x:.0}{unit}"),
        a if a >= 10.0 => format!("{x:.1}{unit}"),
        _ => format!("{x:.2}{unit}"),
    }
}

/// The smallest round number at or above `v` (steps of 1, 1.2, 1.5, 2, 2.5, 3, 4,
/// 5, 6, 8 × 10^k: the top bar fills most of the plot).
pub(super) fn nice_ceil(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    // powi of an integer exponent: exact powers of ten, so 2.5 × 10^6 is 2500000.
    let p = 10f64.powi(v.log10().floor() as i32);
    [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|x| *x >= v)
        .unwrap_or(10.0 * p)
}

const BAR_W: f64 = 18.0;
pub(super) const LEFT: f64 = 70.0;
pub(super) const TOP: f64 = 40.0;
pub(super) const PLOT_H: f64 = 220.0;

/// Grouped bars (one group per workload, one bar per series) with min–max whiskers.
pub fn bars(id: &str, title: &str, y_label: &str, groups: &[String], series: &[Series]) -> String {
    let group_w = (series.len() as f64 * BAR_W + 24.0).max(110.0);
    let legend_w = (text_w(series.iter().map(|s| s.name.as_str())) + 40.0).max(150.0);
    let w = LEFT + groups.len() as f64 * group_w + legend_w;
    let h = TOP + PLOT_H + 50.0;
    let top = series
        .iter()
        .flat_map(|s| s.bars.iter().flatten())
        .map(|b| b.max.max(b.median))
        .fold(0.0, f64::max);
    let ymax = nice_ceil(top);
    let y = |v: f64| TOP + PLOT_H * (1.0 - v / ymax);
    let mut o = open(id, w, h, title, LEFT);
    axis(&mut o, ymax, y_label, LEFT + groups.len() as f64 * group_w);
    for (gi, g) in groups.iter().enumerate() {
        let gx = LEFT + gi as f64 * group_w + 12.0;
        for (si, s) in series.iter().enumerate() {
            let Some(Some(b)) = s.bars.get(gi) else {
                continue;
            };
            let x = gx + si as f64 * BAR_W;
            let c = PALETTE[si % PALETTE.len()];
            let _ = write!(
                o,
                r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{c}"><title>{}: {}</title></rect>"#,
                y(b.median),
                BAR_W - 2.0,
                (y(0.0) - y(b.median)).max(0.0),
                esc(&s.name),
                short(b.median)
            );
            let cx = x + (BAR_W - 2.0) / 2.0;
            let _ = write!(
                o,
                r#"<path d="M{cx:.1} {:.1}V{:.1}M{:.1} {:.1}h6M{:.1} {:.1}h6" stroke="black" fill="none"/>"#,
                y(b.min),
                y(b.max),
                cx - 3.0,
                y(b.min),
                cx - 3.0,
                y(b.max)
            );
        }
        let (l1, l2) = g
            .split_once(" QD")
            .map_or((g.as_str(), String::new()), |(a, b)| (a, format!("QD{b}")));
        let mx = LEFT + gi as f64 * group_w + group_w / 2.0;
        let _ = write!(
            o,
            r#"<text x="{mx:.1}" y="{:.1}" text-anchor="middle">{}<tspan x="{mx:.1}" dy="13">{}</tspan></text>"#,
            TOP + PLOT_H + 16.0,
            esc(l1),
            esc(&l2)
        );
    }
    let lx = LEFT + groups.len() as f64 * group_w + 16.0;
    swatches(&mut o, lx, TOP, series.iter().map(|s| s.name.as_str()));
    o.push_str("</svg>");
    o
}

/// A legend at (`x`, below `top`): a square of the palette's colour per name, in order.
pub(super) fn swatches<'a>(o: &mut String, x: f64, top: f64, names: impl Iterator<Item = &'a str>) {
    for (i, name) in names.enumerate() {
        let ly = top + 10.0 + i as f64 * 18.0;
        let c = PALETTE[i % PALETTE.len()];
        let _ = write!(
            o,
            r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{c}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            ly - 10.0,
            x + 16.0,
            ly,
            esc(name)
        );
    }
}

/// An SVG's start: its size, a white ground and the title at `title_x`.
pub(super) fn open(id: &str, w: f64, h: f64, title: &str, title_x: f64) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<svg id="{}" xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif" font-size="11">"#,
        esc(id)
    );
    let _ = write!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = write!(
        o,
        r#"<text x="{title_x}" y="18" font-size="14" font-weight="bold">{}</text>"#,
        esc(title)
    );
    o
}

/// The y axis with five ticks and grid lines up to `right`.
fn axis(o: &mut String, ymax: f64, label: &str, right: f64) {
    let ticks: Vec<(f64, f64)> = (0..=5)
        .map(|i| {
            let v = ymax * f64::from(i) / 5.0;
            (v, TOP + PLOT_H * (1.0 - v / ymax))
        })
        .collect();
    y_axis(o, &ticks, label, right);
}

/// A y axis: a grid line up to `right` and a label at each tick (value, y).
pub(super) fn y_axis(o: &mut String, ticks: &[(f64, f64)], label: &str, right: f64) {
    for &(v, yy) in ticks {
        let _ = write!(
            o,
            r##"<line x1="{LEFT}" x2="{right:.1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT - 4.0,
            yy + 4.0,
            short(v)
        );
    }
    let _ = write!(
        o,
        r#"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{:.1}" stroke="black"/><text transform="translate(14 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + PLOT_H,
        TOP + PLOT_H / 2.0,
        esc(label)
    );
}

/// A grid of values (rows × columns), shaded from light to dark by value, each cell
/// labelled with its value.
pub fn heatmap(
    id: &str,
    title: &str,
    cols: (&str, &[String]),
    rows: (&str, &[String]),
    v: &[Vec<Option<f64>>],
) -> String {
    let (cw, ch, left, top) = (80.0, 36.0, 90.0, 50.0);
    // Wide enough for the title: ~9 px per character of bold 14 px text.
    let w = (left + cols.1.len() as f64 * cw + 20.0).max(title.chars().count() as f64 * 9.0 + 20.0);
    let h = top + rows.1.len() as f64 * ch + 40.0;
    let vmax = v.iter().flatten().flatten().copied().fold(0.0, f64::max);
    let mut o = open(id, w, h, title, 10.0);
    let _ = write!(
        o,
        r#"<text x="{:.1}" y="38" text-anchor="middle">{}</text>"#,
        left + cols.1.len() as f64 * cw / 2.0,
        esc(cols.0)
    );
    let _ = write!(
        o,
        r#"<text x="10" y="{:.1}">{}</text>"#,
        top - 4.0,
        esc(rows.0)
    );
    for (ri, rl) in rows.1.iter().enumerate() {
        let ry = top + ri as f64 * ch;
        let _ = write!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            left - 6.0,
            ry + ch / 2.0 + 4.0,
            esc(rl)
        );
        for ci in 0..cols.1.len() {
            let cx = left + ci as f64 * cw;
            let val = v.get(ri).and_then(|r| r.get(ci)).copied().flatten();
            let (fill, text, ink) = match val {
                Some(x) if vmax > 0.0 => {
                    let t = x / vmax;
                    // From #eef4fb (low) to #08306b (high).
                    let mix = |a: f64, b: f64| (a + (b - a) * t).round() as u8;
                    let fill = format!(
                        "#{:02x}{:02x}{:02x}",
                        mix(238.0, 8.0),
                        mix(244.0, 48.0),
                        mix(251.0, 107.0)
                    );
                    (fill, short(x), if t > 0.5 { "white" } else { "black" })
                }
                _ => ("#f4f4f4".to_string(), "—".to_string(), "black"),
            };
            let _ = write!(
                o,
                r#"<rect x="{cx:.1}" y="{ry:.1}" width="{:.1}" height="{:.1}" fill="{fill}" stroke="white"/><text x="{:.1}" y="{:.1}" text-anchor="middle" fill="{ink}">{text}</text>"#,
                cw,
                ch,
                cx + cw / 2.0,
                ry + ch / 2.0 + 4.0
            );
        }
    }
    for (ci, cl) in cols.1.iter().enumerate() {
        let _ = write!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            left + ci as f64 * cw + cw / 2.0,
            top + rows.1.len() as f64 * ch + 16.0,
            esc(cl)
        );
    }
    o.push_str("</svg>");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_numbers_keep_three_digits() {
        assert_eq!(short(1_234_567.0), "1.23M");
        assert_eq!(short(400_000.0), "400k");
        assert_eq!(short(12_345.0), "12.3k");
        assert_eq!(short(0.5), "0.50");
    }

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceil(7.0), 8.0);
        assert_eq!(nice_ceil(1500.0), 1500.0);
        assert_eq!(nice_ceil(2_380_000.0), 2_500_000.0);
        assert_eq!(nice_ceil(9.5), 10.0);
        assert_eq!(nice_ceil(0.0), 1.0);
    }

    #[test]
    fn labels_are_escaped() {
        let s = bars("a", "<x>", "y", &["g&h".into()], &[]);
        assert!(s.contains("&lt;x&gt;") && s.contains("g&amp;h") && !s.contains("<x>"));
    }
}
