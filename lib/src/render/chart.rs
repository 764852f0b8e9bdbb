use std::sync::Once;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
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

const MARGIN: u32 = 12;
const TITLE_SIZE: f64 = 16.0;
const TITLE_LINE: u32 = 20;
const LEGEND_SIZE: f64 = 12.0;
const LEGEND_LINE: u32 = 18;
/// Average advance of a DejaVu Sans character, in font sizes (generous, so that text fits).
const CHAR_WIDTH: f64 = 0.6;
/// Lines of more points than this are drawn without markers.
const MARKED_POINTS: usize = 60;

/// An axis label: `20`, not `20.0`; `2.5` and `0.3` as they are.
fn tick(value: f64) -> String {
    let rounded = (value * 1e6).round() / 1e6;
    if rounded.fract() == 0.0 {
        format!("{rounded:.0}")
    } else {
        format!("{rounded}")
    }
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

    /// The chart as an SVG document: the title wrapped above the plot, the
    /// legend in rows below it, where it cannot hide the data.
    pub fn to_svg(&self) -> Result<String, ChartError> {
        ensure_font();
        let ((x0, x1), (y0, y1)) = self.ranges().ok_or_else(|| ChartError::Empty { title: self.title.clone() })?;
        let draw_err = |e: &dyn std::fmt::Display| ChartError::Draw { title: self.title.clone(), message: e.to_string() };
        let (width, height) = self.size;
        let title = textwrap::wrap(&self.title, ((width.saturating_sub(2 * MARGIN)) as f64 / (TITLE_SIZE * CHAR_WIDTH)) as usize);
        let title_height = title.len() as u32 * TITLE_LINE + MARGIN;
        let legend = self.legend_rows(width.saturating_sub(2 * MARGIN));
        let legend_height = if legend.is_empty() { 0 } else { legend.len() as u32 * LEGEND_LINE + MARGIN };
        let total = (width, height + legend_height + title_height.saturating_sub(TITLE_LINE + MARGIN));
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, total).into_drawing_area();
            root.fill(&WHITE).map_err(|e| draw_err(&e))?;
            let (title_area, rest) = root.split_vertically(title_height);
            let (plot_area, legend_area) = rest.split_vertically(total.1 - title_height - legend_height);
            for (i, line) in title.iter().enumerate() {
                let style = TextStyle::from(("sans-serif", TITLE_SIZE).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
                let at = ((width / 2) as i32, (MARGIN / 2 + i as u32 * TITLE_LINE) as i32);
                title_area.draw(&Text::new(line.to_string(), at, style)).map_err(|e| draw_err(&e))?;
            }
            let mut chart = ChartBuilder::on(&plot_area)
                .margin(MARGIN)
                .x_label_area_size(36)
                .y_label_area_size(64)
                .build_cartesian_2d(x0..x1, y0..y1)
                .map_err(|e| draw_err(&e))?;
            let mut mesh = chart.configure_mesh();
            let tick_label = |v: &f64| tick(*v);
            mesh.x_desc(&self.x_label).y_desc(&self.y_label).label_style(("sans-serif", 12));
            mesh.x_label_formatter(&tick_label).y_label_formatter(&tick_label);
            if self.integer_x() {
                // At most one label per whole number, so that none falls between two.
                mesh.x_labels(((x1 - x0).floor() as usize + 1).clamp(2, 10));
            }
            if !self.x_ticks {
                mesh.x_labels(0).disable_x_mesh();
            }
            mesh.draw().map_err(|e| draw_err(&e))?;
            let half = self.bar_width() / 2.0;
            let mut stacked: Vec<(f64, f64)> = Vec::new();
            for (i, series) in self.series.iter().enumerate() {
                let color = self.color(i);
                match series.kind {
                    SeriesKind::Line => {
                        // A marker per point helps to read a few points, and hides the line under a thousand.
                        let marker = if series.points.len() > MARKED_POINTS { 0 } else { 3 };
                        chart.draw_series(LineSeries::new(series.points.iter().copied(), color.stroke_width(2)).point_size(marker))
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
                        chart.draw_series(LineSeries::new([(x0, y), (x1, y)], color.stroke_width(2)))
                    }
                }
                .map_err(|e| draw_err(&e))?;
            }
            for (row, items) in legend.iter().enumerate() {
                let y = (row as u32 * LEGEND_LINE + LEGEND_LINE / 2) as i32;
                let mut x = MARGIN as i32;
                for &(i, item_width) in items {
                    let series = &self.series[i];
                    let color = self.color(i);
                    let swatch = match series.kind {
                        SeriesKind::Line | SeriesKind::Limit => Rectangle::new([(x, y - 1), (x + 14, y + 1)], color.filled()),
                        SeriesKind::Bars | SeriesKind::Stacked => Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()),
                    };
                    legend_area.draw(&swatch).map_err(|e| draw_err(&e))?;
                    let style = TextStyle::from(("sans-serif", LEGEND_SIZE).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
                    legend_area.draw(&Text::new(series.name.clone(), (x + 20, y), style)).map_err(|e| draw_err(&e))?;
                    x += item_width as i32;
                }
            }
            root.present().map_err(|e| draw_err(&e))?;
        }
        Ok(svg)
    }

    fn color(&self, index: usize) -> RGBColor {
        if self.series[index].kind == SeriesKind::Limit {
            RED
        } else {
            PALETTE[index % PALETTE.len()]
        }
    }

    /// Whether every x is a whole number (batches, steps, pixels).
    fn integer_x(&self) -> bool {
        self.series.iter().filter(|s| s.kind != SeriesKind::Limit).flat_map(|s| &s.points).all(|&(x, _)| x.fract() == 0.0)
    }

    /// The legend's items (series index, width in pixels) in rows that fit `width`.
    fn legend_rows(&self, width: u32) -> Vec<Vec<(usize, u32)>> {
        let mut rows: Vec<Vec<(usize, u32)>> = Vec::new();
        let mut used = 0;
        for (i, series) in self.series.iter().enumerate().filter(|(_, s)| !s.name.is_empty()) {
            let item = 20 + (series.name.chars().count() as f64 * LEGEND_SIZE * CHAR_WIDTH) as u32 + 18;
            match rows.last_mut() {
                Some(row) if used + item <= width => row.push((i, item)),
                _ => {
                    rows.push(vec![(i, item)]);
                    used = 0;
                }
            }
            used += item;
        }
        rows
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
    fn whole_numbers_are_labelled_as_integers() {
        assert_eq!([tick(20.0), tick(2.5), tick(0.1 + 0.2), tick(-3.0)], ["20", "2.5", "0.3", "-3"]);
        let svg = Chart::new("steps").series(Series::line("loss", [(1.0, 20.0), (2.0, 40.0), (3.0, 60.0)])).to_svg().unwrap();
        let labels: Vec<&str> = svg.split("</text>").filter_map(|t| t.rsplit('>').next()).map(str::trim).collect();
        assert!(["1", "2", "3", "20", "40"].iter().all(|l| labels.contains(l)), "{labels:?}");
        assert!(!labels.iter().any(|l| l.ends_with(".0") || *l == "1.5"), "{labels:?}");
    }

    #[test]
    fn the_legend_and_a_long_title_sit_outside_the_plot() {
        let title = "a title long enough that at 640 pixels it has to wrap onto a second line of its own";
        let names =
            ["measured: parameters", "measured: optimizer state", "measured: activations", "predicted peak since the previous sample"];
        let mut chart = Chart::new(title).size(640, 360);
        for (i, name) in names.iter().enumerate() {
            chart = chart.series(Series::line(*name, [(1.0, i as f64), (2.0, i as f64 + 1.0)]));
        }
        let rows = chart.legend_rows(640 - 2 * MARGIN);
        assert!(rows.len() >= 2 && rows.iter().flatten().count() == names.len(), "{rows:?}");
        let svg = chart.to_svg().unwrap();
        let height: u32 = svg.split("height=\"").nth(1).and_then(|h| h.split('"').next()).unwrap().parse().unwrap();
        assert_eq!(
            height,
            360 + rows.len() as u32 * LEGEND_LINE + MARGIN + TITLE_LINE,
            "the legend and the title's second line add height"
        );
        assert!(svg.contains("a title long enough") && svg.contains("second line of its own"));
    }

    #[test]
    fn long_lines_have_no_markers() {
        let short = Chart::new("few").series(Series::line("loss", (0..10).map(|i| (i as f64, 1.0))));
        let long = Chart::new("many").series(Series::line("loss", (0..1000).map(|i| (i as f64, 1.0))));
        assert!(short.to_svg().unwrap().matches("<circle").count() >= 10);
        assert_eq!(long.to_svg().unwrap().matches("<circle").count(), 0);
    }

    #[test]
    fn empty_chart_is_an_error_that_names_it() {
        let err = Chart::new("nothing").to_svg().unwrap_err();
        assert_eq!(err.to_string(), "chart `nothing` has no data to draw");
        assert!(Chart::new("nothing").bundle().text().contains("no data"));
    }
}
