//! `kvtier trace stats` and `kvtier trace sim`: public KV-cache traces
//! through kvtier's own tier policies (`kvtier-trace`); `kvtier trace
//! replay` is in [`crate::cmd_trace_replay`].

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kvtier_bench::common::size::parse_size;
use kvtier_store::KvCodec;
use kvtier_trace::model_kv::ModelKv;
use kvtier_trace::prefix::PrefixTree;
use kvtier_trace::sim::{self, Capacity, Point, SimPolicy};
use kvtier_trace::stats::{self, TraceStats};
use kvtier_trace::trace::ReadOptions;
use kvtier_trace::{Format, Trace};

/// `kvtier trace ...`.
#[derive(Debug, Subcommand)]
pub enum TraceCommand {
    /// What a trace holds: requests, time span, sessions, unique blocks,
    /// input and output tokens, how much repeats, and the hit rate of an
    /// infinite prefix cache.
    Stats(StatsArgs),
    /// Replays a trace through tier policies at several capacities: LRU,
    /// FIFO, S3-FIFO and kvtier's own (the store's very types) beside the
    /// offline optimum (Belady with bypass). A block hits while every
    /// earlier block of its request hit; hit rates count the requests after
    /// the warm-up.
    Sim(SimArgs),
    /// Replays a trace against live OpenAI-compatible servers (kvtier
    /// serve, vLLM with kvtier's connector, any other) with prompts made
    /// from its block ids: TTFT, throughput, hit rate over time across an
    /// optional restart, the baseline server beside it, the product
    /// brief's gates, and the simulator's predicted hit rate beside the
    /// measured one.
    Replay(crate::cmd_trace_replay::ReplayArgs),
}

/// Which trace, read how.
#[derive(Debug, Args)]
pub struct TraceInput {
    /// The trace: a Mooncake JSONL file, a kv-cache-tester session file or
    /// folder, a RAGPulse folder (or its 0_trace.jsonl), or a generic JSONL
    /// file (docs/guides/traces.md).
    #[arg(value_name = "TRACE")]
    pub trace: PathBuf,

    /// The trace's format [default: guessed from the path and first line].
    #[arg(long, value_name = "FORMAT", value_parser = parse_format)]
    pub format: Option<Format>,

    /// Tokens per block, overriding the format's (Mooncake 512, tester the
    /// file's, RAGPulse 512, generic the lines').
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: Option<u32>,
}

/// `kvtier trace stats`.
#[derive(Debug, Args)]
pub struct StatsArgs {
    #[command(flatten)]
    input: TraceInput,

    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// `kvtier trace sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    #[command(flatten)]
    input: TraceInput,

    /// Policies, comma-separated: lru, fifo, s3fifo, clock, kvtier, belady.
    #[arg(
        long,
        value_name = "LIST",
        default_value = "lru,fifo,s3fifo,kvtier,belady"
    )]
    policies: String,

    /// Capacities, comma-separated: a share of the trace's distinct blocks
    /// (5%), a number of blocks (1200), or bytes (4GiB, with --model).
    #[arg(long, value_name = "LIST", default_value = "1%,2%,5%,10%,20%,50%,100%")]
    capacities: String,

    /// The share of requests (from the start) that warms the cache and is
    /// not measured; the published curves measure the second half.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.5, value_parser = warmup_arg)]
    warmup: f64,

    /// The model whose KV the tier holds, for capacities in bytes: a folder
    /// with config.json, or a preset (llama-3.1-8b, llama-3.1-70b).
    #[arg(long, value_name = "DIR|PRESET")]
    model: Option<String>,

    /// How the tier stores the KV (none, bf16, fp8-e4m3, int8).
    #[arg(long, value_name = "CODEC", default_value = "none", value_parser = crate::cli::codec_arg)]
    codec: KvCodec,

    /// Run the online policies behind G3's admission filter: a block is
    /// stored only once seen twice within the last N distinct blocks (the
    /// store's `admit_on_second_sighting`); `g3_write_blocks` shows what it
    /// saves the SSD.
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "1048576")]
    admission: Option<usize>,

    /// Write the hit-rate curves as an SVG plot.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,

    /// Simulations run at once [default: the cores].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    threads: Option<u32>,

    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn parse_format(s: &str) -> Result<Format, String> {
    s.parse()
}

