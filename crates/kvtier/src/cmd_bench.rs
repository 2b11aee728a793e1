//! `kvtier bench`: the flags of kvtier's main job, mapped onto
//! [`kvtier_bench::cold_recovery::main_job::MainJobOptions`]; the job itself is
//! [`kvtier_bench::cold_recovery::main_job::run_main_job`].

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use kvtier_bench::cold_recovery::main_job::{MainJobOptions, run_main_job};
use kvtier_bench::common::size::parse_size;

/// Workloads `kvtier bench` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// Evicted long-context sessions come back: restore vs recompute.
    ColdRecovery,
}

/// Flags of `kvtier bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchCmdArgs {
    /// The workload.
    #[arg(long, value_enum, default_value_t = Workload::ColdRecovery)]
    pub workload: Workload,
    /// Model directory (default: the embedded `small` model, generated if missing).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Drive an OpenAI-compatible server instead of the in-process engine.
    #[arg(long, value_name = "URL", requires = "model_name")]
    pub endpoint: Option<String>,
    /// Model name to send to `--endpoint`.
    #[arg(long, value_name = "NAME")]
    pub model_name: Option<String>,
    /// Send the baseline runs to this OpenAI-compatible server instead
    /// (e.g. vLLM alone; `--endpoint` is the kvtier one): any two servers
    /// compared in one run.
    #[arg(long, value_name = "URL", requires = "endpoint")]
    pub baseline_endpoint: Option<String>,
    /// Model name to send to `--baseline-endpoint` (default: `--model-name`).
    #[arg(long, value_name = "NAME", requires = "baseline_endpoint")]
    pub baseline_model_name: Option<String>,
    /// Directory for the KV cache (G3). kvtier bench marks it as its own
    /// (a .kvtier-bench file) and clears only its own entries there before
    /// the run; a non-empty directory it did not make is refused.
    #[arg(long, value_name = "DIR", default_value = "kvtier-cache/bench-kv")]
    pub cache_dir: PathBuf,
    /// Where reports go (default: `bench-results/<timestamp>`).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Sessions.
    #[arg(long, default_value_t = 16)]
    pub sessions: usize,
    /// Tokens of the system prompt all sessions share.
    #[arg(long, default_value_t = 256)]
    pub shared_tokens: usize,
    /// Tokens of each session's own history.
    #[arg(long, default_value_t = 512)]
    pub history_tokens: usize,
    /// Tokens of each session's new question.
    #[arg(long, default_value_t = 24)]
    pub question_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: usize,
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,16")]
    pub concurrency: Vec<u32>,
    /// Keep G2 (host memory) warm before kvtier runs (default: restores come from G3).
    #[arg(long)]
    pub keep_g2: bool,
    /// Send each restored twin of the concurrency-1 pairs (the `overlap`
    /// figure) right after G1 and G2 are dropped, without dropping the
    /// page cache first as the default does (docs/decisions.md).
    #[arg(long)]
    pub no_pair_cache_drop: bool,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 256)]
    pub block_tokens: usize,
    /// How G2, G3 and G4 store KV blocks: none (f32 as computed), bf16
    /// (half the bytes), fp8-e4m3 or int8 (about a quarter, a scale per
    /// token and head). G1 keeps f32; blocks are coded as they leave it and
    /// decoded as they are restored. Part of every block key, so coded and
    /// uncoded KV never mix (docs/block-format.md).
    #[arg(long, value_name = "CODEC", default_value = "none", value_parser = crate::cli::codec_arg)]
    pub kv_offload_codec: kvtier_store::KvCodec,
    /// Restore a prefix whole before computing the rest of the prompt,
    /// never layer by layer. By default an idle engine restores layer by
    /// layer: the new tokens' layer l is computed as soon as layer l has
    /// landed, while later layers are still being read (docs/architecture.md).
    #[arg(long)]
    pub no_layerwise_restore: bool,
    /// How much a restore beside decoding requests yields the CPU to them:
    /// after each piece of the prefix it copies into G1, the restoring
    /// thread sleeps K times as long as the piece took (0: never yields).
    /// Higher keeps the others' inter-token latency steadier and makes the
    /// restoring request's first token later (docs/decisions.md). A
    /// restore into an otherwise idle engine never yields.
    #[arg(long, value_name = "K", default_value_t = kvtier_engine::DEFAULT_RESTORE_YIELD, value_parser = crate::cli::restore_yield_arg)]
    pub restore_yield: f64,
    /// Where the in-process engine runs: `cpu`, or `cuda` / `cuda:N` in a
    /// build with `--features cuda` (ignored with `--endpoint`).
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,
    /// G2 capacity.
    #[arg(long, value_parser = parse_size, default_value = "1GiB")]
    pub g2_bytes: u64,
    /// G3 capacity.
    #[arg(long, value_parser = parse_size, default_value = "8GiB")]
    pub g3_bytes: u64,
    /// Most sequences batched together by the scheduler.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Gates file (TOML); default: the brief's G3 gate.
    #[arg(long, value_name = "FILE")]
    pub gates: Option<PathBuf>,
    /// Exit non-zero when a gate fails.
    #[arg(long)]
    pub enforce_gates: bool,
    /// Print the report as one JSON object on stdout (no table, no progress).
    #[arg(long)]
    pub json: bool,
}

impl BenchCmdArgs {
    /// The job these flags ask for.
    pub fn options(&self) -> MainJobOptions {
        let Workload::ColdRecovery = self.workload;
        MainJobOptions {
            model: self.model.clone(),
            endpoint: self.endpoint.clone(),
            model_name: self.model_name.clone(),
            baseline_endpoint: self.baseline_endpoint.clone(),
            baseline_model_name: self.baseline_model_name.clone(),
            cache_dir: self.cache_dir.clone(),
            out: self.out.clone(),
            sessions: self.sessions,
            shared_tokens: self.shared_tokens,
            history_tokens: self.history_tokens,
            question_tokens: self.question_tokens,
            max_tokens: self.max_tokens,
            concurrency: self.concurrency.clone(),
            keep_g2: self.keep_g2,
            pair_cache_drop: !self.no_pair_cache_drop,
            block_tokens: self.block_tokens,
            kv_offload_codec: self.kv_offload_codec,
            layerwise_restore: !self.no_layerwise_restore,
            restore_yield: self.restore_yield,
            device: self.device.clone(),
            g2_bytes: self.g2_bytes,
            g3_bytes: self.g3_bytes,
            max_batch: self.max_batch,
            gates: self.gates.clone(),
            progress: !self.json,
        }
    }
}

/// Runs `kvtier bench`.
pub fn run(args: &BenchCmdArgs) -> Result<()> {
    let done = run_main_job(&args.options())?;
    let report = &done.report;
    if args.json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{}", report.table());
        println!("\nreport: {}", done.out_dir.display());
    }
    if args.enforce_gates && !report.gates_passed() {
        bail!("gate(s) failed: {}", report.failed_gates());
    }
    Ok(())
}
