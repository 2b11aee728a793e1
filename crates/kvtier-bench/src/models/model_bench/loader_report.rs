//! The model bench's results: the JSON contract and the text table.

use std::fmt::Write as _;

use serde::Serialize;

use crate::common::size::format_size;
use crate::reporting::stats::format_samples;
use crate::reporting::text_report::TextReport;

/// One contender in one mode.
#[derive(Debug, Clone, Serialize)]
pub struct LoaderReport {
    /// `naive`, `mmap`, `kvtier`, `python-safetensors` or `runai-streamer`
    /// (a contract).
    pub name: String,
    /// GB/s (10^9 bytes/s), median over the repeats (a contract).
    pub gbps: f64,
    /// `cold` or `warm`.
    pub mode: String,
    /// GB/s of every repeat, in run order.
    pub samples_gbps: Vec<f64>,
    /// `gbps / device_limit_gbps`.
    pub fraction_of_limit: f64,
    /// Median over the repeats of each sample over the mean of the
    /// device-limit samples taken just before and after it.
    pub paired_fraction: f64,
    /// `gbps / first_touch_gbps`: against the rate one thread can fault
    /// fresh RAM in at (a cap for a loader that faults on one thread;
    /// kvtier's prefault uses several, so it can pass 1).
    pub fraction_of_first_touch: f64,
    /// `gbps` over `naive`'s in the same mode.
    pub ratio_vs_naive: Option<f64>,
    /// `gbps` over `runai-streamer`'s in the same mode, when it ran.
    pub ratio_vs_runai: Option<f64>,
    /// What this contender's mode means for it, where it differs.
    pub note: Option<String>,
}

/// A contender that did not run, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The contender.
    pub name: String,
    /// Why.
    pub reason: String,
}

/// How the kvtier contender read.
#[derive(Debug, Clone, Serialize)]
pub struct KvtierIo {
    /// True when every shard was read with O_DIRECT.
    pub direct: bool,
    /// Why some shard was read buffered.
    pub buffered_reason: Option<String>,
    /// `io_uring` or `threads`.
    pub io_backend: String,
    /// Bytes per read.
    pub chunk_bytes: u64,
    /// Reads in flight.
    pub in_flight: u32,
}

/// The whole result. `device_limit_gbps`, `bytes` and `loaders[].name` /
/// `loaders[].gbps` are a contract.
#[derive(Debug, Clone, Serialize)]
pub struct ModelBenchReport {
    /// Median of every device-limit sample (raw O_DIRECT sequential reads).
    pub device_limit_gbps: f64,
    /// Bytes of one load: the shard files' total length.
    pub bytes: u64,
    /// Every contender that ran, in the first mode measured (cold unless
    /// only warm was asked for).
    pub loaders: Vec<LoaderReport>,
    /// The same in warm-destination mode, when both were measured.
    pub warm_loaders: Vec<LoaderReport>,
    /// Contenders that did not run.
    pub skipped: Vec<Skipped>,
    /// Modes measured, in order.
    pub modes: Vec<String>,
    /// Every device-limit sample, in run order.
    pub device_limit_samples_gbps: Vec<f64>,
    /// First-touch RAM rate (fresh memory faulted in by one thread), median.
    pub first_touch_gbps: f64,
    /// Every first-touch sample (one per repeat and mode).
    pub first_touch_samples_gbps: Vec<f64>,
    /// The model directory.
    pub dir: String,
    /// Number of shard files.
    pub shards: usize,
    /// Number of tensors.
    pub tensors: usize,
    /// Repeats of every contender in every mode.
    pub repeat: u32,
    /// Seconds waited after each drop of the page cache.
    pub settle_secs: f64,
    /// True when the page cache was dropped (or the files evicted) before
    /// every load.
    pub page_cache_cold: bool,
    /// How the page cache was made cold.
    pub page_cache: String,
    /// How the kvtier contender read.
    pub kvtier_io: KvtierIo,
    /// Bytes of each device-limit sample (read from the model's shards).
    pub limit_file_bytes: u64,
    /// Bytes per device-limit read.
    pub limit_io_bytes: u64,
    /// True when the kvtier loader faulted its destination in on a helper
    /// thread while reading (the default; off with `--no-prefault`).
    pub prefault: bool,
}

fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_string(), |x| format!("{x:.2}"))
}

impl TextReport for ModelBenchReport {
    fn table(&self) -> String {
        render_table(self)
    }
}

fn render_table(r: &ModelBenchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvtier model bench: {}, {} in {} shard(s), {} tensors; {} repeat(s), median reported",
        r.dir,
        format_size(r.bytes),
        r.shards,
        r.tensors,
        r.repeat
    );
    let _ = writeln!(
        out,
        "page cache:    {}; then {} s settle before each load",
        r.page_cache, r.settle_secs
    );
    let io = &r.kvtier_io;
    let _ = writeln!(
        out,
        "kvtier reads:  {}, {}, {} reads x {} in flight",
        if io.direct { "O_DIRECT" } else { "buffered" },
        io.io_backend,
        format_size(io.chunk_bytes),
        io.in_flight
    );
    let _ = writeln!(
        out,
        "               destination {}",
        if r.prefault {
            "faulted in by helper threads while the reads run"
        } else {
            "faulted in by the reads themselves (--no-prefault)"
        }
    );
    if let Some(why) = &io.buffered_reason {
        let _ = writeln!(out, "               buffered because: {why}");
    }
    let _ = writeln!(
        out,
        "device limit:  {:.2} GB/s (raw O_DIRECT sequential reads of {} of the shards, {} x 32 in flight, before every load; median of {}: {})",
        r.device_limit_gbps,
        format_size(r.limit_file_bytes),
        format_size(r.limit_io_bytes),
        r.device_limit_samples_gbps.len(),
        format_samples(&r.device_limit_samples_gbps)
    );
    let _ = writeln!(
        out,
        "first touch:   {:.2} GB/s (fresh RAM faulted in by one thread, after the settle; median of {}: {})",
        r.first_touch_gbps,
        r.first_touch_samples_gbps.len(),
        format_samples(&r.first_touch_samples_gbps)
    );
    for s in &r.skipped {
        let _ = writeln!(out, "skipped:       {}: {}", s.name, s.reason);
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<18}  {:<4}  {:>6}  {:>8}  {:>6}  {:>8}  {:>8}  {:>8}  samples GB/s",
        "contender", "mode", "GB/s", "of limit", "paired", "of touch", "vs naive", "vs runai"
    );
    for l in r.loaders.iter().chain(&r.warm_loaders) {
        let _ = writeln!(
            out,
            "{:<18}  {:<4}  {:>6.2}  {:>8.2}  {:>6.2}  {:>8.2}  {:>8}  {:>8}  {}",
            l.name,
            l.mode,
            l.gbps,
            l.fraction_of_limit,
            l.paired_fraction,
            l.fraction_of_first_touch,
            ratio(l.ratio_vs_naive),
            ratio(l.ratio_vs_runai),
            format_samples(&l.samples_gbps)
        );
    }
    let notes: Vec<String> = r
        .loaders
        .iter()
        .chain(&r.warm_loaders)
        .filter_map(|l| {
            l.note
                .as_ref()
                .map(|n| format!("{} ({}): {n}", l.name, l.mode))
        })
        .collect();
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "cold: page cache dropped, freed RAM settled, fresh destination memory; warm: page"
    );
    let _ = writeln!(
        out,
        "cache dropped, destination memory touched before timing. of limit: GB/s over the"
    );
    let _ = writeln!(
        out,
        "median device limit; paired: over the limit samples just before and after each"
    );
    let _ = writeln!(
        out,
        "load; of touch: over the one-thread first-touch rate (a cap for a loader that"
    );
    let _ = writeln!(
        out,
        "faults fresh RAM in on one thread; kvtier's prefault uses several)."
    );
    for n in notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}