fn warmup_arg(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(w) if (0.0..1.0).contains(&w) => Ok(w),
        _ => Err(format!("{s:?}: a fraction from 0 up to (not including) 1")),
    }
}

/// Reads the trace `input` names.
pub fn read(input: &TraceInput) -> Result<Trace> {
    let options = ReadOptions {
        block_size: input.block_size,
    };
    // The error names the file (and line) already.
    kvtier_trace::read(&input.trace, input.format, options)
        .map_err(|e| anyhow::anyhow!("cannot read the trace: {e}"))
}

/// Runs `kvtier trace ...`.
pub fn run(cmd: &TraceCommand) -> Result<()> {
    match cmd {
        TraceCommand::Stats(a) => {
            let s = stats::stats(&read(&a.input)?);
            if a.json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print!("{}", stats::text(&s));
            }
            Ok(())
        }
        TraceCommand::Sim(a) => simulate(a),
        TraceCommand::Replay(a) => crate::cmd_trace_replay::run(a),
    }
}

/// The JSON of `kvtier trace sim --json`.
#[derive(Debug, serde::Serialize)]
struct SimReport {
    trace: TraceStats,
    warmup: f64,
    admission_window: Option<usize>,
    model: Option<ModelKv>,
    codec: &'static str,
    bytes_per_block: Option<u64>,
    points: Vec<Point>,
    gap_closed: std::collections::BTreeMap<String, f64>,
}

fn simulate(a: &SimArgs) -> Result<()> {
    let policies = a
        .policies
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(SimPolicy::parse)
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
    if policies.is_empty() {
        bail!("--policies names no policy");
    }
    let model = a
        .model
        .as_deref()
        .map(ModelKv::load)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    // Flags first, before the trace is read: a capacity in bytes needs a
    // model to become blocks.
    let mut specs = Vec::new();
    for c in a.capacities.split(',').filter(|c| !c.trim().is_empty()) {
        specs.push(match Capacity::parse(c) {
            Ok(cap) => Ok(cap),
            Err(why) => {
                let Ok(bytes) = parse_size(c.trim()) else {
                    bail!("{why}, or bytes like 4GiB with --model");
                };
                if model.is_none() {
                    bail!("capacity {c:?} is in bytes: give --model to turn it into blocks");
                }
                Err(bytes)
            }
        });
    }
    let trace = read(&a.input)?;
    let bytes_per_block = match &model {
        Some(m) => Some(
            m.bytes_per_token(a.codec).with_context(|| {
                format!("codec {} cannot store {}'s KV", a.codec.name(), m.name)
            })? * u64::from(trace.block_size),
        ),
        None => None,
    };
    let tree = PrefixTree::new(&trace);
    let unique = tree.unique_blocks();
    let mut capacities = Vec::new();
    for spec in specs {
        let blocks = match spec {
            Ok(cap) => cap.blocks(unique),
            Err(bytes) => (bytes / bytes_per_block.unwrap_or(1).max(1)).max(1),
        };
        if !capacities.contains(&blocks) {
            capacities.push(blocks);
        }
    }
    let threads = a.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |t| t as usize,
    );
    let started = std::time::Instant::now();
    let points = sim::sweep(
        &tree,
        &policies,
        &capacities,
        a.warmup,
        threads,
        a.admission,
    );
    let elapsed = started.elapsed();
    let report = SimReport {
        trace: stats::stats(&trace),
        warmup: a.warmup,
        admission_window: a.admission,
        model,
        codec: a.codec.name(),
        bytes_per_block,
        gap_closed: sim::gap_closed(&points),
        points,
    };
    if let Some(path) = &a.plot {
        let title = format!("{}: hit rate by capacity", report.trace.name);
        kvtier_trace::plot::write(path, &title, &report.points).map_err(anyhow::Error::msg)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!(
            "{}",
            sim::text(&report.points, unique, bytes_per_block, &report.gap_closed)
        );
        eprintln!(
            "{} requests, {} policies x {} capacities in {:.1} s",
            report.trace.requests,
            policies.len(),
            capacities.len(),
            elapsed.as_secs_f64()
        );
    }
    Ok(())
}
