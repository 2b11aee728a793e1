//! The hit-rate curve plot of `kvtier trace sim --plot`: hit rate against
//! capacity (log x), one line per policy.

use std::path::Path;

use plotters::prelude::*;

use crate::sim::Point;

/// Writes the SVG.
pub fn write(path: &Path, title: &str, points: &[Point]) -> Result<(), String> {
    let mut policies: Vec<&str> = Vec::new();
    for p in points {
        if !policies.contains(&p.policy.as_str()) {
            policies.push(&p.policy);
        }
    }
    let min = points
        .iter()
        .map(|p| p.capacity_blocks)
        .min()
        .unwrap_or(1)
        .max(1) as f64;
    let max = points
        .iter()
        .map(|p| p.capacity_blocks)
        .max()
        .unwrap_or(1)
        .max(2) as f64;
    let top = points
        .iter()
        .map(|p| p.hit_rate_tokens * 100.0)
        .fold(1.0, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((min * 0.9..max * 1.1).log_scale(), 0.0..top.min(100.0))
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("capacity (blocks, log scale)")
        .y_desc("hit rate (% of measured prompt tokens)")
        .draw()
        .map_err(|x| e(&x))?;
    for (i, policy) in policies.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut line: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.policy == *policy)
            .map(|p| (p.capacity_blocks as f64, p.hit_rate_tokens * 100.0))
            .collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(*policy)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
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
