//! SVG plots of a report, drawn with `plotters`' SVG backend:
//!
//! * `ttft_cdf.svg`: the TTFT CDF of every (mode, concurrency) run, one line
//!   each, from the completed requests' samples;
//! * `throughput_ttft.svg`: output throughput and TTFT p50 against
//!   concurrency, baseline vs kvtier;
//! * `energy_per_token.svg`: joules per output token, baseline vs kvtier at
//!   each concurrency (titled "modelled" when the report's energy is).
//!
//! No font is needed, here or in CI: plotters is built without its font
//! features, so it estimates text extents for layout and the SVG carries
//! `<text>` elements that the viewer renders with its own fonts.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

use crate::reporting::report::{BenchReport, Mode, RunSummary};

/// File names of the plots, in the order [`write_plots`] returns them.
pub const PLOT_FILES: [&str; 3] = [
    "ttft_cdf.svg",
    "throughput_ttft.svg",
    "energy_per_token.svg",
];

const CDF_SIZE: (u32, u32) = (900, 600);
const PAIR_SIZE: (u32, u32) = (1200, 500);
const BARS_SIZE: (u32, u32) = (800, 500);

const BASELINE_COLORS: [RGBColor; 4] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];
const KVTIER_COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(23, 190, 207),
    RGBColor(148, 103, 189),
];

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// The color of `mode`'s `index`-th line.
fn color(mode: Mode, index: usize) -> RGBColor {
    let palette = match mode {
        Mode::Baseline => &BASELINE_COLORS,
        Mode::Kvtier => &KVTIER_COLORS,
    };
    palette[index % palette.len()]
}

/// Upper end of an axis showing `values` (never zero-width, never NaN),
/// with `headroom` (a factor) above the largest.
fn axis_max(values: impl IntoIterator<Item = f64>, headroom: f64) -> f64 {
    let m = values
        .into_iter()
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max);
    if m > 0.0 { m * headroom } else { 1.0 }
}

/// Room above the data for the legend box.
const LEGEND_HEADROOM: f64 = 1.25;

/// The distinct concurrencies of the report, ascending.
fn concurrencies(report: &BenchReport) -> Vec<u32> {
    let mut c: Vec<u32> = report.results.iter().map(|r| r.concurrency).collect();
    c.sort_unstable();
    c.dedup();
    c
}

/// The run of `mode` at `concurrency`, if any.
fn run(report: &BenchReport, mode: Mode, concurrency: u32) -> Option<&RunSummary> {
    report
        .results
        .iter()
        .find(|r| r.mode == mode && r.concurrency == concurrency)
}

