//! The command line: every command, flag and help text.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::cli_model::{
    CheckpointBenchArgs, ModelBenchArgs, ModelLoadArgs, ModelSynthArgs, in_flight_arg,
};
use crate::cmd_model_init::ModelInitArgs;
use crate::cmd_serve::ServeArgs;
use kvtier_bench::common::size::parse_size;
use kvtier_bench::store_bench::slot_layout::check_block_bytes;
use kvtier_bench::store_bench::{G3_DEFAULT_TOTAL_BYTES, G4_DEFAULT_TOTAL_BYTES};

use crate::remote_flags::RemoteFlags;

/// Parses `--kv-offload-codec`: `none`, `bf16`, `fp8-e4m3` or `int8`.
pub fn codec_arg(s: &str) -> Result<kvtier_store::KvCodec, String> {
    kvtier_store::KvCodec::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = kvtier_store::KvCodec::ALL
            .iter()
            .map(|c| c.name())
            .collect();
        format!("unknown codec {s:?}: one of {}", names.join(", "))
    })
}

/// Parses `--restore-yield`: a finite factor from 0 to 100.
pub fn restore_yield_arg(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(k) if (0.0..=100.0).contains(&k) => Ok(k),
        Ok(_) => Err(format!("{s} is out of range: a factor from 0 to 100")),
        Err(e) => Err(format!("{s:?} is not a number: {e}")),
    }
}

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
    /// `kvtier serve`'s config file: `--print-default` prints every key at
    /// its default with each flag's help as comments (for `serve --config`).
    Config(ConfigArgs),

    /// Public KV-cache traces (Mooncake, RAGPulse, agentic sessions, a
    /// generic JSONL): `stats` and `sim` through kvtier's own tier policies,
    /// `replay` against live servers.
    #[command(subcommand)]
    Trace(crate::cmd_trace::TraceCommand),

    /// For a trace, a model and a machine: each tier configuration's hit
    /// tokens per tier, restore bandwidth, SSD writes, accelerator time,
    /// TTFT, energy and cost per million tokens, against the engine's own
    /// cache alone; names the smallest within 1 point of an infinite cache.
    Plan(crate::cmd_plan::PlanArgs),
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
    /// in the same run (`--tier g4`: G4 restore vs redis-benchmark GET).
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
    ///
    /// With `--tier g4 --remote redis://HOST:PORT`: G4 restore over the
    /// network beside `redis-benchmark` GET throughput for the same values,
    /// in the same run. Puts `--total-bytes` (default 1 GiB for g4) of
    /// blocks of `--block-bytes` of KV payload through a `TieredStore` whose
    /// only tier is G4 (no G2, no G3), waits for the write-through, then,
    /// `--repeat` times, alternating which side goes first: reads every
    /// block back through the store's restore path (`get_many`, the largest
    /// `--in-flight` depth of GETs in flight, every block verified), and runs
    /// `redis-benchmark -c <that depth> -P 1 -r <blocks> -n <max(blocks,
    /// 256)> --csv GET <the same keys>`, so both read the same values with
    /// the same number of requests outstanding; redis-benchmark writes
    /// nothing. Prints the median GB/s (10^9 bytes of values per second) of
    /// each, requests/s, and g4 / redis-benchmark against the goal (>= 0.80).
    /// redis-benchmark is `$KVTIER_REDIS_BENCHMARK`, else `redis-benchmark`
    /// or `valkey-benchmark` on PATH (a password in the URL goes to it as
    /// `-a`); cluster and S3 URLs measure the G4 side only. The blocks live
    /// under the namespace `<--remote-namespace>-bench-<pid>-<hex>`, with a
    /// time limit of at least 30 s per batch, expire after
    /// `--remote-ttl-secs` (default 3600 here) and are deleted at the end
    /// unless `--keep`.
    Bench(BenchArgs),
}

/// Which tier `kvtier store bench` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum BenchTier {
    /// G3: the local disk tier under `--dir` / `--dirs`, against the
    /// device's raw read limit.
    #[default]
    G3,
    /// G4: the shared pool at `--remote`, against redis-benchmark GET.
    G4,
}

/// Flags of `kvtier store bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Tier to measure: g3 (local disk, the default) or g4 (the shared pool
    /// at --remote, beside redis-benchmark).
    #[arg(long, value_enum, value_name = "TIER", default_value_t = BenchTier::G3)]
    pub tier: BenchTier,

    /// Directory to put the block set in (g3 only).
    #[arg(long, value_name = "DIR", default_value = "./kvtier-cache/bench")]
    pub dir: PathBuf,

    /// Stripe the block set over these directories instead of `--dir`
    /// (comma-separated; ideally one per device; g3 only).
    #[arg(
        long,
        value_name = "DIR,...",
        value_delimiter = ',',
        conflicts_with = "dir"
    )]
    pub dirs: Vec<PathBuf>,

    /// Bytes of blocks to write and read back (e.g. 4GiB, 512MiB)
    /// [default: 4GiB for g3; 1GiB for g4, which must fit in the pool's
    /// memory].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub total_bytes: Option<u64>,

    /// Size of one block, i.e. one disk slot: a multiple of 4 KiB from 8 KiB
    /// to 1 GiB (typical: 256KiB, 2MiB, 16MiB). With --tier g4 it is the KV
    /// payload of a block; the value in the pool is 128 bytes more (the
    /// block header).
    #[arg(long, value_name = "SIZE", default_value = "2MiB", value_parser = block_bytes_arg)]
    pub block_bytes: u64,

    /// Reads in flight for each case, comma-separated (1 to 256 each). With
    /// --tier g4 only the largest is used: G4 GETs in flight, and as many
    /// redis-benchmark clients.
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
    /// 512 MiB of buffers but never fewer than in-flight]. With --tier g4,
    /// one call is one G4 batch under one time limit.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub chunk_blocks: Option<u32>,

    /// Print exactly one JSON object on stdout (no progress bar).
    #[arg(long)]
    pub json: bool,

    /// Keep the bench files (with --tier g4: the blocks in the pool)
    /// instead of deleting them at the end.
    #[arg(long)]
    pub keep: bool,

    /// The G4 pool (--tier g4 only; --remote with g3 is an error, while
    /// $KVTIER_REMOTE alone is ignored by g3). See the command's help for
    /// how the bench adjusts namespace, time limit and expiry.
    #[command(flatten)]
    pub remote: RemoteFlags,
}

