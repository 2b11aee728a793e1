//! Flags of `kvtier model load|bench|synth` and `kvtier checkpoint bench`
//! (the commands themselves are declared in `cli.rs`).

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use kvtier_io::DIRECT_IO_ALIGN;
use kvtier_io::loader::LoaderConfig;

use kvtier_bench::common::size::parse_size;

/// Largest in-flight depth any flag accepts (the I/O engine's limit).
pub const MAX_IN_FLIGHT: u32 = kvtier_io::MAX_IN_FLIGHT as u32;

/// How the kvtier loader reads (defaults: the library's).
#[derive(Debug, Clone, Args)]
pub struct LoaderFlags {
    /// Bytes per read of the kvtier loader: a multiple of 4 KiB.
    #[arg(long, value_name = "SIZE", default_value = "8MiB", value_parser = io_bytes_arg)]
    pub chunk_bytes: u64,

    /// Reads the kvtier loader keeps in flight.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = in_flight_arg)]
    pub in_flight: u32,

    /// Read buffered instead of probing for O_DIRECT.
    #[arg(long)]
    pub buffered: bool,

    /// Do not fault the destination memory in on a helper thread while the
    /// reads run (the default does, so page faults overlap the reads).
    #[arg(long)]
    pub no_prefault: bool,
}

impl LoaderFlags {
    /// The loader configuration these flags ask for.
    pub fn config(&self) -> LoaderConfig {
        LoaderConfig {
            chunk_bytes: self.chunk_bytes as usize,
            in_flight: self.in_flight as usize,
            direct: if self.buffered { Some(false) } else { None },
            prefault: !self.no_prefault,
        }
    }
}

/// Flags of `kvtier model load`.
#[derive(Debug, Args)]
pub struct ModelLoadArgs {
    /// Model directory: `model.safetensors.index.json`, else
    /// `model.safetensors`, else every `*.safetensors` in it.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,

    /// Print exactly one JSON object on stdout (no progress bar).
    #[arg(long)]
    pub json: bool,

    /// Where the weights go: `cpu` (host memory, reads land in place) or
    /// `cuda`/`cuda:N` (GPU memory, through a ring of pinned staging
    /// buffers with copies overlapped with the reads; needs a build with
    /// `--features cuda`).
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,

    /// Pinned staging buffers of a GPU load (each `--chunk-bytes`).
    #[arg(long, value_name = "N", default_value_t = kvtier_io::loader::staged::DEFAULT_RING as u16,
          value_parser = clap::value_parser!(u16).range(2..=1024))]
    pub staging_buffers: u16,

    /// After the timed load, read every tensor back from where it landed
    /// (host or GPU memory) and compare it with the file's bytes, read
    /// plainly; a difference fails the command (`"verified": true` in the
    /// JSON otherwise).
    #[arg(long)]
    pub verify: bool,

    /// How to read.
    #[command(flatten)]
    pub loader: LoaderFlags,
}

/// Which destination-memory states `kvtier model bench` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchMode {
    /// Page cache dropped, freed RAM settled, fresh destination memory.
    Cold,
    /// Page cache dropped, destination memory touched before timing.
    Warm,
    /// Both, cold first.
    Both,
}

/// Flags of `kvtier model bench`.
#[derive(Debug, Args)]
pub struct ModelBenchArgs {
    /// Model directory (as for `kvtier model load`).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,

    /// Print exactly one JSON object on stdout (no progress bar).
    #[arg(long)]
    pub json: bool,

    /// Times to run every contender; the median is reported.
    #[arg(long, value_name = "N", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,

    /// Cold (fresh destination memory), warm (destination touched before
    /// timing), or both. The page cache is dropped before every load in
    /// every mode.
    #[arg(long, value_enum, default_value_t = BenchMode::Cold)]
    pub mode: BenchMode,

    /// Seconds to wait after dropping the page cache (and freeing the last
    /// contender's memory) before each load, so freed RAM goes back to the
    /// hypervisor as it would between real loads.
    #[arg(long, value_name = "SECS", default_value_t = 6.0, value_parser = secs_arg)]
    pub settle_secs: f64,

    /// Run only these contenders (comma-separated names) [default: all].
    #[arg(long, value_name = "NAME,...", value_delimiter = ',',
          value_parser = ["naive", "mmap", "kvtier", "python-safetensors", "runai-streamer"])]
    pub only: Vec<String>,

    /// Leave out the Python contenders (`python-safetensors`,
    /// `runai-streamer`).
    #[arg(long)]
    pub no_python: bool,

    /// Do not pip-install missing Python packages (their contenders are
    /// reported as skipped).
    #[arg(long)]
    pub no_install: bool,

    /// The Python interpreter for the Python contenders.
    #[arg(long, value_name = "PATH", default_value = "python3")]
    pub python: PathBuf,

    /// Directory for the Python helper script and its logs (a
    /// `kvtier-bench-<pid>` subdirectory, removed at the end) [default: the
    /// model directory].
    #[arg(long, value_name = "DIR")]
    pub scratch: Option<PathBuf>,

    /// How the kvtier contender reads.
    #[command(flatten)]
    pub loader: LoaderFlags,

    /// Bytes per read of the device-limit measurement (the virtual disk
    /// here only reaches its limit with reads of 16 MiB or more).
    #[arg(long, value_name = "SIZE", default_value = "16MiB", value_parser = io_bytes_arg)]
    pub limit_io_bytes: u64,

    /// Bytes of each device-limit sample, read from the shards into
    /// buffers held for the whole run [default: the model's size, at most
    /// 1 GiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub limit_bytes: Option<u64>,
}

