//! `kvtier checkpoint bench`: saves the same in-memory tensors durably with
//! a naive writer and with [`kvtier_io::checkpoint::save`], interleaved (A B
//! A B ...), with the device's raw sequential write limit (O_DIRECT, 4 MiB
//! x 32 in flight, then `fdatasync`) measured before every save, in the
//! same run.
//!
//! * `naive` ([`naive_writer`]): per shard, `safetensors::serialize_to_file`
//!   (buffered, 1 MiB `BufWriter`, temp file + rename), then `fsync` of the
//!   file; at the end `fsync` of the directory. Durable, not
//!   crash-consistent across shards.
//! * `kvtier`: the checkpoint writer (aligned parallel writes, O_DIRECT
//!   where possible, fsync of every file, manifest committed by rename,
//!   directory fsync). Durable and crash-consistent.
//!
//! The tensors live in one page-aligned allocation, each at a 4 KiB-aligned
//! address (as in pinned staging buffers, or a kvtier checkpoint loaded by
//! kvtier's loader), so the kvtier writer writes their bodies straight from
//! memory; `--unaligned` shifts each by 64 bytes (as a general-purpose
//! allocator places them), which makes it copy every byte.
//!
//! Both write into a fresh directory each time (removed after, untimed);
//! the page cache is dropped and freed RAM left to settle (and the host
//! below a virtual disk to flush the previous writes) before each save and
//! before each write-limit sample.

pub mod checkpoint_report;
pub mod naive_writer;

use std::alloc::Layout;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvtier_io::checkpoint::{SaveOptions, TensorRef, save};
use kvtier_io::recycle::RecyclingAllocator;
use kvtier_io::safetensors::TensorInfo;
use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, IoEngine, probe_direct};

use crate::bench_error::{BenchError, Result, StepContext, fail};
use crate::common::fill::{fill_random, random_state};
use crate::common::progress::progress_bar;
use crate::common::size::format_size;
use crate::machine::device_limit::{measure_write, random_write_patterns};
use crate::machine::host::{CacheDrops, first_touch_gbps, settle};
use crate::machine::run_dirs::RunDirs;
use crate::models::model_synth::plan_model;
use crate::reporting::stats::{fraction, median, paired_fraction};
use checkpoint_report::{CheckpointBenchReport, WriterReport};
use naive_writer::{group_shards, naive_save};

/// What the checkpoint bench measures (`kvtier checkpoint bench`).
#[derive(Debug, Clone)]
pub struct CheckpointBenchOptions {
    /// Directory to write the checkpoints in (a `kvtier-bench-<pid>`
    /// subdirectory, removed at the end unless `keep`).
    pub dir: PathBuf,
    /// Bytes of tensor data per checkpoint.
    pub bytes: u64,
    /// Times to run every writer; the median is reported.
    pub repeat: u32,
    /// Seconds to wait after dropping the page cache before each save.
    pub settle_secs: f64,
    /// Target bytes of tensor data per shard file (both writers).
    pub shard_bytes: u64,
    /// Bytes per write of the kvtier writer (default: the library's).
    pub chunk_bytes: Option<usize>,
    /// Writes the kvtier writer keeps in flight (default: the library's).
    pub in_flight: Option<usize>,
    /// Threads gathering chunks for the kvtier writer (and fsyncing its
    /// files) (default: the library's).
    pub threads: Option<usize>,
    /// Run only these writers (`naive`, `kvtier`) (default, empty: both).
    pub only: Vec<String>,
    /// Give the kvtier writer write buffers from a pool touched before
    /// timing.
    pub reuse_buffers: bool,
    /// Bytes per write of the device write-limit measurement.
    pub limit_io_bytes: u64,
    /// Place every tensor 64 bytes past a page boundary instead of at one,
    /// so the kvtier writer must copy every byte.
    pub unaligned: bool,
    /// Keep the bench directory instead of deleting it at the end.
    pub keep: bool,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl Default for CheckpointBenchOptions {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("./kvtier-cache/bench"),
            bytes: 4 << 30,
            repeat: 3,
            settle_secs: 6.0,
            shard_bytes: 2 << 30,
            chunk_bytes: None,
            in_flight: None,
            threads: None,
            only: Vec::new(),
            reuse_buffers: false,
            limit_io_bytes: 16 << 20,
            unaligned: false,
            keep: false,
            progress: true,
        }
    }
}

