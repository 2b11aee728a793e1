//! `kvtier model load|bench|synth` and `kvtier checkpoint bench`: the flags
//! mapped onto their kvtier-bench options, one library call each.

use anyhow::Result;
use kvtier_bench::TextReport;
use kvtier_bench::checkpoint_bench::{CheckpointBenchOptions, run_checkpoint_bench};
use kvtier_bench::models::model_bench::{LoadModes, ModelBenchOptions, run_model_bench};
use kvtier_bench::models::model_load::{ModelLoadOptions, run_model_load};
use kvtier_bench::models::model_synth::{ModelSynthOptions, run_model_synth};

use crate::cli_model::{
    BenchMode, CheckpointBenchArgs, ModelBenchArgs, ModelLoadArgs, ModelSynthArgs,
};
use crate::print_report::print_report;

/// Runs `kvtier model load`.
pub fn load(args: &ModelLoadArgs) -> Result<()> {
    let opts = ModelLoadOptions {
        dir: args.dir.clone(),
        device: args.device.clone(),
        staging_buffers: usize::from(args.staging_buffers),
        loader: args.loader.config(),
        verify: args.verify,
        progress: !args.json,
    };
    print_report(&run_model_load(&opts)?, args.json)
}

/// Runs `kvtier model bench`.
pub fn bench(args: &ModelBenchArgs) -> Result<()> {
    let opts = ModelBenchOptions {
        dir: args.dir.clone(),
        repeat: args.repeat,
        modes: match args.mode {
            BenchMode::Cold => LoadModes::Cold,
            BenchMode::Warm => LoadModes::Warm,
            BenchMode::Both => LoadModes::Both,
        },
        settle_secs: args.settle_secs,
        only: args.only.clone(),
        python_contenders: !args.no_python,
        install_python_packages: !args.no_install,
        python: args.python.clone(),
        scratch: args.scratch.clone(),
        loader: args.loader.config(),
        limit_io_bytes: args.limit_io_bytes,
        limit_bytes: args.limit_bytes,
        progress: !args.json,
    };
    print_report(&run_model_bench(&opts)?, args.json)
}

/// Runs `kvtier model synth`.
pub fn synth(args: &ModelSynthArgs) -> Result<()> {
    let opts = ModelSynthOptions {
        dir: args.dir.clone(),
        bytes: args.bytes,
        shards: args.shards,
        force: args.force,
        seed: args.seed,
        progress: true,
    };
    print!("{}", run_model_synth(&opts)?.table());
    Ok(())
}

/// Runs `kvtier checkpoint bench`.
pub fn checkpoint_bench(args: &CheckpointBenchArgs) -> Result<()> {
    let opts = CheckpointBenchOptions {
        dir: args.dir.clone(),
        bytes: args.bytes,
        repeat: args.repeat,
        settle_secs: args.settle_secs,
        shard_bytes: args.shard_bytes,
        chunk_bytes: args.chunk_bytes.map(|c| c as usize),
        in_flight: args.in_flight.map(|q| q as usize),
        threads: args.threads.map(|t| t as usize),
        only: args.only.clone(),
        reuse_buffers: args.reuse_buffers,
        limit_io_bytes: args.limit_io_bytes,
        unaligned: args.unaligned,
        keep: args.keep,
        progress: !args.json,
    };
    print_report(&run_checkpoint_bench(&opts)?, args.json)
}