/// Flags of `kvtier model synth`.
#[derive(Debug, Args)]
pub struct ModelSynthArgs {
    /// Directory to write the model into (created if missing).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,

    /// Bytes of tensor data in all (e.g. 4GiB, 16MiB).
    #[arg(long, value_name = "SIZE", default_value = "4GiB", value_parser = parse_size)]
    pub bytes: u64,

    /// Number of shard files.
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub shards: u32,

    /// Replace an existing model in DIR (its `*.safetensors` and index).
    #[arg(long)]
    pub force: bool,

    /// Seed of the pseudo-random tensor contents.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
}

/// Flags of `kvtier checkpoint bench`.
#[derive(Debug, Args)]
pub struct CheckpointBenchArgs {
    /// Directory to write the checkpoints in (a `kvtier-bench-<pid>`
    /// subdirectory, removed at the end).
    #[arg(long, value_name = "DIR", default_value = "./kvtier-cache/bench")]
    pub dir: PathBuf,

    /// Bytes of tensor data per checkpoint (e.g. 4GiB, 16MiB).
    #[arg(long, value_name = "SIZE", default_value = "4GiB", value_parser = parse_size)]
    pub bytes: u64,

    /// Print exactly one JSON object on stdout (no progress bar).
    #[arg(long)]
    pub json: bool,

    /// Times to run every writer; the median is reported.
    #[arg(long, value_name = "N", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,

    /// Seconds to wait after dropping the page cache before each save.
    #[arg(long, value_name = "SECS", default_value_t = 6.0, value_parser = secs_arg)]
    pub settle_secs: f64,

    /// Target bytes of tensor data per shard file (both writers).
    #[arg(long, value_name = "SIZE", default_value = "2GiB", value_parser = parse_size)]
    pub shard_bytes: u64,

    /// Bytes per write of the kvtier writer: a multiple of 4 KiB
    /// [default: the library's].
    #[arg(long, value_name = "SIZE", value_parser = io_bytes_arg)]
    pub chunk_bytes: Option<u64>,

    /// Writes the kvtier writer keeps in flight [default: the library's].
    #[arg(long, value_name = "N", value_parser = in_flight_arg)]
    pub in_flight: Option<u32>,

    /// Threads gathering chunks for the kvtier writer (and fsyncing its
    /// files) [default: the library's].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: Option<u32>,

    /// Run only these writers (comma-separated) [default: both].
    #[arg(long, value_name = "NAME,...", value_delimiter = ',',
          value_parser = ["naive", "kvtier"])]
    pub only: Vec<String>,

    /// Give the kvtier writer write buffers from a pool touched before
    /// timing, so even its first save needs no fresh memory. Without it the
    /// writer's process-wide pool keeps buffers from one save to the next,
    /// so only the first save faults fresh memory in.
    #[arg(long)]
    pub reuse_buffers: bool,

    /// Bytes per write of the device write-limit measurement.
    #[arg(long, value_name = "SIZE", default_value = "16MiB", value_parser = io_bytes_arg)]
    pub limit_io_bytes: u64,

    /// Place every tensor 64 bytes past a page boundary (as a general-purpose
    /// allocator does) instead of at one (as pinned staging buffers and
    /// kvtier-loaded checkpoints are), so the kvtier writer must copy every
    /// byte into its aligned buffers instead of writing tensors from their
    /// memory.
    #[arg(long)]
    pub unaligned: bool,

    /// Keep the bench directory instead of deleting it at the end.
    #[arg(long)]
    pub keep: bool,
}

fn io_bytes_arg(s: &str) -> Result<u64, String> {
    let n = parse_size(s)?;
    if n == 0 || !n.is_multiple_of(DIRECT_IO_ALIGN as u64) || n > (1 << 30) {
        return Err(format!(
            "must be a non-zero multiple of 4 KiB up to 1 GiB, got {n} bytes"
        ));
    }
    Ok(n)
}

/// Parses an in-flight depth (every `--in-flight` flag): 1 to
/// [`MAX_IN_FLIGHT`].
pub(crate) fn in_flight_arg(s: &str) -> Result<u32, String> {
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

fn secs_arg(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.0..=600.0).contains(&v) {
        return Err(format!("must be 0 to 600 seconds, got {v}"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_defaults_match_the_library() {
        let flags = LoaderFlags {
            chunk_bytes: 8 << 20,
            in_flight: 32,
            buffered: false,
            no_prefault: false,
        };
        assert_eq!(flags.config(), LoaderConfig::default());
    }

    #[test]
    fn value_checks() {
        assert!(io_bytes_arg("4KiB").is_ok());
        assert!(io_bytes_arg("1000").is_err());
        assert!(io_bytes_arg("0").is_err());
        assert!(in_flight_arg("0").is_err());
        assert!(in_flight_arg("x").is_err());
        assert_eq!(in_flight_arg("16"), Ok(16));
        assert!(secs_arg("-1").is_err());
        assert_eq!(secs_arg("0"), Ok(0.0));
    }
}
