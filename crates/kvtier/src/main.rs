//! `kvtier`: the command-line binary.
//!
//! * `kvtier bench`: the main job, the cold-recovery benchmark with gates.
//! * `kvtier info`: the machine, the I/O backend, O_DIRECT on the cache dir.
//! * `kvtier store bench`: write a KV block set, read it back cold at several
//!   in-flight depths, compare with the device's limit measured in the run.
//! * `kvtier model load|bench|synth`: load a safetensors model; benchmark
//!   loaders against each other and the device; write a test model.
//! * `kvtier checkpoint bench`: naive vs kvtier durable checkpoint saves
//!   against the device's write limit.
//! * `kvtier model init`: write an embedded default model (tiny, small).
//! * `kvtier serve`: the OpenAI-compatible HTTP server (`kvtier-server`).
//! * `kvtier prefill`: compute a prompt's KV and leave it in the G4 pool.
//! * `kvtier config --print-default`: `serve`'s whole config file.
//! * `kvtier trace stats|sim`: public KV-cache traces through kvtier's own
//!   tier policies beside LRU, FIFO and the offline optimum; `kvtier trace
//!   replay`: a trace against live servers.
//! * `kvtier plan`: how much of each tier a trace needs for a model and a
//!   machine, and the hit rate, TTFT, energy and cost it buys.
//!
//! Errors go to stderr with their causes, and the exit status is non-zero.
//!
//! What lives where:
//!
//! * The command line: every command and flag (`cli.rs`), the model and
//!   checkpoint commands' flags (`cli_model.rs`), the G4 flags several
//!   commands share (`remote_flags.rs`), and `serve`'s settings from flags,
//!   environment and config file (`serve_config.rs`).
//! * One file per command, each mapping its flags onto one library call:
//!   `cmd_bench.rs`, `cmd_info.rs`, `cmd_model.rs`, `cmd_model_init.rs`,
//!   `cmd_plan.rs`, `cmd_prefill.rs`, `cmd_serve.rs`, `cmd_store.rs`,
//!   `cmd_trace.rs`, `cmd_trace_replay.rs`.
//! * How a command prints its result, text or `--json` (`print_report.rs`).

mod cli;
mod cli_model;
mod remote_flags;
mod serve_config;

mod cmd_bench;
mod cmd_info;
mod cmd_model;
mod cmd_model_init;
mod cmd_plan;
mod cmd_prefill;
mod cmd_serve;
mod cmd_store;
mod cmd_trace;
mod cmd_trace_replay;

mod print_report;

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use tracing_subscriber::EnvFilter;

use crate::cli::{CheckpointCommand, Cli, Command, ModelCommand, StoreCommand};

/// Sends logs to stderr, filtered by `--log`, else `RUST_LOG`, else `warn`.
fn init_logging(filter: Option<&str>) -> Result<()> {
    let filter = match filter {
        Some(f) => EnvFilter::try_new(f).with_context(|| format!("bad --log filter {f:?}"))?,
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init()
        .map_err(|e| anyhow::anyhow!("cannot set up logging: {e}"))
}

fn run(cli: Cli) -> Result<()> {
    init_logging(cli.log.as_deref())?;
    match cli.command {
        Command::Bench(args) => cmd_bench::run(&args),
        Command::Info(args) => cmd_info::run(&args),
        Command::Store(StoreCommand::Bench(args)) => cmd_store::run(&args),
        Command::Model(ModelCommand::Init(args)) => cmd_model_init::run(&args),
        Command::Model(ModelCommand::Load(args)) => cmd_model::load(&args),
        Command::Model(ModelCommand::Bench(args)) => cmd_model::bench(&args),
        Command::Model(ModelCommand::Synth(args)) => cmd_model::synth(&args),
        Command::Checkpoint(CheckpointCommand::Bench(args)) => cmd_model::checkpoint_bench(&args),
        Command::Serve(args) => cmd_serve::run(&args),
        Command::Prefill(args) => cmd_prefill::run(&args),
        Command::Trace(cmd) => cmd_trace::run(&cmd),
        Command::Plan(args) => cmd_plan::run(&args),
        Command::Config(args) => {
            if args.print_default {
                print!("{}", serve_config::print_default());
            }
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    // `serve` settings from KVTIER_* variables and --config become flags
    // ahead of the command line (serve_config.rs).
    let argv =
        match serve_config::expand_args(std::env::args_os().collect(), |k| std::env::var(k).ok()) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("error: {e:#}");
                return ExitCode::from(2);
            }
        };
    let cli = Cli::parse_from(argv);
    let threads = match &cli.command {
        Command::Serve(args) => args.threads.map(|n| n as usize),
        _ => None,
    };
    // SAFETY: before any thread starts (parsing the arguments starts none).
    unsafe { kvtier_engine::fix_cpu_threads(threads) };
    kvtier_engine::tune_host_allocator();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
