//! The checkpoint bench's results: the JSON contract and the text table.

use std::fmt::Write as _;

use serde::Serialize;

use crate::common::size::format_size;
use crate::reporting::stats::format_samples;
use crate::reporting::text_report::TextReport;

/// One writer's result.
#[derive(Debug, Clone, Serialize)]
pub struct WriterReport {
    /// `naive` or `kvtier` (a contract).
    pub name: String,
    /// Tensor bytes per second made durable, GB/s, median (a contract).
    pub gbps: f64,
    /// True when the save returned only once every byte was durable (a
    /// contract).
    pub durable: bool,
    /// True when a crash at any moment leaves the old or the new checkpoint
    /// complete, never a mix.
    pub crash_consistent: bool,
    /// GB/s of every repeat, in run order.
    pub samples_gbps: Vec<f64>,
    /// `gbps / device_write_limit_gbps`.
    pub fraction_of_limit: f64,
    /// Median over the repeats of each sample over the mean of the write
    /// limit samples just before and after it.
    pub paired_fraction: f64,
    /// `gbps` over `naive`'s.
    pub ratio_vs_naive: f64,
    /// Bytes of the files written (headers and alignment padding included).
    pub file_bytes: u64,
    /// Files written per save.
    pub files: usize,
    /// True when the data was written with O_DIRECT.
    pub direct: bool,
    /// Bytes the writer wrote straight from the tensors' memory, with no
    /// copy (last save; always 0 for `naive`).
    pub borrowed_bytes: u64,
}

/// The whole result; `device_write_limit_gbps`, `bytes` and `writers` are a
/// contract.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointBenchReport {
    /// Median of every device write-limit sample.
    pub device_write_limit_gbps: f64,
    /// Bytes of tensor data per save.
    pub bytes: u64,
    /// Where the tensors start: `page-aligned`, or `64 bytes past a page`
    /// (`--unaligned`).
    pub tensor_memory: String,
    /// `naive` and `kvtier`.
    pub writers: Vec<WriterReport>,
    /// Every write-limit sample, in run order.
    pub device_write_limit_samples_gbps: Vec<f64>,
    /// Bytes of each write-limit sample.
    pub write_limit_file_bytes: u64,
    /// Bytes per write of the write-limit samples.
    pub write_limit_io_bytes: u64,
    /// First-touch RAM rate (fresh memory faulted in by one thread), median.
    pub first_touch_gbps: f64,
    /// Tensors per save.
    pub tensors: usize,
    /// Target tensor bytes per shard.
    pub shard_bytes: u64,
    /// Repeats of each writer.
    pub repeat: u32,
    /// Seconds waited after each page-cache drop.
    pub settle_secs: f64,
    /// How the page cache was dropped.
    pub page_cache: String,
    /// The kvtier writer's settings.
    pub kvtier_chunk_bytes: u64,
    /// Writes the kvtier writer keeps in flight.
    pub kvtier_in_flight: usize,
    /// Threads gathering chunks for the kvtier writer (and fsyncing files).
    pub kvtier_threads: usize,
    /// Why the kvtier writer did not use O_DIRECT, when it did not.
    pub kvtier_direct_reason: Option<String>,
    /// The bench directory.
    pub dir: String,
}

impl TextReport for CheckpointBenchReport {
    fn table(&self) -> String {
        render_table(self)
    }
}

fn render_table(r: &CheckpointBenchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvtier checkpoint bench: {} of tensors ({} tensors, shards of up to {}), {} repeat(s), median reported",
        format_size(r.bytes),
        r.tensors,
        format_size(r.shard_bytes),
        r.repeat
    );
    let _ = writeln!(out, "dir:                {}", r.dir);
    let _ = writeln!(out, "tensor memory:      each tensor {}", r.tensor_memory);
    let _ = writeln!(
        out,
        "page cache:         {}; then {} s settle before each save",
        r.page_cache, r.settle_secs
    );
    let _ = writeln!(
        out,
        "kvtier writer:      {} writes x {} in flight, {} gather thread(s){}",
        format_size(r.kvtier_chunk_bytes),
        r.kvtier_in_flight,
        r.kvtier_threads,
        r.kvtier_direct_reason
            .as_ref()
            .map_or_else(String::new, |w| format!(", buffered: {w}"))
    );
    let _ = writeln!(
        out,
        "device write limit: {:.2} GB/s (raw O_DIRECT sequential write of a new {} file, {} x 32 in flight, then fdatasync; median of {}: {})",
        r.device_write_limit_gbps,
        format_size(r.write_limit_file_bytes),
        format_size(r.write_limit_io_bytes),
        r.device_write_limit_samples_gbps.len(),
        format_samples(&r.device_write_limit_samples_gbps)
    );
    let _ = writeln!(
        out,
        "first touch:        {:.2} GB/s (fresh RAM faulted in by one thread)",
        r.first_touch_gbps
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<7}  {:>6}  {:>8}  {:>6}  {:>8}  {:>7}  {:>10}  {:>6}  samples GB/s",
        "writer", "GB/s", "of limit", "paired", "vs naive", "durable", "crash-safe", "direct"
    );
    for w in &r.writers {
        let _ = writeln!(
            out,
            "{:<7}  {:>6.2}  {:>8.2}  {:>6.2}  {:>8.2}  {:>7}  {:>10}  {:>6}  {}",
            w.name,
            w.gbps,
            w.fraction_of_limit,
            w.paired_fraction,
            w.ratio_vs_naive,
            if w.durable { "yes" } else { "no" },
            if w.crash_consistent { "yes" } else { "no" },
            if w.direct { "yes" } else { "no" },
            format_samples(&w.samples_gbps)
        );
    }
    for w in r.writers.iter().filter(|w| w.name == "kvtier") {
        let _ = writeln!(
            out,
            "kvtier wrote {} of the {} of tensors straight from their memory (no copy)",
            format_size(w.borrowed_bytes),
            format_size(r.bytes)
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "GB/s: tensor bytes over the time from the call until every file and the directory are"
    );
    let _ = writeln!(
        out,
        "fsynced (kvtier: manifest committed). of limit: over the median write limit; paired: over"
    );
    let _ = writeln!(
        out,
        "the write-limit samples just before and after each save."
    );
    out
}