/// Renders one SVG into a string.
fn render(
    size: (u32, u32),
    draw: impl FnOnce(&Area<'_>) -> Result<(), String>,
) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        draw(&root)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Step points of the empirical CDF of `samples` (sorted here).
fn cdf_points(mut samples: Vec<f64>) -> Vec<(f64, f64)> {
    samples.retain(|v| v.is_finite());
    samples.sort_by(f64::total_cmp);
    let n = samples.len() as f64;
    let mut pts = Vec::with_capacity(samples.len() * 2 + 1);
    if let Some(&first) = samples.first() {
        pts.push((first, 0.0));
    }
    for (i, &t) in samples.iter().enumerate() {
        pts.push((t, i as f64 / n));
        pts.push((t, (i + 1) as f64 / n));
    }
    pts
}

/// The legend label of a run.
fn run_label(r: &RunSummary) -> String {
    format!("{} c={}", r.mode.as_str(), r.concurrency)
}

/// One line of the TTFT CDF.
struct CdfLine {
    label: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

fn draw_ttft_cdf(report: &BenchReport, root: &Area<'_>) -> Result<(), String> {
    let conc = concurrencies(report);
    let mut lines: Vec<CdfLine> = Vec::new();
    for mode in [Mode::Baseline, Mode::Kvtier] {
        for (i, &c) in conc.iter().enumerate() {
            let Some(r) = run(report, mode, c) else {
                continue;
            };
            let ttft: Vec<f64> = r
                .samples
                .iter()
                .filter(|s| s.error.is_none())
                .map(|s| s.ttft_s)
                .collect();
            let points = cdf_points(ttft);
            if !points.is_empty() {
                lines.push(CdfLine {
                    label: run_label(r),
                    color: color(mode, i),
                    points,
                });
            }
        }
    }
    let x_max = axis_max(
        lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)),
        1.05,
    );
    let mut chart = ChartBuilder::on(root)
        .caption(
            "TTFT CDF: baseline (recompute) vs kvtier (restore)",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (s)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(err)?;
    for line in lines {
        let style = line.color.stroke_width(2);
        chart
            .draw_series(LineSeries::new(line.points, style))
            .map_err(err)?
            .label(line.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// One panel of `throughput_ttft.svg`: `metric` against concurrency.
fn draw_vs_concurrency(
    report: &BenchReport,
    area: &Area<'_>,
    caption: &str,
    y_desc: &str,
    metric: fn(&RunSummary) -> f64,
) -> Result<(), String> {
    let conc = concurrencies(report);
    let x_max = conc.iter().copied().max().unwrap_or(1) as f64 * 1.1 + 1.0;
    let y_max = axis_max(report.results.iter().map(metric), LEGEND_HEADROOM);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("concurrency")
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    for mode in [Mode::Baseline, Mode::Kvtier] {
        let pts: Vec<(f64, f64)> = conc
            .iter()
            .filter_map(|&c| run(report, mode, c))
            .map(|r| (f64::from(r.concurrency), metric(r)))
            .filter(|p| p.1.is_finite())
            .collect();
        if pts.is_empty() {
            continue;
        }
        let c = color(mode, 0);
        let style = c.stroke_width(2);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), style))
            .map_err(err)?
            .label(mode.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

fn draw_throughput_ttft(report: &BenchReport, root: &Area<'_>) -> Result<(), String> {
    let panels = root.split_evenly((1, 2));
    let [left, right] = panels.as_slice() else {
        return Err("could not split the drawing area".into());
    };
    draw_vs_concurrency(
        report,
        left,
        "Output throughput vs concurrency",
        "output tokens / s",
        |r| r.throughput_tok_s,
    )?;
    draw_vs_concurrency(
        report,
        right,
        "TTFT p50 vs concurrency",
        "TTFT p50 (s)",
        |r| r.ttft_p50_s,
    )
}

fn draw_energy(report: &BenchReport, root: &Area<'_>) -> Result<(), String> {
    let conc = concurrencies(report);
    // Integer ranges are inclusive here: 0..=last gives one segment per
    // concurrency.
    let last = (conc.len() as u32).saturating_sub(1);
    let caption = if report.energy_modelled {
        "Energy per output token (modelled)".to_string()
    } else {
        format!(
            "Energy per output token (measured: {})",
            report.energy_meter
        )
    };
    let y_max = axis_max(
        report.results.iter().map(|r| r.joules_per_token),
        LEGEND_HEADROOM,
    );
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d((0..last).into_segmented(), 0.0..y_max)
        .map_err(err)?;
    let label_of = |v: &SegmentValue<u32>| match v {
        SegmentValue::CenterOf(i) => conc
            .get(*i as usize)
            .map_or_else(String::new, |c| format!("c={c}")),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(conc.len().max(1))
        .x_label_formatter(&label_of)
        .x_desc("concurrency")
        .y_desc("J / output token")
        .draw()
        .map_err(err)?;
    for mode in [Mode::Baseline, Mode::Kvtier] {
        let c = color(mode, 0);
        let bars: Vec<Rectangle<(SegmentValue<u32>, f64)>> = conc
            .iter()
            .enumerate()
            .filter_map(|(i, &k)| {
                let r = run(report, mode, k)?;
                let v = r.joules_per_token;
                if !v.is_finite() {
                    return None;
                }
                let i = i as u32;
                // The last segment ends at the axis' end (a one-value range
                // cannot place the value after its last).
                let end = if i >= last {
                    SegmentValue::Last
                } else {
                    SegmentValue::Exact(i + 1)
                };
                let (from, to, margins) = match mode {
                    Mode::Baseline => (SegmentValue::Exact(i), SegmentValue::CenterOf(i), (8, 1)),
                    Mode::Kvtier => (SegmentValue::CenterOf(i), end, (1, 8)),
                };
                let mut rect = Rectangle::new([(from, 0.0), (to, v)], c.filled());
                rect.set_margin(0, 0, margins.0, margins.1);
                Some(rect)
            })
            .collect();
        if bars.is_empty() {
            continue;
        }
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(mode.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Writes the report's plots as SVG files into `dir` (created if missing)
/// and returns their paths, in the order of [`PLOT_FILES`]. Failed requests
/// are left out of the TTFT CDF, as they are out of the percentiles.
pub fn write_plots(report: &BenchReport, dir: &Path) -> Result<Vec<PathBuf>, String> {
    if report.results.is_empty() {
        return Err("the report has no results to plot".into());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let svgs = [
        render(CDF_SIZE, |root| draw_ttft_cdf(report, root))?,
        render(PAIR_SIZE, |root| draw_throughput_ttft(report, root))?,
        render(BARS_SIZE, |root| draw_energy(report, root))?,
    ];
    let mut paths = Vec::with_capacity(svgs.len());
    for (name, svg) in PLOT_FILES.iter().zip(svgs) {
        let path = dir.join(name);
        std::fs::write(&path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        paths.push(path);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_steps_from_zero_to_one() {
        let p = cdf_points(vec![2.0, 1.0, f64::NAN]);
        assert_eq!(
            p,
            vec![(1.0, 0.0), (1.0, 0.0), (1.0, 0.5), (2.0, 0.5), (2.0, 1.0)]
        );
        assert!(cdf_points(Vec::new()).is_empty());
    }

    #[test]
    fn axis_max_is_never_empty() {
        assert_eq!(axis_max([0.0, f64::NAN], 1.1), 1.0);
        assert!((axis_max([2.0, 1.0], 1.1) - 2.2).abs() < 1e-12);
    }
}