/// Largest device write-limit file.
pub const MAX_WRITE_LIMIT_BYTES: u64 = 4 << 30;
/// Bytes of each first-touch sample (the kvtier writer's default buffers).
const FIRST_TOUCH_BYTES: usize = 256 << 20;

#[derive(Debug, Default, Clone)]
struct Samples {
    gbps: Vec<f64>,
    limit_pos: Vec<usize>,
    files: usize,
    file_bytes: u64,
    direct: bool,
    borrowed_bytes: u64,
}

/// Bytes past a page boundary of each tensor with `--unaligned`.
const UNALIGNED_SHIFT: usize = 64;

/// Runs the bench and returns its report.
pub fn run_checkpoint_bench(opts: &CheckpointBenchOptions) -> Result<CheckpointBenchReport> {
    let plan = plan_model(opts.bytes, 1)?;
    let tensors: Vec<TensorInfo> = plan.into_iter().flat_map(|s| s.tensors).collect();
    let bytes: u64 = tensors.last().map_or(0, |t| t.data_offsets.1);
    if opts.shard_bytes == 0 {
        fail!("--shard-bytes must be more than 0");
    }
    let limit_io = opts.limit_io_bytes;
    let limit_bytes = bytes.min(MAX_WRITE_LIMIT_BYTES).div_ceil(limit_io).max(1) * limit_io;
    let run_dirs = RunDirs::create(
        std::slice::from_ref(&opts.dir),
        bytes,
        limit_bytes,
        opts.keep,
    )?;
    let work = run_dirs.first().to_path_buf();
    let engine = IoEngine::shared();
    let direct = probe_direct(&work);
    let quiet = !opts.progress;

    let mut reuse_pool: Option<Arc<RecyclingAllocator>> = None;
    let mut save_opts = SaveOptions {
        shard_bytes: opts.shard_bytes,
        ..SaveOptions::default()
    };
    if let Some(c) = opts.chunk_bytes {
        save_opts.chunk_bytes = c;
    }
    if let Some(q) = opts.in_flight {
        save_opts.in_flight = q;
    }
    if let Some(t) = opts.threads {
        save_opts.threads = t;
    }

    if opts.reuse_buffers {
        // The writer holds up to `in_flight + threads` chunk buffers; keep
        // that many touched and zeroed between saves.
        let kept = save_opts.in_flight + save_opts.threads;
        let mut pool = RecyclingAllocator::new(kept);
        let layout = Layout::from_size_align(save_opts.chunk_bytes, DIRECT_IO_ALIGN)?;
        if !pool.reserve(layout, kept) {
            fail!("out of memory reserving the writer's buffers");
        }
        let pool = Arc::new(pool);
        reuse_pool = Some(pool.clone());
        save_opts.allocator = pool;
    }
    let repeats = opts.repeat as usize;
    let pb = progress_bar(
        (repeats as u64 * 2 + 1) * limit_bytes + repeats as u64 * 2 * bytes,
        quiet,
    );
    pb.set_message("generating tensors");
    let shift = if opts.unaligned { UNALIGNED_SHIFT } else { 0 };
    // Each tensor at the next page boundary (plus `shift`).
    let mut starts = Vec::with_capacity(tensors.len());
    let mut arena_len = 0usize;
    for t in &tensors {
        let len = usize::try_from(t.data_offsets.1 - t.data_offsets.0)
            .step("--bytes too large for this machine")?;
        starts.push(arena_len + shift);
        arena_len = (arena_len + shift + len).next_multiple_of(DIRECT_IO_ALIGN);
    }
    let mut arena = AlignedBuf::zeroed(arena_len, DIRECT_IO_ALIGN)
        .with_step(|| format!("cannot allocate {} of tensors", format_size(bytes)))?;
    fill_random(&mut arena, &mut random_state(42));
    let data: Vec<&[u8]> = tensors
        .iter()
        .zip(&starts)
        .map(|(t, &s)| &arena[s..s + (t.data_offsets.1 - t.data_offsets.0) as usize])
        .collect();
    let refs: Vec<TensorRef<'_>> = tensors
        .iter()
        .zip(&data)
        .map(|(t, d)| TensorRef::new(&t.name, t.dtype, &t.shape, d))
        .collect();
    let groups = group_shards(&tensors, opts.shard_bytes);
    let patterns = random_write_patterns(limit_io as usize)?;

    let names: Vec<&str> = ["naive", "kvtier"]
        .into_iter()
        .filter(|n| opts.only.is_empty() || opts.only.iter().any(|o| o == n))
        .collect();
    let mut results = vec![Samples::default(); names.len()];
    let mut limits = Vec::new();
    let mut first_touch = Vec::new();
    let mut drops = CacheDrops::default();
    let limit_path = work.join("write-limit.dat");
    let mut direct_reason = None;
    let measure_limit = |drops: &mut CacheDrops| -> Result<f64> {
        pb.set_message("device write limit: settling");
        drops.drop_now();
        settle(opts.settle_secs);
        pb.set_message("device write limit");
        let g = measure_write(&limit_path, limit_bytes, direct.direct, &patterns, engine)?;
        pb.inc(limit_bytes);
        Ok(g)
    };
    for rep in 0..repeats {
        for (w, name) in names.iter().enumerate() {
            limits.push(measure_limit(&mut drops)?);
            let target = work.join(format!("{name}-{rep}"));
            std::fs::create_dir(&target)
                .with_step(|| format!("cannot create {}", target.display()))?;
            if let Some(pool) = &reuse_pool {
                pool.rezero();
            }
            pb.set_message(format!("{name} ({}/{repeats}): settling", rep + 1));
            drops.drop_now();
            settle(opts.settle_secs);
            pb.set_message(format!("{name} ({}/{repeats})", rep + 1));
            let t = Instant::now();
            let (files, file_bytes, was_direct, borrowed) = if *name == "naive" {
                let (f, b) = naive_save(&target, &tensors, &data, &groups)?;
                (f, b, false, 0)
            } else {
                let info = save(&target, &refs, &save_opts).step("kvtier checkpoint save")?;
                direct_reason = info.direct_reason.clone();
                (
                    info.files.len(),
                    info.bytes,
                    info.direct,
                    info.borrowed_bytes,
                )
            };
            let secs = t.elapsed().as_secs_f64();
            pb.inc(bytes);
            let s = &mut results[w];
            s.gbps.push(bytes as f64 / secs.max(1e-9) / 1e9);
            s.limit_pos.push(limits.len() - 1);
            s.files = files;
            s.file_bytes = file_bytes;
            s.direct = was_direct;
            s.borrowed_bytes = borrowed;
            std::fs::remove_dir_all(&target)
                .with_step(|| format!("cannot remove {}", target.display()))?;
        }
        pb.set_message("first touch");
        settle(opts.settle_secs);
        first_touch.push(first_touch_gbps(FIRST_TOUCH_BYTES).map_err(BenchError::Failed)?);
    }
    limits.push(measure_limit(&mut drops)?);
    pb.finish_and_clear();

    let limit_gbps = median(&limits);
    let naive_gbps = names
        .iter()
        .position(|&n| n == "naive")
        .map_or(0.0, |i| median(&results[i].gbps));
    let writers = names
        .iter()
        .zip(&results)
        .map(|(name, s)| {
            let gbps = median(&s.gbps);
            WriterReport {
                name: (*name).to_string(),
                gbps,
                durable: true,
                crash_consistent: *name == "kvtier",
                samples_gbps: s.gbps.clone(),
                fraction_of_limit: fraction(gbps, limit_gbps),
                paired_fraction: paired_fraction(&s.gbps, &s.limit_pos, &limits),
                ratio_vs_naive: fraction(gbps, naive_gbps),
                file_bytes: s.file_bytes,
                files: s.files,
                direct: s.direct,
                borrowed_bytes: s.borrowed_bytes,
            }
        })
        .collect();
    let report = CheckpointBenchReport {
        device_write_limit_gbps: limit_gbps,
        bytes,
        tensor_memory: if opts.unaligned {
            format!("{UNALIGNED_SHIFT} bytes past a page")
        } else {
            "page-aligned".to_string()
        },
        writers,
        device_write_limit_samples_gbps: limits,
        write_limit_file_bytes: limit_bytes,
        write_limit_io_bytes: limit_io,
        first_touch_gbps: median(&first_touch),
        tensors: tensors.len(),
        shard_bytes: opts.shard_bytes,
        repeat: opts.repeat,
        settle_secs: opts.settle_secs,
        page_cache: drops.describe(),
        kvtier_chunk_bytes: save_opts.chunk_bytes as u64,
        kvtier_in_flight: save_opts.in_flight,
        kvtier_threads: save_opts.threads,
        kvtier_direct_reason: direct_reason,
        dir: work.display().to_string(),
    };
    drop(refs);
    drop(data);
    drop(arena);
    drop(run_dirs);
    Ok(report)
}
