//! Standalone SVG charts drawn with `plotters` (SVG backend only, no font libraries: text is
//! written as SVG `<text>` in `sans-serif` and laid out with estimated widths).
//!
//! Two kinds: [`BarChart`] (categorical x, optionally stacked, a value above each bar) and
//! [`LineChart`] (numeric axes, linear or log₂/log₁₀, solid or dashed series with or without
//! markers). Both put the legend in a panel right of the plot, sized from the labels, so that
//! it never covers data, and size the canvas from the number of bars and the label lengths.

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// An sRGB colour.
pub type Rgb = (u8, u8, u8);

const FONT: &str = "sans-serif";
const TITLE_PX: u32 = 20;
const LABEL_PX: u32 = 14;
const DESC_PX: u32 = 15;
const LEGEND_PX: u32 = 14;
const LEGEND_ROW: i32 = 22;
/// Generous average glyph width of a sans-serif font, in em (real fonts: about 0.5 to 0.6).
const EM_WIDTH: f64 = 0.56;

/// A linear f64 axis whose ticks are exactly the given values (log axes are drawn on it in
/// log units). plotters' own `WithKeyPoints` over f64 has no label formatter.
#[derive(Clone, Debug)]
struct Keyed {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

fn keyed(r: std::ops::Range<f64>, ticks: Vec<f64>) -> Keyed {
    let ticks = ticks
        .into_iter()
        .filter(|t| *t >= r.start - 1e-9 && *t <= r.end + 1e-9)
        .collect();
    Keyed {
        lo: r.start,
        hi: r.end,
        ticks,
    }
}

impl Ranged for Keyed {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        if self.hi == self.lo {
            return (limit.0 + limit.1) / 2;
        }
        let t = (v - self.lo) / (self.hi - self.lo);
        limit.0 + ((limit.1 - limit.0) as f64 * t).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

fn text_width(s: &str, px: u32) -> i32 {
    (s.chars().count() as f64 * px as f64 * EM_WIDTH).ceil() as i32
}

fn color(c: Rgb) -> RGBColor {
    RGBColor(c.0, c.1, c.2)
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart: {e:?}")
}

/// A tick label: integers as such, large values with k/M, small ones with up to 3 decimals.
pub fn fmt_tick(v: f64) -> String {
    let a = v.abs();
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            s
        }
    };
    if a >= 1e6 {
        format!("{}M", trim(format!("{:.2}", v / 1e6)))
    } else if a >= 1e4 {
        format!("{}k", trim(format!("{:.1}", v / 1e3)))
    } else if a >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if a >= 1.0 {
        trim(format!("{v:.2}"))
    } else {
        trim(format!("{v:.3}"))
    }
}

/// About `n` round ticks (1, 2 or 5 × 10^k apart) covering `lo..=hi`.
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite()) || hi <= lo {
        return vec![lo];
    }
    let raw = (hi - lo) / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// Ticks for a logarithmic axis covering `lo..=hi`. Base 2: powers of two (every other one