impl BenchArgs {
    /// `--total-bytes`, or the tier's default.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes.unwrap_or(match self.tier {
            BenchTier::G3 => G3_DEFAULT_TOTAL_BYTES,
            BenchTier::G4 => G4_DEFAULT_TOTAL_BYTES,
        })
    }

    /// Checks that the tier and `--remote` go together: g4 needs it, g3
    /// refuses one given on the command line (one only from
    /// `$KVTIER_REMOTE`, a deployment's setting, is ignored by g3).
    pub fn check_tier(&self) -> Result<(), String> {
        match (self.tier, &self.remote.remote) {
            (BenchTier::G4, None) => Err("--tier g4 needs --remote URL, the G4 pool to \
                                          measure (e.g. --remote redis://127.0.0.1:6379)"
                .into()),
            (BenchTier::G3, Some(url))
                if std::env::var("KVTIER_REMOTE").ok().as_deref() != Some(url.as_str()) =>
            {
                Err(
                    "--remote is for --tier g4 (the default tier, g3, reads local disk); \
                     add --tier g4 or drop --remote"
                        .into(),
                )
            }
            _ => Ok(()),
        }
    }

    /// The directories to stripe over: `--dirs`, or else `--dir`.
    pub fn stripe_dirs(&self) -> Vec<PathBuf> {
        if self.dirs.is_empty() {
            vec![self.dir.clone()]
        } else {
            self.dirs.clone()
        }
    }
}

fn block_bytes_arg(s: &str) -> Result<u64, String> {
    let n = parse_size(s)?;
    check_block_bytes(n)?;
    Ok(n)
}

/// Flags of `kvtier config`.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArgs {
    /// Print the whole `kvtier serve` config file (TOML), every key at its
    /// default.
    #[arg(long, required = true)]
    pub print_default: bool,
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
        assert_eq!(b.tier, BenchTier::G3);
        assert_eq!(b.total_bytes, None);
        assert_eq!(b.total_bytes(), 4 << 30);
        assert_eq!(b.block_bytes, 2 << 20);
        assert_eq!(b.in_flight, [1, 4, 16, 32]);
        assert_eq!(b.repeat, 3);
        assert_eq!(b.stripe_dirs(), [PathBuf::from("./kvtier-cache/bench")]);
        assert_eq!(b.remote.remote_namespace, "kvtier");

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
    fn bench_tier_g4_defaults_and_remote() {
        let parse = |args: &[&str]| {
            let mut argv = vec!["kvtier", "store", "bench"];
            argv.extend_from_slice(args);
            let cli = Cli::try_parse_from(&argv).unwrap();
            let Command::Store(StoreCommand::Bench(b)) = cli.command else {
                panic!("not bench")
            };
            b
        };
        let b = parse(&["--tier", "g4", "--remote", "redis://h:1"]);
        assert_eq!(b.tier, BenchTier::G4);
        assert_eq!(b.total_bytes(), 1 << 30);
        assert_eq!(b.remote.remote.as_deref(), Some("redis://h:1"));
        assert!(b.check_tier().is_ok());
        let b = parse(&["--tier", "g4", "--total-bytes", "8MiB"]);
        assert_eq!(b.total_bytes(), 8 << 20);
        if std::env::var_os("KVTIER_REMOTE").is_none() {
            assert!(b.check_tier().unwrap_err().contains("--remote"));
        }
        let b = parse(&[
            "--total-bytes",
            "8MiB",
            "--remote",
            "redis://kvtier-test-only:1",
        ]);
        assert_eq!(b.total_bytes(), 8 << 20);
        assert!(b.check_tier().unwrap_err().contains("--tier g4"));
        assert!(Cli::try_parse_from(["kvtier", "store", "bench", "--tier", "g5"]).is_err());
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

    #[test]
    fn serve_flag_defaults_are_the_library_defaults() {
        if std::env::var_os("KVTIER_REMOTE").is_some() {
            return;
        }
        let cli = Cli::try_parse_from(["kvtier", "serve", "--model", "m"]).unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        let want = kvtier_server::ServeOptions::new("m");
        assert_eq!(format!("{:?}", args.options()), format!("{want:?}"));
    }
}
