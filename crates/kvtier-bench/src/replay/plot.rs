//! The replay's plots: hit rate and TTFT p50 over the replay (per window,
//! the restart marked), and each server's TTFT CDF.

use std::path::{Path, PathBuf};

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::report::ReplayReport;

/// Writes `over_time.svg` and `ttft_cdf.svg` into `dir`.
pub(super) fn write_all(report: &ReplayReport, dir: &Path) -> Result<Vec<PathBuf>, String> {
    let over = dir.join("over_time.svg");
    over_time(report, &over)?;
    let cdf = dir.join("ttft_cdf.svg");
    ttft_cdf(report, &cdf)?;
    Ok(vec![over, cdf])
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Run `i`'s line, in its colour, with its legend entry.
fn run_line(
    chart: &mut Chart<'_, '_>,
    points: Vec<(f64, f64)>,
    i: usize,
    name: String,
) -> Result<(), String> {
    let color = Palette99::pick(i).to_rgba();
    chart
        .draw_series(LineSeries::new(points, color.stroke_width(2)))
        .map_err(|x| x.to_string())?
        .label(name)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    Ok(())
}

fn label(report: &ReplayReport, i: usize) -> String {
    let r = &report.runs[i];
    format!("{} ({})", r.mode.as_str(), r.server)
}

fn over_time(report: &ReplayReport, path: &Path) -> Result<(), String> {
    let e = |x: &dyn std::fmt::Display| format!("cannot draw {}: {x}", path.display());
    let root = SVGBackend::new(path, (960, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (top, bottom) = root.split_vertically(360);
    let n = report.settings.requests.max(1) as f64;
    let restart = report.settings.restart_after_requests.map(|k| k as f64);
    let ttft_max = report
        .runs
        .iter()
        .flat_map(|r| r.windows.iter().map(|w| w.ttft_p50_s))
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.15;
    for (area, title, y_max, y_desc) in [
        (
            &top,
            "hit rate per window",
            100.0,
            "hit rate (% of prompt tokens)",
        ),
        (&bottom, "TTFT p50 per window", ttft_max, "TTFT p50 (s)"),
    ] {
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{}: {title}", report.trace), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..n, 0.0..y_max)
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("request (cut order)")
            .y_desc(y_desc)
            .draw()
            .map_err(|x| e(&x))?;
        let hit = title.starts_with("hit");
        for (i, r) in report.runs.iter().enumerate() {
            let points: Vec<(f64, f64)> = r
                .windows
                .iter()
                .map(|w| {
                    let x = w.first_request as f64 + w.requests as f64 / 2.0;
                    (
                        x,
                        if hit {
                            w.hit_rate * 100.0
                        } else {
                            w.ttft_p50_s
                        },
                    )
                })
                .collect();
            run_line(&mut chart, points, i, label(report, i)).map_err(|x| e(&x))?;
        }
        if let Some(k) = restart {
            chart
                .draw_series(LineSeries::new(
                    vec![(k, 0.0), (k, y_max)],
                    BLACK.mix(0.6).stroke_width(1),
                ))
                .map_err(|x| e(&x))?
                .label("restart")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.mix(0.6)));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))
}

fn ttft_cdf(report: &ReplayReport, path: &Path) -> Result<(), String> {
    let e = |x: &dyn std::fmt::Display| format!("cannot draw {}: {x}", path.display());
    let max = report
        .ttfts
        .iter()
        .flatten()
        .copied()
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.05;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{}: TTFT CDF", report.trace), ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..max, 0.0..1.0)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("TTFT (s)")
        .y_desc("share of answered requests")
        .draw()
        .map_err(|x| e(&x))?;
    for (i, ttfts) in report.ttfts.iter().enumerate() {
        let mut v = ttfts.clone();
        v.sort_by(f64::total_cmp);
        let len = v.len().max(1) as f64;
        let points: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .map(|(k, &t)| (t, (k + 1) as f64 / len))
            .collect();
        run_line(&mut chart, points, i, label(report, i)).map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}