/// when there are many). Base 10: 1, 2 and 5 × 10^k, or every integer multiple of 10^k when
/// that gives fewer than three, or only powers of ten when that gives more than ten.
pub fn log_ticks(lo: f64, hi: f64, base: f64) -> Vec<f64> {
    if !(lo > 0.0 && hi >= lo && lo.is_finite() && hi.is_finite()) {
        return vec![1.0];
    }
    let inside = |v: &f64| *v >= lo * (1.0 - 1e-9) && *v <= hi * (1.0 + 1e-9);
    if base != 10.0 {
        let a = (lo.log(base) - 1e-9).ceil() as i32;
        let b = (hi.log(base) + 1e-9).floor() as i32;
        let stride = ((b - a) / 8 + 1).max(1) as usize;
        let t: Vec<f64> = (a..=b).step_by(stride).map(|e| base.powi(e)).collect();
        return if t.is_empty() {
            nice_ticks(lo, hi, 3)
        } else {
            t
        };
    }
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let with = |mult: &[f64]| -> Vec<f64> {
        (a..=b)
            .flat_map(|e| mult.iter().map(move |m| m * 10f64.powi(e)))
            .filter(inside)
            .collect()
    };
    let t = with(&[1.0, 2.0, 5.0]);
    if t.len() > 10 {
        with(&[1.0])
    } else if t.len() < 3 {
        let t = with(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
        if t.len() < 2 {
            nice_ticks(lo, hi, 4)
        } else {
            t
        }
    } else {
        t
    }
}

/// One stacked component of a [`BarChart`] (a legend entry).
#[derive(Clone, Debug)]
pub struct Stack {
    pub label: String,
    pub color: Rgb,
    /// One value per bar.
    pub values: Vec<f64>,
}

/// Bars with categorical x labels; several [`Stack`]s stack bottom-up.
#[derive(Clone, Debug)]
pub struct BarChart {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    /// One label per bar.
    pub bars: Vec<String>,
    /// A second, smaller line under each bar label (empty: none).
    pub sublabels: Vec<String>,
    pub stacks: Vec<Stack>,
    /// Text above each bar (empty strings for none).
    pub annotations: Vec<String>,
    /// Draw the legend (one entry per stack).
    pub legend: bool,
}

/// Draws a [`BarChart`] and returns the SVG document.
pub fn bar_chart(c: &BarChart) -> Result<String> {
    let n = c.bars.len().max(1);
    let totals: Vec<f64> = (0..n)
        .map(|i| {
            c.stacks
                .iter()
                .map(|s| s.values.get(i).copied().unwrap_or(0.0))
                .filter(|v| v.is_finite() && *v > 0.0)
                .sum()
        })
        .collect();
    let ymax = totals.iter().copied().fold(0.0, f64::max);
    let ymax = if ymax > 0.0 { ymax * 1.12 } else { 1.0 };
    let yt = nice_ticks(0.0, ymax, 6);

    let longest = c
        .bars
        .iter()
        .chain(c.annotations.iter())
        .chain(c.sublabels.iter())
        .map(|l| text_width(l, LABEL_PX))
        .max()
        .unwrap_or(0);
    let bar_w = (longest + 24).max(70);
    let legend_items: Vec<(String, Rgb)> = if c.legend {
        c.stacks
            .iter()
            .rev()
            .map(|s| (s.label.clone(), s.color))
            .collect()
    } else {
        Vec::new()
    };
    let legend_w = legend_width(&legend_items);
    let y_area = 80;
    let plot_w = (n as i32 * bar_w + y_area + 30).max(420);
    let width = (plot_w + legend_w)
        .max(text_width(&c.title, TITLE_PX) + 40)
        .max(640);
    let plot_w = width - legend_w;
    let height = 480.max(legend_items.len() as i32 * LEGEND_ROW + 120);

    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (width as u32, height as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let body = root
            .titled(&c.title, (FONT, TITLE_PX).into_font())
            .map_err(err)?;
        let (left, right) = body.split_horizontally(plot_w);
        let labels = c.bars.clone();
        let x_fmt = move |v: &f64| {
            let i = v.round();
            if (v - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        let y_fmt = |v: &f64| fmt_tick(*v);
        let has_sub = c.sublabels.iter().any(|l| !l.is_empty());
        let mut chart = ChartBuilder::on(&left)
            .margin(12)
            .margin_top(16)
            .x_label_area_size(if has_sub { 70 } else { 52 })
            .y_label_area_size(y_area)
            .build_cartesian_2d(
                keyed(-0.5..n as f64 - 0.5, (0..n).map(|i| i as f64).collect()),
                keyed(0.0..ymax, yt),
            )
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&y_fmt)
            .x_desc(c.x_desc.as_str())
            .y_desc(c.y_desc.as_str())
            .label_style((FONT, LABEL_PX))
            .axis_desc_style((FONT, DESC_PX))
            .draw()
            .map_err(err)?;
        let half = 0.34;
        let mut base = vec![0.0f64; n];
        for s in &c.stacks {
            let fill = color(s.color).filled();
            let rects: Vec<Rectangle<(f64, f64)>> = (0..n)
                .filter_map(|i| {
                    let v = s.values.get(i).copied().unwrap_or(0.0);
                    if !(v.is_finite() && v > 0.0) {
                        return None;
                    }
                    let r = Rectangle::new(
                        [(i as f64 - half, base[i]), (i as f64 + half, base[i] + v)],
                        fill,
                    );
                    base[i] += v;
                    Some(r)
                })
                .collect();
            chart.draw_series(rects).map_err(err)?;
        }
        // A thin outline around each whole bar.
        chart
            .draw_series((0..n).filter(|&i| base[i] > 0.0).map(|i| {
                Rectangle::new(
                    [(i as f64 - half, 0.0), (i as f64 + half, base[i])],
                    RGBColor(0x55, 0x55, 0x55).stroke_width(1),
                )
            }))
            .map_err(err)?;
        let font = (FONT, LABEL_PX).into_font().color(&BLACK);
        let anchored = font.pos(Pos::new(HPos::Center, VPos::Bottom));
        chart
            .draw_series(
                c.annotations
                    .iter()
                    .enumerate()
                    .filter(|(i, a)| !a.is_empty() && *i < n)
                    .map(|(i, a)| {
                        EmptyElement::at((i as f64, base[i]))
                            + Text::new(a.clone(), (0, -5), anchored.clone())
                    }),
            )
            .map_err(err)?;
        let sub_font = (FONT, LABEL_PX - 1)
            .into_font()
            .color(&RGBColor(0x55, 0x55, 0x55))
            .pos(Pos::new(HPos::Center, VPos::Top));
        for (i, l) in c.sublabels.iter().enumerate() {
            if i < n && !l.is_empty() {
                let (px, py) = chart.backend_coord(&(i as f64, 0.0));
                root.draw(&Text::new(l.clone(), (px, py + 26), sub_font.clone()))
                    .map_err(err)?;
            }
        }
        draw_legend(&right, &legend_items, &[], 40)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// How a [`Line`] is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineStyle {
    /// Solid line with circle markers.
    Markers,
    /// Markers only (no connecting line).
    Points,
    /// Dashed, no markers (ideal and peak lines).
    Dashed,
    /// Solid, no markers (curves over many steps).
    Solid,
}

/// One series of a [`LineChart`].
#[derive(Clone, Debug)]
pub struct Line {
    pub label: String,
    pub color: Rgb,
    pub style: LineStyle,
    /// (x, y) in data units; points with a non-finite or (on a log axis) non-positive
    /// coordinate are skipped.
    pub points: Vec<(f64, f64)>,
}

/// An axis of a [`LineChart`].
#[derive(Clone, Debug)]
pub struct Axis {
    pub desc: String,
    /// `None`: linear; `Some(b)`: logarithmic in base `b` (2 or 10), ticks at powers of `b`.
    pub log: Option<f64>,
    /// Tick positions in data units (`None`: chosen automatically).
    pub ticks: Option<Vec<f64>>,
    /// Start a linear axis at zero.
    pub from_zero: bool,
}

impl Axis {
    /// A linear axis.
    pub fn linear(desc: &str, from_zero: bool) -> Axis {
        Axis {
            desc: desc.to_owned(),
            log: None,
            ticks: None,
            from_zero,
        }
    }

    /// A logarithmic axis in `base`.
    pub fn log(desc: &str, base: f64) -> Axis {
        Axis {
            desc: desc.to_owned(),
            log: Some(base),
            ticks: None,
            from_zero: false,
        }
    }

    /// Ticks at these data values.
    pub fn with_ticks(mut self, ticks: Vec<f64>) -> Axis {
        self.ticks = Some(ticks);
        self
    }

    fn to_plot(&self, v: f64) -> Option<f64> {
        match self.log {
            Some(b) => (v > 0.0 && v.is_finite()).then(|| v.log(b)),
            None => v.is_finite().then_some(v),
        }
    }

    fn unplot(&self, v: f64) -> f64 {
        match self.log {
            Some(b) => b.powf(v),
            None => v,
        }
    }

    /// Plot range and ticks (in plot units) for data in `lo..=hi`.
    fn layout(&self, lo: f64, hi: f64) -> (f64, f64, Vec<f64>) {
        match self.log {
            Some(b) => {
                let (a, z) = (lo.log(b), hi.log(b));
                let pad = ((z - a) * 0.06).max(0.08);
                let (a, z) = (a - pad, z + pad);
                let ticks = self
                    .ticks
                    .clone()
                    .unwrap_or_else(|| log_ticks(b.powf(a), b.powf(z), b));
                let t = ticks.iter().filter_map(|t| self.to_plot(*t)).collect();
                (a, z, t)
            }
            None => {
                let lo = if self.from_zero { lo.min(0.0) } else { lo };
                let span = (hi - lo).max(hi.abs() * 0.1).max(1e-9);
                let (a, z) = (
                    if self.from_zero && lo >= 0.0 {
                        0.0
                    } else {
                        lo - span * 0.06
                    },
                    hi + span * 0.08,
                );
                let ticks = self.ticks.clone().unwrap_or_else(|| nice_ticks(a, z, 6));
                (a, z, ticks)
            }
        }
    }
}

/// Lines and points on numeric axes.
#[derive(Clone, Debug)]
pub struct LineChart {
    pub title: String,
    pub x: Axis,
    pub y: Axis,
    pub lines: Vec<Line>,
    /// Lines of text under the legend (notes such as "dashed: ideal").
    pub legend_notes: Vec<String>,
}

/// Draws a [`LineChart`] and returns the SVG document.
pub fn line_chart(c: &LineChart) -> Result<String> {
    let pts: Vec<Vec<(f64, f64)>> = c
        .lines
        .iter()
        .map(|l| {
            l.points
                .iter()
                .filter_map(|&(x, y)| Some((c.x.to_plot(x)?, c.y.to_plot(y)?)))
                .collect()
        })
        .collect();
    let all: Vec<(f64, f64)> = pts.iter().flatten().copied().collect();
    let bounds = |f: &dyn Fn(&(f64, f64)) -> f64, axis: &Axis| {
        let lo = all.iter().map(f).fold(f64::INFINITY, f64::min);
        let hi = all.iter().map(f).fold(f64::NEG_INFINITY, f64::max);
        if lo.is_finite() {
            (axis.unplot(lo), axis.unplot(hi))
        } else {
            (1.0, 2.0)
        }
    };
    let (xlo, xhi) = bounds(&|p| p.0, &c.x);
    let (ylo, yhi) = bounds(&|p| p.1, &c.y);
    let (x0, x1, xt) = c.x.layout(xlo, xhi);
    let (y0, y1, yt) = c.y.layout(ylo, yhi);

    let legend_items: Vec<(String, Rgb)> =
        c.lines.iter().map(|l| (l.label.clone(), l.color)).collect();
    let styles: Vec<LineStyle> = c.lines.iter().map(|l| l.style).collect();
    let legend_w = legend_width(&legend_items).max(
        c.legend_notes
            .iter()
            .map(|n| text_width(n, LEGEND_PX) + 30)
            .max()
            .unwrap_or(0),
    );
    let plot_w = 620;
    let width = (plot_w + legend_w).max(text_width(&c.title, TITLE_PX) + 40);
    let plot_w = width - legend_w;
    let rows = legend_items.iter().filter(|(l, _)| !l.is_empty()).count() + c.legend_notes.len();
    let height = 480.max(rows as i32 * LEGEND_ROW + 120);

    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (width as u32, height as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let body = root
            .titled(&c.title, (FONT, TITLE_PX).into_font())
            .map_err(err)?;
        let (left, right) = body.split_horizontally(plot_w);
        let x_fmt = |v: &f64| fmt_tick(c.x.unplot(*v));
        let y_fmt = |v: &f64| fmt_tick(c.y.unplot(*v));
        let mut chart = ChartBuilder::on(&left)
            .margin(12)
            .margin_top(16)
            .x_label_area_size(52)
            .y_label_area_size(80)
            .build_cartesian_2d(keyed(x0..x1, xt), keyed(y0..y1, yt))
            .map_err(err)?;
        chart
            .configure_mesh()
            .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&y_fmt)
            .x_desc(c.x.desc.as_str())
            .y_desc(c.y.desc.as_str())
            .label_style((FONT, LABEL_PX))
            .axis_desc_style((FONT, DESC_PX))
            .draw()
            .map_err(err)?;
        for (l, p) in c.lines.iter().zip(&pts) {
            let col = color(l.color);
            match l.style {
                LineStyle::Dashed => {
                    chart
                        .draw_series(DashedLineSeries::new(
                            p.iter().copied(),
                            8,
                            5,
                            col.stroke_width(2),
                        ))
                        .map_err(err)?;
                }
                LineStyle::Solid => {
                    chart
                        .draw_series(LineSeries::new(p.iter().copied(), col.stroke_width(2)))
                        .map_err(err)?;
                }
                LineStyle::Markers | LineStyle::Points => {
                    if l.style == LineStyle::Markers {
                        chart
                            .draw_series(LineSeries::new(p.iter().copied(), col.stroke_width(2)))
                            .map_err(err)?;
                    }
                    chart
                        .draw_series(p.iter().map(|&q| Circle::new(q, 4, col.filled())))
                        .map_err(err)?;
                }
            }
        }
        draw_legend_styled(&right, &legend_items, &styles, &c.legend_notes, 40)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

fn legend_width(items: &[(String, Rgb)]) -> i32 {
    if items.iter().all(|(l, _)| l.is_empty()) {
        return 0;
    }
    items
        .iter()
        .map(|(l, _)| text_width(l, LEGEND_PX))
        .max()
        .unwrap_or(0)
        + 60
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

fn draw_legend(area: &Area, items: &[(String, Rgb)], notes: &[String], top: i32) -> Result<()> {
    let styles = vec![None; items.len()];
    draw_legend_impl(area, items, &styles, notes, top)
}

fn draw_legend_styled(
    area: &Area,
    items: &[(String, Rgb)],
    styles: &[LineStyle],
    notes: &[String],
    top: i32,
) -> Result<()> {
    let styles: Vec<Option<LineStyle>> = styles.iter().map(|s| Some(*s)).collect();
    draw_legend_impl(area, items, &styles, notes, top)
}

/// Legend rows: a swatch (filled box for bars, line/dash/dot for lines) and the label.
fn draw_legend_impl(
    area: &Area,
    items: &[(String, Rgb)],
    styles: &[Option<LineStyle>],
    notes: &[String],
    top: i32,
) -> Result<()> {
    let font = (FONT, LEGEND_PX)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    let x = 8;
    let shown = items
        .iter()
        .zip(styles)
        .filter(|((label, _), _)| !label.is_empty());
    for (i, ((label, c), style)) in shown.enumerate() {
        let y = top + i as i32 * LEGEND_ROW;
        let col = color(*c);
        match style {
            None => area
                .draw(&Rectangle::new([(x, y - 7), (x + 22, y + 7)], col.filled()))
                .map_err(err)?,
            Some(LineStyle::Dashed) => {
                for s in [0, 9, 18] {
                    area.draw(&PathElement::new(
                        vec![(x + s, y), (x + s + 5, y)],
                        col.stroke_width(2),
                    ))
                    .map_err(err)?;
                }
            }
            Some(LineStyle::Solid) => {
                area.draw(&PathElement::new(
                    vec![(x, y), (x + 22, y)],
                    col.stroke_width(2),
                ))
                .map_err(err)?;
            }
            Some(s) => {
                if *s == LineStyle::Markers {
                    area.draw(&PathElement::new(
                        vec![(x, y), (x + 22, y)],
                        col.stroke_width(2),
                    ))
                    .map_err(err)?;
                }
                area.draw(&Circle::new((x + 11, y), 4, col.filled()))
                    .map_err(err)?;
            }
        }
        area.draw(&Text::new(label.clone(), (x + 30, y), font.clone()))
            .map_err(err)?;
    }
    let note_font = (FONT, LEGEND_PX - 1)
        .into_font()
        .color(&RGBColor(0x44, 0x44, 0x44))
        .pos(Pos::new(HPos::Left, VPos::Center));
    let rows = items.iter().filter(|(l, _)| !l.is_empty()).count();
    let y0 = top + rows as i32 * LEGEND_ROW + 8;
    for (i, n) in notes.iter().enumerate() {
        area.draw(&Text::new(
            n.clone(),
            (x, y0 + i as i32 * LEGEND_ROW),
            note_font.clone(),
        ))
        .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks() {
        assert_eq!(
            nice_ticks(0.0, 10.0, 5),
            vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        );
        assert_eq!(log_ticks(1.0, 8.0, 2.0), vec![1.0, 2.0, 4.0, 8.0]);
        assert_eq!(log_ticks(3.0, 5.0, 2.0), vec![4.0]);
        assert_eq!(
            log_ticks(1500.0, 7000.0, 10.0),
            vec![2000.0, 3000.0, 4000.0, 5000.0, 6000.0, 7000.0]
        );
        assert_eq!(
            log_ticks(0.9, 110.0, 10.0),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
        assert_eq!(log_ticks(1.0, 1e9, 10.0).len(), 10);
        assert_eq!(fmt_tick(12345.0), "12.3k");
        assert_eq!(fmt_tick(2.5), "2.5");
        assert_eq!(fmt_tick(4.0), "4");
        assert_eq!(fmt_tick(0.125), "0.125");
        assert_eq!(fmt_tick(2.5e6), "2.5M");
    }

    #[test]
    fn bar_and_line_charts_are_svg_with_their_labels() {
        let svg = bar_chart(&BarChart {
            title: "T & <x>".into(),
            x_desc: "run".into(),
            y_desc: "ms per step".into(),
            bars: vec!["a".into(), "b".into()],
            sublabels: vec!["2 ranks".into()],
            stacks: vec![
                Stack {
                    label: "gemm".into(),
                    color: (1, 2, 3),
                    values: vec![1.0, 2.0],
                },
                Stack {
                    label: "comm".into(),
                    color: (4, 5, 6),
                    values: vec![0.5, f64::NAN],
                },
            ],
            annotations: vec!["1.5 ms".into(), String::new()],
            legend: true,
        })
        .unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        for s in [
            "gemm",
            "comm",
            "1.5 ms",
            "T &amp; &lt;x&gt;",
            "ms per step",
            "2 ranks",
        ] {
            assert!(svg.contains(s), "{s} missing");
        }
        let svg = line_chart(&LineChart {
            title: "scaling".into(),
            x: Axis::log("ranks", 2.0),
            y: Axis::linear("tokens/s", true),
            lines: vec![
                Line {
                    label: "series A".into(),
                    color: (1, 2, 3),
                    style: LineStyle::Markers,
                    points: vec![(1.0, 10.0), (2.0, 19.0), (0.0, 5.0)],
                },
                Line {
                    label: "ideal".into(),
                    color: (9, 9, 9),
                    style: LineStyle::Dashed,
                    points: vec![(1.0, 10.0), (2.0, 20.0)],
                },
            ],
            legend_notes: vec!["note".into()],
        })
        .unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("series A") && svg.contains("ideal") && svg.contains("note"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }
}
