use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::{Bundle, Render};

static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

fn ensure_font() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // The font is bundled and valid: registration can only fail on bad bytes.
        let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("chart `{title}` has no data to draw")]
    Empty { title: String },
    #[error("drawing chart `{title}` failed: {message}")]
    Draw { title: String, message: String },
}

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeriesKind {
    /// Points joined by lines, with markers.
    Line,
    /// One bar per point, centred on x.
    Bars,
    /// Bars stacked on those of earlier stacked series at the same x.
    Stacked,
    /// A horizontal rule at the first point's y (a limit, such as a card's memory).
    Limit,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub kind: SeriesKind,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn line(name: impl Into<String>, points: impl IntoIterator<Item = (f64, f64)>) -> Self {
        Series { name: name.into(), kind: SeriesKind::Line, points: points.into_iter().collect() }
    }

    pub fn bars(name: impl Into<String>, points: impl IntoIterator<Item = (f64, f64)>) -> Self {
        Series { name: name.into(), kind: SeriesKind::Bars, points: points.into_iter().collect() }
    }

    /// A segment of a stacked bar: put the series in bottom-to-top order.
    pub fn stacked(name: impl Into<String>, points: impl IntoIterator<Item = (f64, f64)>) -> Self {
        Series { name: name.into(), kind: SeriesKind::Stacked, points: points.into_iter().collect() }
    }

    pub fn limit(name: impl Into<String>, y: f64) -> Self {
        Series { name: name.into(), kind: SeriesKind::Limit, points: vec![(0.0, y)] }
    }
}

/// An x/y chart rendered to SVG with plotters.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    title: String,
    x_label: String,
    y_label: String,
    size: (u32, u32),
    x_ticks: bool,
    series: Vec<Series>,
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

impl Chart {
    pub fn new(title: impl Into<String>) -> Self {
        Chart { title: title.into(), x_label: String::new(), y_label: String::new(), size: (640, 360), x_ticks: true, series: Vec::new() }
    }

    pub fn x_label(mut self, label: impl Into<String>) -> Self {
        self.x_label = label.into();
        self
    }

    pub fn y_label(mut self, label: impl Into<String>) -> Self {
        self.y_label = label.into();
        self
    }

    pub fn size(mut self, width: u32, height: u32) -> Self {
        self.size = (width, height);
        self
    }

    /// Leaves the x axis without numbers, for a single category of bars.
    pub fn hide_x_ticks(mut self) -> Self {
        self.x_ticks = false;
        self
    }

    pub fn series(mut self, series: Series) -> Self {
        self.series.push(series);
        self
    }

    fn ranges(&self) -> Option<((f64, f64), (f64, f64))> {
        let data = self.series.iter().filter(|s| s.kind != SeriesKind::Limit).flat_map(|s| &s.points);
        let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY);
        let mut y0 = 0.0f64;
        for &(x, y) in data {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        for (_, top) in self.stack_tops() {
            y1 = y1.max(top);
        }
        for s in self.series.iter().filter(|s| s.kind == SeriesKind::Limit) {
            if let Some(&(_, y)) = s.points.first() {
                y1 = y1.max(y);
            }
        }
        if !x0.is_finite() || !y1.is_finite() {
            return None;
        }
        let has_bars = self.series.iter().any(|s| matches!(s.kind, SeriesKind::Bars | SeriesKind::Stacked));
        let pad = if has_bars || x0 == x1 { 0.5 * self.bar_width().max(1e-9) + if x0 == x1 { 0.5 } else { 0.0 } } else { 0.0 };
        let top = if y1 > y0 { y1 + 0.08 * (y1 - y0) } else { y0 + 1.0 };
        Some(((x0 - pad, x1 + pad), (y0, top)))
    }

    fn bar_width(&self) -> f64 {
        let mut xs: Vec<f64> = self
            .series
            .iter()
            .filter(|s| matches!(s.kind, SeriesKind::Bars | SeriesKind::Stacked))
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let gap = xs.windows(2).map(|w| w[1] - w[0]).fold(f64::INFINITY, f64::min);
        if gap.is_finite() {
            0.8 * gap
        } else {
            0.8
        }
    }

    /// The height of each stacked column, by x.
    fn stack_tops(&self) -> Vec<(f64, f64)> {
        let mut tops: Vec<(f64, f64)> = Vec::new();
        for &(x, y) in self.series.iter().filter(|s| s.kind == SeriesKind::Stacked).flat_map(|s| &s.points) {
            match tops.iter_mut().find(|(at, _)| *at == x) {
                Some((_, top)) => *top += y,
                None => tops.push((x, y)),
            }
        }
        tops
    }

