//! The report's SVG plots: written, valid SVG, labelled.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use kvtier_bench::reporting::plot::{PLOT_FILES, write_plots};
use kvtier_bench::reporting::report::RequestRecord;
use kvtier_bench::{BenchReport, Mode, RunSummary};

fn run(mode: Mode, concurrency: u32, scale: f64) -> RunSummary {
    let mut samples: Vec<RequestRecord> = (0..8)
        .map(|i| RequestRecord {
            session: i,
            ttft_s: scale * (1.0 + i as f64 * 0.25),
            e2e_s: scale * (2.0 + i as f64 * 0.25),
            prompt_tokens: 800,
            output_tokens: 8,
            ..Default::default()
        })
        .collect();
    samples.push(RequestRecord {
        session: 8,
        ttft_s: 1e6,
        error: Some("connection reset".into()),
        ..Default::default()
    });
    RunSummary {
        concurrency,
        mode,
        ttft_p50_s: scale * 1.9,
        ttft_p99_s: scale * 2.7,
        throughput_tok_s: 40.0 / scale * f64::from(concurrency).sqrt(),
        joules_per_token: 3.0 * scale,
        requests: 8,
        failed: 1,
        samples,
        ..Default::default()
    }
}

fn report(modelled: bool) -> BenchReport {
    let mut results = Vec::new();
    for c in [1, 8, 16] {
        results.push(run(Mode::Baseline, c, 4.0));
        results.push(run(Mode::Kvtier, c, 0.5));
    }
    BenchReport {
        workload: "cold-recovery".into(),
        target: "synthetic".into(),
        results,
        energy_meter: if modelled {
            "model (modelled)".into()
        } else {
            "rapl".into()
        },
        energy_modelled: modelled,
        ..Default::default()
    }
}

fn read_svg(path: &Path) -> String {
    let svg = std::fs::read_to_string(path).unwrap();
    let head = svg.trim_start();
    assert!(
        head.starts_with("<svg") || head.starts_with("<?xml"),
        "{} is not SVG: {:.80}",
        path.display(),
        head
    );
    assert!(
        svg.trim_end().ends_with("</svg>"),
        "{} is cut short",
        path.display()
    );
    svg
}

#[test]
fn plots_are_written_as_labelled_svg() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("nested").join("plots");
    let paths = write_plots(&report(true), &dir).unwrap();
    assert_eq!(paths.len(), 3);
    for (path, name) in paths.iter().zip(PLOT_FILES) {
        assert_eq!(path, &dir.join(name));
        assert!(std::fs::metadata(path).unwrap().len() > 500);
    }

    let cdf = read_svg(&paths[0]);
    for c in [1, 8, 16] {
        for mode in ["baseline", "kvtier"] {
            let label = format!("{mode} c={c}");
            assert!(cdf.contains(&label), "TTFT CDF lacks {label}");
        }
    }
    assert!(cdf.contains("TTFT CDF"));

    let pair = read_svg(&paths[1]);
    for text in [
        "baseline",
        "kvtier",
        "Output throughput vs concurrency",
        "TTFT p50 vs concurrency",
        "concurrency",
    ] {
        assert!(pair.contains(text), "throughput/TTFT plot lacks {text:?}");
    }

    let energy = read_svg(&paths[2]);
    for text in [
        "baseline",
        "kvtier",
        "modelled",
        "c=1",
        "c=8",
        "c=16",
        "J / output token",
    ] {
        assert!(energy.contains(text), "energy plot lacks {text:?}");
    }
}

#[test]
fn measured_energy_is_not_titled_modelled_and_names_its_meter() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write_plots(&report(false), tmp.path()).unwrap();
    let energy = read_svg(&paths[2]);
    assert!(energy.contains("measured: rapl"));
    assert!(!energy.contains("modelled"));
}

#[test]
fn one_mode_only_or_no_completed_request_still_plots() {
    let tmp = tempfile::tempdir().unwrap();
    let mut r = report(true);
    r.results.retain(|s| s.mode == Mode::Kvtier);
    for s in &mut r.results {
        for x in &mut s.samples {
            x.error = Some("refused".into());
        }
    }
    let paths = write_plots(&r, tmp.path()).unwrap();
    for p in &paths {
        read_svg(p);
    }
    assert!(
        !read_svg(&paths[0]).contains("kvtier c=1"),
        "no completed request: no line"
    );
    assert!(read_svg(&paths[1]).contains("kvtier"));
}

#[test]
fn an_empty_report_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let e = write_plots(&BenchReport::default(), tmp.path()).unwrap_err();
    assert!(e.contains("no results"), "{e}");
}

#[test]
fn a_single_concurrency_plots() {
    let tmp = tempfile::tempdir().unwrap();
    let mut r = report(false);
    r.results.retain(|s| s.concurrency == 8);
    let paths = write_plots(&r, tmp.path()).unwrap();
    assert!(read_svg(&paths[0]).contains("kvtier c=8"));
    assert!(read_svg(&paths[2]).contains("c=8"));
}
