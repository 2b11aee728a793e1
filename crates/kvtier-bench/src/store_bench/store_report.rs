//! The G3 store bench's results: the JSON contract and the text table.

use std::fmt::Write as _;

use serde::Serialize;

use crate::common::size::format_size;
use crate::reporting::stats::format_samples;
use crate::reporting::text_report::TextReport;

/// One in-flight case of the store bench.
#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    /// Reads in flight.
    pub in_flight: u32,
    /// Bytes of one block (= one slot).
    pub block_bytes: u64,
    /// Median GB/s (10^9 bytes/s) over the repeats.
    pub gbps: f64,
    /// `gbps / device_limit_gbps`.
    pub fraction_of_limit: f64,
    /// GB/s of every repeat, in run order.
    pub samples_gbps: Vec<f64>,
    /// Median over the repeats of each sample divided by the mean of the two
    /// device-limit samples taken just before and just after it: robust to
    /// the device drifting during the run.
    pub paired_fraction: f64,
    /// Blocks per store read call.
    pub chunk_blocks: u32,
    /// Share of the read time spent inside the I/O engine (the rest is
    /// checksum verification and bookkeeping on the calling thread), median
    /// over the repeats.
    pub io_time_fraction: f64,
}

/// The whole store bench result. Field names are a contract (scripts read
/// `device_limit_gbps`, `cases[].in_flight`, `cases[].block_bytes`,
/// `cases[].gbps`, `io_mode`).
#[derive(Debug, Clone, Serialize)]
pub struct StoreBenchReport {
    /// Median of all device-limit samples, GB/s.
    pub device_limit_gbps: f64,
    /// One entry per in-flight depth, in the order asked.
    pub cases: Vec<CaseReport>,
    /// The disk tier's I/O mode (backend, direct or buffered, and why).
    pub io_mode: String,
    /// `io_uring` or `threads`.
    pub io_backend: String,
    /// True when the disk tier uses O_DIRECT.
    pub direct_io: bool,
    /// Bytes of blocks written and read per case.
    pub total_bytes: u64,
    /// GB/s of writing the block set (encode + write + final fdatasync).
    pub write_gbps: f64,
    /// Every device-limit sample, in run order (one before each case, one at
    /// the end).
    pub device_limit_samples_gbps: Vec<f64>,
    /// True when the page cache was dropped before every measurement.
    pub page_cache_dropped: bool,
    /// Why the page cache was not dropped, when it was not.
    pub page_cache_note: Option<String>,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Blocks in the set.
    pub blocks: u64,
    /// KV layout of every block.
    pub layout: String,
    /// Repeats of every case.
    pub repeat: u32,
    /// Directories striped over.
    pub dirs: Vec<String>,
    /// Bytes of the device-limit file.
    pub limit_file_bytes: u64,
    /// GB/s of writing the device-limit file (raw O_DIRECT, 4 MiB, 32 in
    /// flight, then fdatasync): the device's write limit, one sample.
    pub limit_write_gbps: f64,
    /// GB/s of allocating and first touching the read buffer pool (fresh RAM).
    pub first_touch_gbps: f64,
}

impl TextReport for StoreBenchReport {
    /// A header, then one row per case.
    fn table(&self) -> String {
        render_table(self)
    }
}

fn render_table(r: &StoreBenchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvtier store bench: {} in {} blocks of {} ({}), {} repeat(s), median reported",
        format_size(r.total_bytes),
        r.blocks,
        format_size(r.block_bytes),
        r.layout,
        r.repeat
    );
    let _ = writeln!(out, "dirs:               {}", r.dirs.join(", "));
    let _ = writeln!(out, "io mode:            {}", r.io_mode);
    let dropped = match (&r.page_cache_dropped, &r.page_cache_note) {
        (true, _) => "yes".to_string(),
        (false, Some(n)) => format!("no ({n})"),
        (false, None) => "no".to_string(),
    };
    let _ = writeln!(out, "page cache dropped: {dropped}");
    let _ = writeln!(
        out,
        "write:              {:.2} GB/s (store put_many, encode included, then fdatasync)",
        r.write_gbps
    );
    let _ = writeln!(
        out,
        "device write:       {:.2} GB/s (raw O_DIRECT, {} file, one sample)",
        r.limit_write_gbps,
        format_size(r.limit_file_bytes)
    );
    let _ = writeln!(
        out,
        "first touch:        {:.2} GB/s (fresh RAM, read buffer pool)",
        r.first_touch_gbps
    );
    let _ = writeln!(
        out,
        "device limit:       {:.2} GB/s (raw O_DIRECT sequential read, 4 MiB x 32 in flight; median of {}: {})",
        r.device_limit_gbps,
        r.device_limit_samples_gbps.len(),
        format_samples(&r.device_limit_samples_gbps)
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:>9}  {:>10}  {:>7}  {:>8}  {:>7}  {:>6}  {:>6}  samples GB/s",
        "in flight", "block", "GB/s", "of limit", "paired", "chunk", "in I/O"
    );
    for c in &r.cases {
        let _ = writeln!(
            out,
            "{:>9}  {:>10}  {:>7.2}  {:>8.2}  {:>7.2}  {:>6}  {:>5.0}%  {}",
            c.in_flight,
            format_size(c.block_bytes),
            c.gbps,
            c.fraction_of_limit,
            c.paired_fraction,
            c.chunk_blocks,
            c.io_time_fraction * 100.0,
            format_samples(&c.samples_gbps)
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "of limit: GB/s over the median device limit; paired: median over repeats of each"
    );
    let _ = writeln!(
        out,
        "sample over the mean of the device-limit samples just before and after it; chunk:"
    );
    let _ = writeln!(
        out,
        "blocks per store read call; in I/O: share of the read time spent inside the I/O"
    );
    let _ = writeln!(
        out,
        "engine (the rest, with nothing in flight, is checksum verification and bookkeeping)."
    );
    out
}
