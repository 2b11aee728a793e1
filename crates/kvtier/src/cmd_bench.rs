//! `kvtier bench`: kvtier's main job. Runs the cold-recovery workload
//! (long-context sessions whose KV was computed once and then evicted come
//! back at concurrency 1, 8 and 16) twice, recomputing (baseline) and
//! restoring from the tiers (kvtier), and reports TTFT, throughput, restore
//! bandwidth, energy and cost per token, the ratios, and the gate verdicts.
//!
//! With no flags it generates the embedded `small` model under
//! `./kvtier-cache/models/small` if missing, keeps its KV cache under
//! `./kvtier-cache/bench-kv` (emptied first, so pass 1 starts cold), and
//! writes `report.json`, `report.md` and SVG plots to
//! `bench-results/<timestamp>/`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kvtier_bench::endpoint::Endpoint;
use kvtier_bench::inproc::InProcess;
use kvtier_bench::plot::write_plots;
use kvtier_bench::report::MachineInfo;
use kvtier_bench::target::Target;
use kvtier_bench::{ColdRecoveryConfig, Gates, Hooks, RunOptions, run_cold_recovery};
use kvtier_energy::{CostModel, MeterOptions};
use kvtier_engine::scheduler::BatchConfig;
use kvtier_engine::tokenizer::TextTokenizer;
use kvtier_engine::{Engine, EngineOptions, Preset, StoreOptions, write_preset};
use kvtier_io::IoEngine;

use crate::device_limit::DeviceLimit;
use crate::host;
use crate::size::parse_size;

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
    /// Directory for the KV cache (G3); emptied before the run.
    #[arg(long, value_name = "DIR", default_value = "kvtier-cache/bench-kv")]
    pub cache_dir: PathBuf,
    /// Where reports go (default: bench-results/<timestamp>).
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
    /// Tokens per KV block.
    #[arg(long, default_value_t = 256)]
    pub block_tokens: usize,
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

/// Runs `kvtier bench`.
pub fn run(args: &BenchCmdArgs) -> Result<()> {
    // Everything a user can get wrong is checked before any work starts.
    let gates = match &args.gates {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read gates file {}", p.display()))?;
            Gates::from_toml(&text)
                .map_err(|e| anyhow::anyhow!("gates file {}: {e}", p.display()))?
        }
        None => Gates::default(),
    };
    let workload = ColdRecoveryConfig {
        sessions: args.sessions,
        shared_tokens: args.shared_tokens,
        history_tokens: args.history_tokens,
        question_tokens: args.question_tokens,
        max_tokens: args.max_tokens,
        concurrency: args.concurrency.clone(),
        evict_g2: !args.keep_g2,
        seed: 42,
    };
    workload.validate().map_err(anyhow::Error::msg)?;
    if args.block_tokens == 0 {
        bail!("--block-tokens must be positive");
    }
    let out = args.out.clone().unwrap_or_else(default_out_dir);
    if args.cache_dir.exists() {
        std::fs::remove_dir_all(&args.cache_dir)
            .with_context(|| format!("cannot empty the cache dir {}", args.cache_dir.display()))?;
    }
    std::fs::create_dir_all(&args.cache_dir)
        .with_context(|| format!("cannot create the cache dir {}", args.cache_dir.display()))?;
    let mut target: Box<dyn Target> = match &args.endpoint {
        // An unreachable endpoint is an error here, before any work starts.
        Some(url) => Box::new(Endpoint::new(
            url,
            args.model_name.as_deref().unwrap_or(""),
        )?),
        None => Box::new(in_process(args)?),
    };

    // The device limit is measured in the same run, between the runs, on a
    // file in the cache directory (same device as G3).
    let io = IoEngine::shared();
    let direct = kvtier_io::probe_direct(&args.cache_dir).direct;
    let (mut limit, _) = DeviceLimit::create(
        &args.cache_dir.join("device-limit.bin"),
        512 << 20,
        direct,
        io,
    )?;
    let mut measure = || limit.measure(io).map_err(|e| e.to_string());
    let mut drop_cache = || {
        if let Err(e) = host::drop_page_cache() {
            tracing::debug!("page cache not dropped: {e}");
        }
    };
    let machine = MachineInfo {
        cpu: host::cpu_model(),
        cores: host::cpus(),
        memory_bytes: host::memory_bytes(),
        ..Default::default()
    };
    let run = RunOptions {
        workload,
        gates,
        cost: CostModel::default(),
        meter: MeterOptions::default(),
        progress: !args.json,
    };
    let hooks = Hooks {
        device_limit: &mut measure,
        drop_page_cache: &mut drop_cache,
    };
    let report = run_cold_recovery(target.as_mut(), &run, hooks, machine)?;
    drop(target);
    let _ = std::fs::remove_file(args.cache_dir.join("device-limit.bin"));

    write_reports(&report, &out)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.table());
        println!("\nreport: {}", out.display());
    }
    if args.enforce_gates && !report.gates_passed() {
        bail!("gate(s) failed: {}", failed_gates(&report));
    }
    Ok(())
}

fn failed_gates(report: &kvtier_bench::BenchReport) -> String {
    report
        .gates
        .iter()
        .filter(|g| !g.passed)
        .map(|g| g.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn default_out_dir() -> PathBuf {
    PathBuf::from("bench-results").join(kvtier_bench::report::timestamp_for_path(
        std::time::SystemTime::now(),
    ))
}

fn write_reports(report: &kvtier_bench::BenchReport, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    std::fs::write(
        out.join("report.json"),
        serde_json::to_string_pretty(report)?,
    )?;
    std::fs::write(out.join("report.md"), report.markdown())?;
    write_plots(report, out).map_err(|e| anyhow::anyhow!("plots: {e}"))?;
    Ok(())
}

/// The in-process engine with its store under the cache dir.
fn in_process(args: &BenchCmdArgs) -> Result<InProcess> {
    let model_dir = match &args.model {
        Some(d) => d.clone(),
        None => {
            let d = PathBuf::from("kvtier-cache/models/small");
            if !d.join("model.safetensors").exists() {
                if !args.json {
                    eprintln!("generating the embedded small model in {} ...", d.display());
                }
                write_preset(Preset::Small, 0, &d).context("writing the embedded model")?;
            }
            d
        }
    };

    let max_seq =
        args.shared_tokens + args.history_tokens + args.question_tokens + args.max_tokens + 256;
    let per_seq_pages = max_seq.div_ceil(args.block_tokens) + 1;
    let opts = EngineOptions {
        block_tokens: args.block_tokens,
        pool_pages: per_seq_pages * (args.max_batch.max(1) + 2),
        max_seq_tokens: max_seq.max(2048),
        prefix_reuse: true,
        ..Default::default()
    };
    let store = StoreOptions {
        memory_bytes: args.g2_bytes,
        disk_dirs: vec![args.cache_dir.join("g3")],
        disk_bytes: args.g3_bytes,
        remote: None,
    };
    let engine = Engine::load(&model_dir, opts, Some(store))
        .with_context(|| format!("loading the model in {}", model_dir.display()))?;
    let tokenizer = TextTokenizer::from_dir(&model_dir)?;
    let batch = BatchConfig {
        max_batch: args.max_batch.max(1),
        max_wait: Duration::from_millis(50),
    };
    let description = format!("in-process engine, model {}", model_dir.display());

    Ok(InProcess::new(engine, tokenizer, batch, description))
}
