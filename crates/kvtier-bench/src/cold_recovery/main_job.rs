//! kvtier's main job, as `kvtier bench` runs it: the cold-recovery
//! workload (long-context sessions whose KV was computed once and then
//! evicted come back at concurrency 1, 8 and 16) twice, recomputing
//! (baseline) and restoring from the tiers (kvtier), with TTFT, throughput,
//! restore bandwidth, energy and cost per token, the ratios, and the gate
//! verdicts.
//!
//! [`run_main_job`] assembles it: the target (the in-process engine over a
//! store under the cache directory, or an OpenAI-compatible endpoint), the
//! device-limit and page-cache hooks, and the report files. With the
//! defaults it generates the embedded `small` model under
//! `./kvtier-cache/models/small` if missing, keeps its KV cache under
//! `./kvtier-cache/bench-kv` (emptied first, so pass 1 starts cold), and
//! writes `report.json`, `report.md` and SVG plots to
//! `bench-results/<timestamp>/`.

use std::path::{Path, PathBuf};

use kvtier_energy::{CostModel, MeterOptions};
use kvtier_engine::serving::scheduler::BatchConfig;
use kvtier_engine::text::tokenizer::TextTokenizer;
use kvtier_engine::{Engine, EngineOptions, Preset, StoreOptions, open_device, write_preset};
use kvtier_io::IoEngine;

use crate::bench_error::{BenchError, Result, StepContext, fail};
use crate::cold_recovery::bench_dir;
use crate::cold_recovery::runner::{Hooks, RunOptions, run_cold_recovery};
use crate::cold_recovery::workload::ColdRecoveryConfig;
use crate::machine::device_limit::DeviceLimit;
use crate::machine::host;
use crate::reporting::gates::Gates;
use crate::reporting::plot::write_plots;
use crate::reporting::report::BenchReport;
use crate::reporting::report::MachineInfo;
use crate::targets::endpoint::Endpoint;
use crate::targets::endpoint_pair::EndpointPair;
use crate::targets::inproc::InProcess;
use crate::targets::target::Target;

/// What the main job runs (`kvtier bench`; `Default` is its defaults).
#[derive(Debug, Clone)]
pub struct MainJobOptions {
    /// Model directory [default: the embedded `small` model, generated if
    /// missing].
    pub model: Option<PathBuf>,
    /// Drive an OpenAI-compatible server at this URL instead of the
    /// in-process engine.
    pub endpoint: Option<String>,
    /// Model name to send to `endpoint`.
    pub model_name: Option<String>,
    /// With `endpoint`: baseline runs go to this OpenAI-compatible server
    /// instead (kvtier runs and the filling pass stay on `endpoint`).
    pub baseline_endpoint: Option<String>,
    /// Model name to send to `baseline_endpoint` (default: `model_name`).
    pub baseline_model_name: Option<String>,
    /// Directory for the KV cache (G3) and the device-limit file; the
    /// bench's own entries in it are cleared before the run, and a
    /// directory it did not make is refused ([`bench_dir`]).
    pub cache_dir: PathBuf,
    /// Where reports go (default: `bench-results/<timestamp>`).
    pub out: Option<PathBuf>,
    /// Sessions.
    pub sessions: usize,
    /// Tokens of the system prompt all sessions share.
    pub shared_tokens: usize,
    /// Tokens of each session's own history.
    pub history_tokens: usize,
    /// Tokens of each session's new question.
    pub question_tokens: usize,
    /// Tokens generated per request.
    pub max_tokens: usize,
    /// Concurrency levels.
    pub concurrency: Vec<u32>,
    /// Keep G2 (host memory) warm before kvtier runs (else restores come
    /// from G3).
    pub keep_g2: bool,
    /// Drop the page cache before each restored twin of the
    /// concurrency-1 pairs (off: `--no-pair-cache-drop`;
    /// [`ColdRecoveryConfig::pair_cache_drop`]).
    pub pair_cache_drop: bool,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// How G2 and G3 store the blocks kvtier restores (`--kv-offload-codec`).
    pub kv_offload_codec: kvtier_store::KvCodec,
    /// Restore an idle engine's prefixes layer by layer
    /// (`EngineOptions::layerwise_restore`; off: `--no-layerwise-restore`).
    pub layerwise_restore: bool,
    /// How much a restore beside other sessions' decode yields the CPU to
    /// them (`EngineOptions::restore_yield`; `--restore-yield`).
    pub restore_yield: f64,
    /// Where the in-process engine runs: `cpu`, or `cuda` / `cuda:N` in a
    /// build with the `cuda` feature.
    pub device: String,
    /// G2 capacity.
    pub g2_bytes: u64,
    /// G3 capacity.
    pub g3_bytes: u64,
    /// Most sequences batched together by the scheduler.
    pub max_batch: usize,
    /// Gates file (TOML) (default: the brief's G3 gate).
    pub gates: Option<PathBuf>,
    /// Show progress and status lines on stderr.
    pub progress: bool,
}

