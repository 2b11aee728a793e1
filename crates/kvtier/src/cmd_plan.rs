//! `kvtier plan`: how much of each tier a trace needs, and what it buys
//! (`kvtier_trace::plan`).

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use kvtier_bench::common::size::parse_size;
use kvtier_store::KvCodec;
use kvtier_trace::model_kv::ModelKv;
use kvtier_trace::plan::{self, Hardware, Plan, PlanModel, Tiers};
use kvtier_trace::prefix::PrefixTree;
use kvtier_trace::stats::{self, TraceStats};

use crate::cmd_trace::TraceInput;

/// The machine a plan assumes when no --hardware is given.
const THIS_MACHINE: &str = include_str!("../../kvtier-trace/hardware/this-machine.toml");

/// `kvtier plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    input: TraceInput,

    /// The model: a folder with config.json, or a preset (llama-3.1-8b,
    /// llama-3.1-70b).
    #[arg(long, value_name = "DIR|PRESET")]
    model: String,

    /// How the tiers store the KV (none, bf16, fp8-e4m3, int8).
    #[arg(long, value_name = "CODEC", default_value = "none", value_parser = crate::cli::codec_arg)]
    codec: KvCodec,

    /// Accelerator memory for KV (G1) [default: the hardware file's].
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    g1: Option<u64>,

    /// Host-memory (G2) sizes to try, comma-separated.
    #[arg(long, value_name = "SIZES", default_value = "0,64GiB,256GiB")]
    g2: String,

    /// Local-disk (G3) sizes to try.
    #[arg(long, value_name = "SIZES", default_value = "0,1TiB,4TiB")]
    g3: String,

    /// Shared-pool (G4) sizes to try.
    #[arg(long, value_name = "SIZES", default_value = "0")]
    g4: String,

    /// The machine's figures (TOML, every figure with its source; see
    /// crates/kvtier-trace/hardware/) [default: this development VM's].
    #[arg(long, value_name = "FILE.toml")]
    hardware: Option<PathBuf>,

    /// The share of requests (from the start) that warms the tiers.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.5)]
    warmup: f64,

    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn sizes(list: &str, flag: &str) -> Result<Vec<u64>> {
    let v = list
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| parse_size(s.trim()).map_err(|e| anyhow!("--{flag} {s:?}: {e}")))
        .collect::<Result<Vec<_>>>()?;
    if v.is_empty() {
        bail!("--{flag} names no size");
    }
    Ok(v)
}

/// The JSON of `kvtier plan --json`.
#[derive(Debug, serde::Serialize)]
struct PlanReport {
    trace: TraceStats,
    model: ModelKv,
    codec: &'static str,
    hardware: Hardware,
    #[serde(flatten)]
    plan: Plan,
}

/// Runs `kvtier plan`.
pub fn run(a: &PlanArgs) -> Result<()> {
    if !(0.0..1.0).contains(&a.warmup) {
        bail!(
            "--warmup {}: a fraction from 0 up to (not including) 1",
            a.warmup
        );
    }
    let hardware = match &a.hardware {
        Some(p) => Hardware::load(p).map_err(anyhow::Error::msg)?,
        None => {
            let hw: Hardware =
                toml::from_str(THIS_MACHINE).context("the built-in hardware file")?;
            hw.check().map_err(anyhow::Error::msg)?;
            hw
        }
    };
    let model = ModelKv::load(&a.model).map_err(anyhow::Error::msg)?;
    let bytes_per_token = model
        .bytes_per_token(a.codec)
        .with_context(|| format!("codec {} cannot store {}'s KV", a.codec.name(), model.name))?;
    let parameters = model.parameters.with_context(|| {
        format!("{}: cannot tell the parameter count (no hidden_size, intermediate_size and vocab_size)", model.name)
    })?;
    let trace = crate::cmd_trace::read(&a.input)?;
    let tree = PrefixTree::new(&trace);
    let g1 = a.g1.unwrap_or(hardware.g1_kv_bytes);
    let mut configs = Vec::new();
    for &g2 in &sizes(&a.g2, "g2")? {
        for &g3 in &sizes(&a.g3, "g3")? {
            for &g4 in &sizes(&a.g4, "g4")? {
                configs.push(Tiers {
                    g1_bytes: g1,
                    g2_bytes: g2,
                    g3_bytes: g3,
                    g4_bytes: g4,
                });
            }
        }
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pm = PlanModel {
        bytes_per_token,
        parameters,
    };
    let plan = plan::plan(
        &tree,
        trace.block_size,
        pm,
        &hardware,
        &configs,
        a.warmup,
        threads,
    );
    let report = PlanReport {
        trace: stats::stats(&trace),
        model,
        codec: a.codec.name(),
        hardware,
        plan,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", plan::text(&report.plan, &report.hardware.name));
    }
    Ok(())
}