    /// The chart as an SVG document.
    pub fn to_svg(&self) -> Result<String, ChartError> {
        ensure_font();
        let ((x0, x1), (y0, y1)) = self.ranges().ok_or_else(|| ChartError::Empty { title: self.title.clone() })?;
        let draw_err = |e: &dyn std::fmt::Display| ChartError::Draw { title: self.title.clone(), message: e.to_string() };
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, self.size).into_drawing_area();
            root.fill(&WHITE).map_err(|e| draw_err(&e))?;
            let mut chart = ChartBuilder::on(&root)
                .caption(&self.title, ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(64)
                .build_cartesian_2d(x0..x1, y0..y1)
                .map_err(|e| draw_err(&e))?;
            let mut mesh = chart.configure_mesh();
            mesh.x_desc(&self.x_label).y_desc(&self.y_label).label_style(("sans-serif", 12));
            if !self.x_ticks {
                mesh.x_labels(0).disable_x_mesh();
            }
            mesh.draw().map_err(|e| draw_err(&e))?;
            let half = self.bar_width() / 2.0;
            let mut stacked: Vec<(f64, f64)> = Vec::new();
            for (i, series) in self.series.iter().enumerate() {
                let color = PALETTE[i % PALETTE.len()];
                let drawn = match series.kind {
                    SeriesKind::Line => {
                        chart.draw_series(LineSeries::new(series.points.iter().copied(), color.stroke_width(2)).point_size(3))
                    }
                    SeriesKind::Bars => chart.draw_series(
                        series.points.iter().map(|&(x, y)| Rectangle::new([(x - half, 0.0), (x + half, y)], color.mix(0.8).filled())),
                    ),
                    SeriesKind::Stacked => {
                        let rects: Vec<_> = series
                            .points
                            .iter()
                            .map(|&(x, y)| {
                                let base = match stacked.iter_mut().find(|(at, _)| *at == x) {
                                    Some((_, top)) => std::mem::replace(top, *top + y),
                                    None => {
                                        stacked.push((x, y));
                                        0.0
                                    }
                                };
                                Rectangle::new([(x - half, base), (x + half, base + y)], color.filled())
                            })
                            .collect();
                        chart.draw_series(rects)
                    }
                    SeriesKind::Limit => {
                        let y = series.points[0].1;
                        chart.draw_series(LineSeries::new([(x0, y), (x1, y)], RED.stroke_width(2)))
                    }
                }
                .map_err(|e| draw_err(&e))?;
                let legend_color = if series.kind == SeriesKind::Limit { RED } else { color };
                drawn.label(series.name.clone()).legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], legend_color.filled()));
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 12))
                .draw()
                .map_err(|e| draw_err(&e))?;
            root.present().map_err(|e| draw_err(&e))?;
        }
        Ok(svg)
    }

    fn describe(&self) -> String {
        let mut text = format!("{} ({} vs {})", self.title, self.y_label, self.x_label);
        for series in &self.series {
            let points: Vec<String> = series.points.iter().map(|(x, y)| format!("({x}, {y})")).collect();
            text.push_str(&format!("\n  {}: {}", series.name, points.join(" ")));
        }
        text
    }

    /// Shows the chart in a notebook cell's result.
    pub fn evcxr_display(&self) {
        self.bundle().print_as_cell_result();
    }
}

impl Render for Chart {
    fn bundle(&self) -> Bundle {
        let text = self.describe();
        match self.to_svg() {
            Ok(svg) => Bundle::plain(text).with("image/svg+xml", svg),
            Err(err) => Bundle::plain(format!("{text}\n({err})")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_lines_bars_and_limits_with_text() {
        let chart = Chart::new("peak memory vs batch")
            .x_label("batch")
            .y_label("GiB")
            .series(Series::line("predicted", [(8.0, 2.0), (16.0, 3.5), (32.0, 6.5)]))
            .series(Series::bars("measured", [(8.0, 2.1), (16.0, 3.4), (32.0, 6.6)]))
            .series(Series::limit("card (8 GiB)", 8.0));
        let svg = chart.to_svg().unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("peak memory vs batch"));
        assert!(svg.contains("card (8 GiB)"));
        assert!(svg.matches("<rect").count() >= 3);
    }

    #[test]
    fn stacked_series_pile_up_and_set_the_height() {
        let chart = Chart::new("bills")
            .hide_x_ticks()
            .series(Series::stacked("parameters", [(1.0, 1.0)]))
            .series(Series::stacked("activations", [(1.0, 6.0)]))
            .series(Series::limit("card", 8.0));
        assert_eq!(chart.stack_tops(), vec![(1.0, 7.0)]);
        let ((_, _), (_, top)) = chart.ranges().unwrap();
        assert!(top >= 8.0);
        let svg = chart.to_svg().unwrap();
        assert!(svg.contains("activations"));
    }

    #[test]
    fn empty_chart_is_an_error_that_names_it() {
        let err = Chart::new("nothing").to_svg().unwrap_err();
        assert_eq!(err.to_string(), "chart `nothing` has no data to draw");
        assert!(Chart::new("nothing").bundle().text().contains("no data"));
    }
}
