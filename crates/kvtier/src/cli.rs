//! The command line: every command, flag and help text.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::cli_model::{CheckpointBenchArgs, ModelBenchArgs, ModelLoadArgs, ModelSynthArgs};
use crate::cmd_model_init::ModelInitArgs;
use crate::cmd_serve::ServeArgs;
use crate::size::parse_size;
use crate::slot_layout::check_block_bytes;

/// Largest in-flight depth a case may ask for (the I/O engine's limit).
pub const MAX_IN_FLIGHT: u32 = kvtier_io::engine::MAX_IN_FLIGHT as u32;

/// kvtier: the storage path for LLM inference.
///
/// Keeps KV cache, weights and checkpoints in the fastest tier that holds
/// them (host DRAM, local NVMe or any mounted path) and moves them at the
/// speed of the hardware.
#[derive(Debug, Parser)]
#[command(name = "kvtier", version, propagate_version = true)]
pub struct Cli {
    /// Log filter for stderr, e.g. `info` or `kvtier=debug,kvtier_store=trace`
    /// [default: $RUST_LOG, else `warn`].
    #[arg(long, global = true, value_name = "FILTER")]
    pub log: Option<String>,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// kvtier's main job: the cold-recovery benchmark. Long-context sessions
    /// whose KV was computed once and evicted come back at concurrency 1, 8
    /// and 16; recompute (baseline) vs restore from the tiers (kvtier), with
    /// TTFT, throughput, restore GB/s, energy and cost per token, and gates.
    /// Generates the embedded `small` model if no --model is given.
    Bench(crate::cmd_bench::BenchCmdArgs),
    /// Show the machine, the I/O backend, and whether O_DIRECT works on the
    /// cache directory.
    Info(InfoArgs),
    /// The tiered KV block store.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Safetensors models: load, benchmark loaders, synthesize test models.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Crash-safe checkpoints.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Serve a model over the OpenAI API (`/v1/completions`,
    /// `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`), its KV
    /// cache in G1 pages over the tiered store (G2 memory, G3 under
    /// `--cache-dir`, G4 at `--remote`). Prints `listening on http://ADDR` first on stdout;
    /// SIGINT/SIGTERM finish the requests in flight and flush the cache.
    Serve(ServeArgs),
    /// Compute a prompt's KV on this node and leave it in the shared G4
    /// pool (`--remote`), for a `kvtier serve` decode node with the same
    /// model, `--block-tokens` and `--tenant-salt` to restore instead of
    /// computing. Exits once every block is in G4.
    Prefill(crate::cmd_prefill::PrefillArgs),
}

/// `kvtier model ...` commands.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Write an embedded default model (deterministic random weights,
    /// Llama architecture, a byte-level tokenizer) to serve with no
    /// download: `tiny` for tests, `small` (~90 M parameters) for benchmarks.
    Init(ModelInitArgs),
    /// Load a model (sharded safetensors) with the kvtier loader and report
    /// GB/s, shards, direct or buffered I/O (and why) and the I/O backend.
    Load(ModelLoadArgs),
    /// Load a model with every contender (naive, mmap, kvtier and, when
    /// Python is present, python-safetensors and runai-streamer), page cache
    /// dropped before each, interleaved, with the device's raw O_DIRECT read
    /// limit and the first-touch RAM rate measured in the same run.
    ///
    /// Cold: page cache dropped (or, not root, the files evicted), freed RAM
    /// left to settle `--settle-secs`, fresh destination memory. Warm:
    /// destination memory touched before timing. Prints median GB/s, the
    /// fraction of the device limit and ratios to naive and runai-streamer.
    /// The device limit is measured on the model's own shards (up to 1 GiB
    /// of them); the Python helper and its logs live in a
    /// `kvtier-bench-<pid>` directory under `--scratch` (default: the model
    /// directory), removed at the end.
    Bench(ModelBenchArgs),
    /// Write a synthetic sharded safetensors model (pseudo-random F16/F32
    /// tensors, Hugging Face shard names and index) to benchmark on.
    Synth(ModelSynthArgs),
}

/// `kvtier checkpoint ...` commands.
#[derive(Debug, Subcommand)]
pub enum CheckpointCommand {
    /// Save the same tensors durably with a naive writer (safetensors
    /// serialize_to_file + fsync) and with the kvtier checkpoint writer,
    /// interleaved, with the device's raw O_DIRECT write limit measured in
    /// the same run. Files live in a `kvtier-bench-<pid>` directory under
    /// `--dir`, removed at the end unless `--keep`.
    Bench(CheckpointBenchArgs),
}