impl Default for MainJobOptions {
    fn default() -> Self {
        Self {
            model: None,
            endpoint: None,
            model_name: None,
            baseline_endpoint: None,
            baseline_model_name: None,
            cache_dir: PathBuf::from("kvtier-cache/bench-kv"),
            out: None,
            sessions: 16,
            shared_tokens: 256,
            history_tokens: 512,
            question_tokens: 24,
            max_tokens: 8,
            concurrency: vec![1, 8, 16],
            keep_g2: false,
            pair_cache_drop: true,
            block_tokens: 256,
            kv_offload_codec: kvtier_store::KvCodec::None,
            layerwise_restore: true,
            restore_yield: kvtier_engine::DEFAULT_RESTORE_YIELD,
            device: "cpu".into(),
            g2_bytes: 1 << 30,
            g3_bytes: 8 << 30,
            max_batch: 16,
            gates: None,
            progress: true,
        }
    }
}

/// What the main job produced.
#[derive(Debug, Clone)]
pub struct MainJobOutcome {
    /// The report (also written as `report.json` and `report.md`).
    pub report: BenchReport,
    /// Where `report.json`, `report.md` and the plots were written.
    pub out_dir: PathBuf,
}

/// Runs the main job and writes its reports; gates are judged in the
/// report, not enforced here.
pub fn run_main_job(opts: &MainJobOptions) -> Result<MainJobOutcome> {
    // Everything a user can get wrong is checked before any work starts.
    let gates = match &opts.gates {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_step(|| format!("cannot read gates file {}", p.display()))?;
            Gates::from_toml(&text)
                .map_err(|e| BenchError::Failed(format!("gates file {}: {e}", p.display())))?
        }
        None => Gates::default(),
    };
    let workload = ColdRecoveryConfig {
        sessions: opts.sessions,
        shared_tokens: opts.shared_tokens,
        history_tokens: opts.history_tokens,
        question_tokens: opts.question_tokens,
        max_tokens: opts.max_tokens,
        concurrency: opts.concurrency.clone(),
        evict_g2: !opts.keep_g2,
        seed: 42,
        pair_cache_drop: opts.pair_cache_drop,
    };
    workload.validate().map_err(BenchError::Failed)?;
    if opts.block_tokens == 0 {
        fail!("--block-tokens must be positive");
    }
    if opts.baseline_endpoint.is_some() && opts.endpoint.is_none() {
        fail!("--baseline-endpoint needs --endpoint (the kvtier server)");
    }
    let out = opts.out.clone().unwrap_or_else(default_out_dir);
    let model_name = opts.model_name.as_deref().unwrap_or("");
    // An unreachable endpoint is an error here, before any file is touched.
    let remote: Option<Box<dyn Target>> = match (&opts.endpoint, &opts.baseline_endpoint) {
        (Some(url), None) => Some(Box::new(Endpoint::new(url, model_name)?)),
        (Some(url), Some(base)) => Some(Box::new(EndpointPair::new(
            Endpoint::new(
                base,
                opts.baseline_model_name.as_deref().unwrap_or(model_name),
            )?,
            Endpoint::new(url, model_name)?,
        ))),
        (None, _) => None,
    };
    bench_dir::prepare(&opts.cache_dir)?;
    let mut target: Box<dyn Target> = match remote {
        Some(t) => t,
        None => Box::new(in_process(opts)?),
    };

    // The device limit is measured in the same run, between the runs, on a
    // file in the cache directory (same device as G3).
    let io = IoEngine::shared();
    let direct = kvtier_io::probe_direct(&opts.cache_dir).direct;
    let (mut limit, _) = DeviceLimit::create(
        &opts.cache_dir.join("device-limit.bin"),
        512 << 20,
        direct,
        io,
    )?;
    let mut measure = || limit.measure(io).map_err(|e| e.to_string());
    let mut drop_cache = || match host::drop_page_cache() {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!("page cache not dropped: {e}");
            false
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
        progress: opts.progress,
    };
    let hooks = Hooks {
        device_limit: &mut measure,
        drop_page_cache: &mut drop_cache,
    };
    let report = run_cold_recovery(target.as_mut(), &run, hooks, machine)?;
    drop(target);
    let _ = std::fs::remove_file(opts.cache_dir.join("device-limit.bin"));

    write_reports(&report, &out)?;
    Ok(MainJobOutcome {
        report,
        out_dir: out,
    })
}

