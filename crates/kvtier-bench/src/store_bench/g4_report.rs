//! The G4 store bench's results: the JSON contract and the text table.

use serde::Serialize;

use crate::common::size::format_size;
use crate::reporting::stats::format_samples;
use crate::reporting::text_report::TextReport;

/// What `kvtier store bench --tier g4 --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct G4BenchReport {
    /// Median GB/s (10^9 bytes of values per second) of redis-benchmark GET;
    /// null when it was skipped (see `redis_benchmark_skipped`).
    pub redis_benchmark_get_gbps: Option<f64>,
    /// Median GB/s of restoring every block from G4 through the store.
    pub g4_get_gbps: f64,
    /// Bytes of one value in the pool: the block header and the payload.
    pub value_bytes: u64,
    /// `g4_get_gbps / redis_benchmark_get_gbps`.
    pub ratio: Option<f64>,
    /// The goal for `ratio`.
    pub goal_ratio: f64,
    /// `ratio >= goal_ratio`.
    pub goal_met: Option<bool>,
    /// Always `"g4"`.
    pub tier: &'static str,
    /// The pool (password redacted).
    pub remote: String,
    /// The bench's namespace in the pool.
    pub namespace: String,
    /// KV payload bytes per block (`--block-bytes`).
    pub payload_bytes: u64,
    /// Blocks in the set.
    pub blocks: u64,
    /// `blocks * value_bytes`: bytes read by one G4 pass.
    pub total_bytes: u64,
    /// G4 GETs in flight (the largest `--in-flight`), and redis-benchmark
    /// clients.
    pub in_flight: u32,
    /// Blocks per store call (one G4 batch).
    pub chunk_blocks: u64,
    /// Repeats of each side.
    pub repeat: u32,
    /// Median blocks (GETs) per second restored from G4.
    pub g4_get_per_sec: f64,
    /// GB/s of every G4 pass, in order.
    pub g4_samples_gbps: Vec<f64>,
    /// GB/s of putting the set (encode and write-through until flushed).
    pub g4_put_gbps: f64,
    /// Median GET requests per second of redis-benchmark.
    pub redis_benchmark_rps: Option<f64>,
    /// GB/s of every redis-benchmark run, in order.
    pub redis_benchmark_samples_gbps: Vec<f64>,
    /// GETs per redis-benchmark run.
    pub redis_benchmark_requests: Option<u64>,
    /// redis-benchmark connections (`-c`), each with one request out (`-P 1`).
    pub redis_benchmark_clients: Option<u32>,
    /// redis-benchmark pipeline depth per connection.
    pub redis_benchmark_pipeline: Option<u32>,
    /// Keys redis-benchmark picks from at random (`-r`): the G4 blocks.
    pub redis_benchmark_keyspace: Option<u64>,
    /// The redis-benchmark binary.
    pub redis_benchmark_bin: Option<String>,
    /// Its `--version`.
    pub redis_benchmark_version: Option<String>,
    /// Why redis-benchmark did not run (cluster and S3 pools).
    pub redis_benchmark_skipped: Option<String>,
    /// G4 operations that failed during the run.
    pub g4_errors: u64,
    /// G4 operations that timed out during the run.
    pub g4_timeouts: u64,
    /// The blocks were left in the pool (`--keep`).
    pub kept: bool,
    /// Bench blocks still in the pool after the clean-up (null with
    /// `--keep`).
    pub keys_left: Option<u64>,
}

impl TextReport for G4BenchReport {
    fn table(&self) -> String {
        render_g4_table(self)
    }
}

fn render_g4_table(r: &G4BenchReport) -> String {
    let mut s = format!(
        "G4 restore vs redis-benchmark GET: {} (namespace {})\n\
         {} blocks of {} payload (value {} bytes), {} per pass; {} in flight / {} \
         redis-benchmark clients (-P 1); median of {}\n\n",
        r.remote,
        r.namespace,
        r.blocks,
        format_size(r.payload_bytes),
        r.value_bytes,
        format_size(r.total_bytes),
        r.in_flight,
        r.redis_benchmark_clients
            .map_or_else(|| "no".to_string(), |c| c.to_string()),
        r.repeat
    );
    s.push_str(&format!(
        "{:<17} {:>11} {:>8} {:>12}  samples GB/s\n",
        "side", "value B", "GB/s", "requests/s"
    ));
    s.push_str(&format!(
        "{:<17} {:>11} {:>8.2} {:>12.1}  {}\n",
        "g4 restore",
        r.value_bytes,
        r.g4_get_gbps,
        r.g4_get_per_sec,
        format_samples(&r.g4_samples_gbps)
    ));
    match (r.redis_benchmark_get_gbps, r.redis_benchmark_rps) {
        (Some(g), Some(rps)) => s.push_str(&format!(
            "{:<17} {:>11} {:>8.2} {:>12.1}  {}\n",
            "redis-benchmark",
            r.value_bytes,
            g,
            rps,
            format_samples(&r.redis_benchmark_samples_gbps)
        )),
        _ => s.push_str(&format!(
            "{:<17} skipped: {}\n",
            "redis-benchmark",
            r.redis_benchmark_skipped.as_deref().unwrap_or("not run")
        )),
    }
    if let Some(ratio) = r.ratio {
        s.push_str(&format!(
            "\ng4 / redis-benchmark = {ratio:.2} (goal >= {:.2}: {})\n",
            r.goal_ratio,
            if r.goal_met == Some(true) {
                "PASS"
            } else {
                "short"
            }
        ));
    }
    s.push_str(&format!(
        "put (write-through) {:.2} GB/s; G4 errors {}, timeouts {}; {}\n",
        r.g4_put_gbps,
        r.g4_errors,
        r.g4_timeouts,
        match (r.kept, r.keys_left) {
            (true, _) => format!("blocks kept under {}:*", r.namespace),
            (false, Some(0)) => "blocks deleted".to_string(),
            (false, n) => format!("{} blocks could not be deleted", n.unwrap_or(0)),
        }
    ));
    s
}