/// Flags of `kvtier info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Cache directory to probe for O_DIRECT (not created; when missing, its
    /// nearest existing parent is probed).
    #[arg(long, value_name = "DIR", default_value = "./kvtier-cache")]
    pub cache_dir: PathBuf,

    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `kvtier store ...` commands.
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Write a KV block set to disk, read it back cold with several depths
    /// of reads in flight, and compare with the device's own limit measured
    /// in the same run.
    ///
    /// Steps: write `--total-bytes` of blocks of `--block-bytes` into a disk
    /// tier (G3) under `--dir`; write a device-limit file (min(total, 1 GiB))
    /// with O_DIRECT; then, `--repeat` times, for each `--in-flight` depth,
    /// measure the raw device limit (O_DIRECT sequential reads, 4 MiB, 32 in
    /// flight) and read every block back through the store, verified, page
    /// cache dropped first when root. Prints the median GB/s (10^9 bytes/s)
    /// of each case and its fraction of the median device limit. Files live
    /// in a `kvtier-bench-<pid>` subdirectory, removed at the end unless
    /// `--keep`.
    Bench(BenchArgs),
}

/// Flags of `kvtier store bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Directory to put the block set in.
    #[arg(long, value_name = "DIR", default_value = "./kvtier-cache/bench")]
    pub dir: PathBuf,

    /// Stripe the block set over these directories instead of `--dir`
    /// (comma-separated; ideally one per device).
    #[arg(
        long,
        value_name = "DIR,...",
        value_delimiter = ',',
        conflicts_with = "dir"
    )]
    pub dirs: Vec<PathBuf>,

    /// Bytes of blocks to write and read back (e.g. 4GiB, 512MiB).
    #[arg(long, value_name = "SIZE", default_value = "4GiB", value_parser = size_arg)]
    pub total_bytes: u64,

    /// Size of one block, i.e. one disk slot: a multiple of 4 KiB from 8 KiB
    /// to 1 GiB (typical: 256KiB, 2MiB, 16MiB).
    #[arg(long, value_name = "SIZE", default_value = "2MiB", value_parser = block_bytes_arg)]
    pub block_bytes: u64,

    /// Reads in flight for each case, comma-separated (1 to 256 each).
    #[arg(
        long,
        value_name = "N,...",
        value_delimiter = ',',
        default_value = "1,4,16,32",
        value_parser = in_flight_arg
    )]
    pub in_flight: Vec<u32>,

    /// Times to run every case; the median is reported.
    #[arg(long, value_name = "N", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,

    /// Blocks per store read call [default: max(4 x in-flight, 64), at most
    /// 512 MiB of buffers but never fewer than in-flight].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub chunk_blocks: Option<u32>,

    /// Print exactly one JSON object on stdout (no progress bar).
    #[arg(long)]
    pub json: bool,

    /// Keep the bench files instead of deleting them at the end.
    #[arg(long)]
    pub keep: bool,
}

impl BenchArgs {
    /// The directories to stripe over: `--dirs`, or else `--dir`.
    pub fn stripe_dirs(&self) -> Vec<PathBuf> {
        if self.dirs.is_empty() {
            vec![self.dir.clone()]
        } else {
            self.dirs.clone()
        }
    }
}

fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s)
}

fn block_bytes_arg(s: &str) -> Result<u64, String> {
    let n = parse_size(s)?;
    check_block_bytes(n)?;
    Ok(n)
}

fn in_flight_arg(s: &str) -> Result<u32, String> {
    let n: u32 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number"))?;
    if n == 0 || n > MAX_IN_FLIGHT {
        return Err(format!(
            "in-flight depth must be 1 to {MAX_IN_FLIGHT}, got {n}"
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn bench_defaults_and_lists() {
        let cli = Cli::parse_from(["kvtier", "store", "bench"]);
        let Command::Store(StoreCommand::Bench(b)) = cli.command else {
            panic!("not bench")
        };
        assert_eq!(b.total_bytes, 4 << 30);
        assert_eq!(b.block_bytes, 2 << 20);
        assert_eq!(b.in_flight, [1, 4, 16, 32]);
        assert_eq!(b.repeat, 3);
        assert_eq!(b.stripe_dirs(), [PathBuf::from("./kvtier-cache/bench")]);

        let cli = Cli::parse_from([
            "kvtier",
            "store",
            "bench",
            "--in-flight",
            "2,8",
            "--block-bytes",
            "256KiB",
            "--dirs",
            "/a,/b",
        ]);
        let Command::Store(StoreCommand::Bench(b)) = cli.command else {
            panic!("not bench")
        };
        assert_eq!(b.in_flight, [2, 8]);
        assert_eq!(b.block_bytes, 256 << 10);
        assert_eq!(b.stripe_dirs(), [PathBuf::from("/a"), PathBuf::from("/b")]);
    }

    #[test]
    fn bad_values_are_errors() {
        for args in [
            &["--block-bytes", "1000"][..],
            &["--block-bytes", "4KiB"],
            &["--block-bytes", "lots"],
            &["--total-bytes", "4 parsecs"],
            &["--in-flight", "0"],
            &["--in-flight", "1,,4"],
            &["--in-flight", "257"],
            &["--repeat", "0"],
            &["--dir", "/a", "--dirs", "/b"],
        ] {
            let mut argv = vec!["kvtier", "store", "bench"];
            argv.extend_from_slice(args);
            assert!(Cli::try_parse_from(&argv).is_err(), "{argv:?}");
        }
    }
}