fn default_out_dir() -> PathBuf {
    PathBuf::from("bench-results").join(crate::reporting::report::timestamp_for_path(
        std::time::SystemTime::now(),
    ))
}

fn write_reports(report: &BenchReport, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_step(|| format!("cannot create {}", out.display()))?;
    std::fs::write(
        out.join("report.json"),
        serde_json::to_string_pretty(report)?,
    )?;
    std::fs::write(out.join("report.md"), report.markdown())?;
    write_plots(report, out).map_err(|e| BenchError::Failed(format!("plots: {e}")))?;
    Ok(())
}

/// The in-process engine with its store under the cache dir.
fn in_process(opts: &MainJobOptions) -> Result<InProcess> {
    let model_dir = match &opts.model {
        Some(d) => d.clone(),
        None => {
            let d = PathBuf::from("kvtier-cache/models/small");
            if !d.join("model.safetensors").exists() {
                if opts.progress {
                    eprintln!("generating the embedded small model in {} ...", d.display());
                }
                write_preset(Preset::Small, 0, &d).step("writing the embedded model")?;
            }
            d
        }
    };

    let max_seq =
        opts.shared_tokens + opts.history_tokens + opts.question_tokens + opts.max_tokens + 256;
    let per_seq_pages = max_seq.div_ceil(opts.block_tokens) + 1;
    let engine_opts = EngineOptions {
        block_tokens: opts.block_tokens,
        pool_pages: per_seq_pages * (opts.max_batch.max(1) + 2),
        max_seq_tokens: max_seq.max(2048),
        prefix_reuse: true,
        layerwise_restore: opts.layerwise_restore,
        restore_yield: opts.restore_yield,
        device: open_device(&opts.device).step("opening the device")?,
        ..Default::default()
    };
    let store = StoreOptions {
        memory_bytes: opts.g2_bytes,
        disk_dirs: vec![opts.cache_dir.join("g3")],
        disk_bytes: opts.g3_bytes,
        remote: None,
        g3_sync: None,
        codec: opts.kv_offload_codec,
        eviction: Default::default(),
    };
    let engine = Engine::load(&model_dir, engine_opts, Some(store))
        .with_step(|| format!("loading the model in {}", model_dir.display()))?;
    let tokenizer = TextTokenizer::from_dir(&model_dir)?;
    let batch = BatchConfig {
        max_batch: opts.max_batch.max(1),
        ..BatchConfig::default()
    };
    let description = format!(
        "in-process engine on {}, model {}",
        opts.device,
        model_dir.display()
    );

    Ok(InProcess::new(engine, tokenizer, batch, description))
}
