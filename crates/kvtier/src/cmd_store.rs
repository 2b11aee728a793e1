//! `kvtier store bench`: the flags mapped onto the G3 bench
//! ([`kvtier_bench::store_bench::run_g3`]) or, with `--tier g4`, the G4
//! bench ([`kvtier_bench::store_bench::g4::run_g4`]).

use anyhow::{Result, bail};
use kvtier_bench::store_bench::g4::{G4BenchOptions, run_g4};
use kvtier_bench::store_bench::{G3BenchOptions, run_g3};

use crate::cli::{BenchArgs, BenchTier};
use crate::print_report::print_report;

/// Runs the bench of `--tier` and prints its report (a table, or one JSON
/// object).
pub fn run(args: &BenchArgs) -> Result<()> {
    args.check_tier().map_err(anyhow::Error::msg)?;
    match args.tier {
        BenchTier::G3 => {
            let opts = G3BenchOptions {
                dirs: args.stripe_dirs(),
                total_bytes: args.total_bytes(),
                block_bytes: args.block_bytes,
                in_flight: args.in_flight.clone(),
                repeat: args.repeat,
                chunk_blocks: args.chunk_blocks,
                keep: args.keep,
                progress: !args.json,
            };
            print_report(&run_g3(&opts)?, args.json)
        }
        BenchTier::G4 => {
            let Some(remote) = args.remote.config() else {
                bail!("--tier g4 needs --remote URL, the G4 pool to measure");
            };
            let opts = G4BenchOptions {
                total_bytes: args.total_bytes(),
                block_bytes: args.block_bytes,
                in_flight: args.in_flight.clone(),
                repeat: args.repeat,
                chunk_blocks: args.chunk_blocks,
                keep: args.keep,
                progress: !args.json,
                ..G4BenchOptions::new(remote)
            };
            print_report(&run_g4(&opts)?, args.json)
        }
    }
}
