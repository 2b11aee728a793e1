//! `kvtier checkpoint bench`: saves the same in-memory tensors durably with
//! a naive writer and with [`kvtier_io::checkpoint::save`], interleaved (A B
//! A B ...), with the device's raw sequential write limit (O_DIRECT, 4 MiB
//! x 32 in flight, then `fdatasync`) measured before every save, in the
//! same run.
//!
//! * `naive`: per shard, `safetensors::serialize_to_file` (buffered, 1 MiB
//!   `BufWriter`, temp file + rename), then `fsync` of the file; at the end
//!   `fsync` of the directory. Durable, not crash-consistent across shards.
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

use std::alloc::Layout;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kvtier_io::checkpoint::{SaveOptions, TensorRef, save};
use kvtier_io::safetensors::{Dtype, TensorInfo};
use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, IoEngine, probe_direct};
use serde::Serialize;

use crate::bench_dirs::RunDirs;
use crate::bench_store::progress_bar;
use crate::cli_model::CheckpointBenchArgs;
use crate::cmd_model_synth::plan_model;
use crate::device_limit::{measure_write, random_write_patterns};
use crate::host::{CacheDrops, first_touch_gbps, settle};
use crate::report::{fraction, median, paired_fraction};
use crate::size::format_size;
use kvtier_io::recycle::RecyclingAllocator;

/// Largest device write-limit file.
pub const MAX_WRITE_LIMIT_BYTES: u64 = 4 << 30;
/// Bytes of each first-touch sample (the kvtier writer's default buffers).
const FIRST_TOUCH_BYTES: usize = 256 << 20;

/// One writer's result.
#[derive(Debug, Clone, Serialize)]
pub struct WriterReport {
    /// `naive` or `kvtier` (a contract).
    pub name: String,
    /// Tensor bytes per second made durable, GB/s, median (a contract).
    pub gbps: f64,
    /// True when the save returned only once every byte was durable (a
    /// contract).
    pub durable: bool,
    /// True when a crash at any moment leaves the old or the new checkpoint
    /// complete, never a mix.
    pub crash_consistent: bool,
    /// GB/s of every repeat, in run order.
    pub samples_gbps: Vec<f64>,
    /// `gbps / device_write_limit_gbps`.
    pub fraction_of_limit: f64,
    /// Median over the repeats of each sample over the mean of the write
    /// limit samples just before and after it.
    pub paired_fraction: f64,
    /// `gbps` over `naive`'s.
    pub ratio_vs_naive: f64,
    /// Bytes of the files written (headers and alignment padding included).
    pub file_bytes: u64,
    /// Files written per save.
    pub files: usize,
    /// True when the data was written with O_DIRECT.
    pub direct: bool,
    /// Bytes the writer wrote straight from the tensors' memory, with no
    /// copy (last save; always 0 for `naive`).
    pub borrowed_bytes: u64,
}

/// The whole result; `device_write_limit_gbps`, `bytes` and `writers` are a
/// contract.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointBenchReport {
    /// Median of every device write-limit sample.
    pub device_write_limit_gbps: f64,
    /// Bytes of tensor data per save.
    pub bytes: u64,
    /// Where the tensors start: `page-aligned`, or `64 bytes past a page`
    /// (`--unaligned`).
    pub tensor_memory: String,
    /// `naive` and `kvtier`.
    pub writers: Vec<WriterReport>,
    /// Every write-limit sample, in run order.
    pub device_write_limit_samples_gbps: Vec<f64>,
    /// Bytes of each write-limit sample.
    pub write_limit_file_bytes: u64,
    /// Bytes per write of the write-limit samples.
    pub write_limit_io_bytes: u64,
    /// First-touch RAM rate (fresh memory faulted in by one thread), median.
    pub first_touch_gbps: f64,
    /// Tensors per save.
    pub tensors: usize,
    /// Target tensor bytes per shard.
    pub shard_bytes: u64,
    /// Repeats of each writer.
    pub repeat: u32,
    /// Seconds waited after each page-cache drop.
    pub settle_secs: f64,
    /// How the page cache was dropped.
    pub page_cache: String,
    /// The kvtier writer's settings.
    pub kvtier_chunk_bytes: u64,
    /// Writes the kvtier writer keeps in flight.
    pub kvtier_in_flight: usize,
    /// Threads gathering chunks for the kvtier writer (and fsyncing files).
    pub kvtier_threads: usize,
    /// Why the kvtier writer did not use O_DIRECT, when it did not.
    pub kvtier_direct_reason: Option<String>,
    /// The bench directory.
    pub dir: String,
}

fn st_dtype(d: Dtype) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match d {
        Dtype::Bool => S::BOOL,
        Dtype::U8 => S::U8,
        Dtype::I8 => S::I8,
        Dtype::F8E5M2 => S::F8_E5M2,
        Dtype::F8E4M3 => S::F8_E4M3,
        Dtype::I16 => S::I16,
        Dtype::U16 => S::U16,
        Dtype::F16 => S::F16,
        Dtype::Bf16 => S::BF16,
        Dtype::I32 => S::I32,
        Dtype::U32 => S::U32,
        Dtype::F32 => S::F32,
        Dtype::F64 => S::F64,
        Dtype::I64 => S::I64,
        Dtype::U64 => S::U64,
    }
}

/// Splits tensors (in order) into shards of at most `shard_bytes` of data,
/// never splitting one (the kvtier writer's rule).
fn group_shards(tensors: &[TensorInfo], shard_bytes: u64) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur = Vec::new();
    let mut cur_bytes = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let b = t.data_offsets.1 - t.data_offsets.0;
        if !cur.is_empty() && cur_bytes + b > shard_bytes {
            out.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
        cur.push(i);
        cur_bytes += b;
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("fsync of directory {}", dir.display()))
}

/// One naive save into `dir` (which exists) of `tensors` with bytes `data`
/// (indexed alike): returns (files, file bytes).
fn naive_save(
    dir: &Path,
    tensors: &[TensorInfo],
    data: &[&[u8]],
    groups: &[Vec<usize>],
) -> Result<(usize, u64)> {
    let mut file_bytes = 0;
    for (s, group) in groups.iter().enumerate() {
        let path = dir.join(format!(
            "model-{:05}-of-{:05}.safetensors",
            s + 1,
            groups.len()
        ));
        let views = group
            .iter()
            .map(|&i| {
                let t = &tensors[i];
                safetensors::tensor::TensorView::new(st_dtype(t.dtype), t.shape.clone(), data[i])
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| anyhow::anyhow!("tensor {}: {e}", t.name))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(views, Some(meta), &path)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        let f = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        f.sync_all()
            .with_context(|| format!("fsync of {}", path.display()))?;
        file_bytes += f.metadata()?.len();
    }
    fsync_dir(dir)?;
    Ok((groups.len(), file_bytes))
}

/// Fills `buf` with pseudo-random bytes (every byte written).
fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for w in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        w.copy_from_slice(&v[..w.len()]);
    }
}

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

/// Runs the bench and prints its report (a table, or one JSON object).
pub fn run(args: &CheckpointBenchArgs) -> Result<()> {
    let plan = plan_model(args.bytes, 1)?;
    let tensors: Vec<TensorInfo> = plan.into_iter().flat_map(|s| s.tensors).collect();
    let bytes: u64 = tensors.last().map_or(0, |t| t.data_offsets.1);
    if args.shard_bytes == 0 {
        bail!("--shard-bytes must be more than 0");
    }
    let limit_io = args.limit_io_bytes;
    let limit_bytes = bytes.min(MAX_WRITE_LIMIT_BYTES).div_ceil(limit_io).max(1) * limit_io;
    let run_dirs = RunDirs::create(
        std::slice::from_ref(&args.dir),
        bytes,
        limit_bytes,
        args.keep,
    )?;
    let work = run_dirs.first().to_path_buf();
    let engine = IoEngine::shared();
    let direct = probe_direct(&work);
    let quiet = args.json;

    let mut reuse_pool: Option<Arc<RecyclingAllocator>> = None;
    let mut opts = SaveOptions {
        shard_bytes: args.shard_bytes,
        ..SaveOptions::default()
    };
    if let Some(c) = args.chunk_bytes {
        opts.chunk_bytes = c as usize;
    }
    if let Some(q) = args.in_flight {
        opts.in_flight = q as usize;
    }
    if let Some(t) = args.threads {
        opts.threads = t as usize;
    }

    if args.reuse_buffers {
        // The writer holds up to `in_flight + threads` chunk buffers; keep
        // that many touched and zeroed between saves.
        let kept = opts.in_flight + opts.threads;
        let mut pool = RecyclingAllocator::new(kept);
        let layout = Layout::from_size_align(opts.chunk_bytes, DIRECT_IO_ALIGN)?;
        if !pool.reserve(layout, kept) {
            bail!("out of memory reserving the writer's buffers");
        }
        let pool = Arc::new(pool);
        reuse_pool = Some(pool.clone());
        opts.allocator = pool;
    }
    let repeats = args.repeat as usize;
    let pb = progress_bar(
        (repeats as u64 * 2 + 1) * limit_bytes + repeats as u64 * 2 * bytes,
        quiet,
    );
    pb.set_message("generating tensors");
    let shift = if args.unaligned { UNALIGNED_SHIFT } else { 0 };
    // Each tensor at the next page boundary (plus `shift`).
    let mut starts = Vec::with_capacity(tensors.len());
    let mut arena_len = 0usize;
    for t in &tensors {
        let len = usize::try_from(t.data_offsets.1 - t.data_offsets.0)
            .context("--bytes too large for this machine")?;
        starts.push(arena_len + shift);
        arena_len = (arena_len + shift + len).next_multiple_of(DIRECT_IO_ALIGN);
    }
    let mut arena = AlignedBuf::zeroed(arena_len, DIRECT_IO_ALIGN)
        .with_context(|| format!("cannot allocate {} of tensors", format_size(bytes)))?;
    fill_random(&mut arena, 42);
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
    let groups = group_shards(&tensors, args.shard_bytes);
    let patterns = random_write_patterns(limit_io as usize)?;

    let names: Vec<&str> = ["naive", "kvtier"]
        .into_iter()
        .filter(|n| args.only.is_empty() || args.only.iter().any(|o| o == n))
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
        settle(args.settle_secs);
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
                .with_context(|| format!("cannot create {}", target.display()))?;
            if let Some(pool) = &reuse_pool {
                pool.rezero();
            }
            pb.set_message(format!("{name} ({}/{repeats}): settling", rep + 1));
            drops.drop_now();
            settle(args.settle_secs);
            pb.set_message(format!("{name} ({}/{repeats})", rep + 1));
            let t = Instant::now();
            let (files, file_bytes, was_direct, borrowed) = if *name == "naive" {
                let (f, b) = naive_save(&target, &tensors, &data, &groups)?;
                (f, b, false, 0)
            } else {
                let info = save(&target, &refs, &opts).context("kvtier checkpoint save")?;
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
                .with_context(|| format!("cannot remove {}", target.display()))?;
        }
        pb.set_message("first touch");
        settle(args.settle_secs);
        first_touch.push(first_touch_gbps(FIRST_TOUCH_BYTES).map_err(anyhow::Error::msg)?);
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
        tensor_memory: if args.unaligned {
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
        shard_bytes: args.shard_bytes,
        repeat: args.repeat,
        settle_secs: args.settle_secs,
        page_cache: drops.describe(),
        kvtier_chunk_bytes: opts.chunk_bytes as u64,
        kvtier_in_flight: opts.in_flight,
        kvtier_threads: opts.threads,
        kvtier_direct_reason: direct_reason,
        dir: work.display().to_string(),
    };
    drop(refs);
    drop(data);
    drop(arena);
    drop(run_dirs);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render_table(&report));
    }
    Ok(())
}

fn samples(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The human-readable report.
pub fn render_table(r: &CheckpointBenchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvtier checkpoint bench: {} of tensors ({} tensors, shards of up to {}), {} repeat(s), median reported",
        format_size(r.bytes),
        r.tensors,
        format_size(r.shard_bytes),
        r.repeat
    );
    let _ = writeln!(out, "dir:                {}", r.dir);
    let _ = writeln!(out, "tensor memory:      each tensor {}", r.tensor_memory);
    let _ = writeln!(
        out,
        "page cache:         {}; then {} s settle before each save",
        r.page_cache, r.settle_secs
    );
    let _ = writeln!(
        out,
        "kvtier writer:      {} writes x {} in flight, {} gather thread(s){}",
        format_size(r.kvtier_chunk_bytes),
        r.kvtier_in_flight,
        r.kvtier_threads,
        r.kvtier_direct_reason
            .as_ref()
            .map_or_else(String::new, |w| format!(", buffered: {w}"))
    );
    let _ = writeln!(
        out,
        "device write limit: {:.2} GB/s (raw O_DIRECT sequential write of a new {} file, {} x 32 in flight, then fdatasync; median of {}: {})",
        r.device_write_limit_gbps,
        format_size(r.write_limit_file_bytes),
        format_size(r.write_limit_io_bytes),
        r.device_write_limit_samples_gbps.len(),
        samples(&r.device_write_limit_samples_gbps)
    );
    let _ = writeln!(
        out,
        "first touch:        {:.2} GB/s (fresh RAM faulted in by one thread)",
        r.first_touch_gbps
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<7}  {:>6}  {:>8}  {:>6}  {:>8}  {:>7}  {:>10}  {:>6}  samples GB/s",
        "writer", "GB/s", "of limit", "paired", "vs naive", "durable", "crash-safe", "direct"
    );
    for w in &r.writers {
        let _ = writeln!(
            out,
            "{:<7}  {:>6.2}  {:>8.2}  {:>6.2}  {:>8.2}  {:>7}  {:>10}  {:>6}  {}",
            w.name,
            w.gbps,
            w.fraction_of_limit,
            w.paired_fraction,
            w.ratio_vs_naive,
            if w.durable { "yes" } else { "no" },
            if w.crash_consistent { "yes" } else { "no" },
            if w.direct { "yes" } else { "no" },
            samples(&w.samples_gbps)
        );
    }
    for w in r.writers.iter().filter(|w| w.name == "kvtier") {
        let _ = writeln!(
            out,
            "kvtier wrote {} of the {} of tensors straight from their memory (no copy)",
            format_size(w.borrowed_bytes),
            format_size(r.bytes)
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "GB/s: tensor bytes over the time from the call until every file and the directory are"
    );
    let _ = writeln!(
        out,
        "fsynced (kvtier: manifest committed). of limit: over the median write limit; paired: over"
    );
    let _ = writeln!(
        out,
        "the write-limit samples just before and after each save."
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, a: u64, b: u64) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![(b - a) as usize],
            data_offsets: (a, b),
        }
    }

    #[test]
    fn groups_like_the_writer() {
        let ts = [
            t("a", 0, 10),
            t("b", 10, 20),
            t("c", 20, 45),
            t("d", 45, 50),
        ];
        assert_eq!(group_shards(&ts, 20), vec![vec![0, 1], vec![2], vec![3]]);
        assert_eq!(group_shards(&ts, 1000), vec![vec![0, 1, 2, 3]]);
        assert!(group_shards(&[], 10).is_empty());
    }

    #[test]
    fn naive_save_writes_readable_shards() {
        let dir = tempfile::tempdir().unwrap();
        let plan = plan_model(1 << 20, 1).unwrap();
        let tensors = &plan[0].tensors;
        let mut data = vec![0u8; plan[0].data_bytes() as usize];
        fill_random(&mut data, 1);
        let slices: Vec<&[u8]> = tensors
            .iter()
            .map(|t| &data[t.data_offsets.0 as usize..t.data_offsets.1 as usize])
            .collect();
        let groups = group_shards(tensors, 256 << 10);
        let (files, bytes) = naive_save(dir.path(), tensors, &slices, &groups).unwrap();
        assert_eq!(files, groups.len());
        assert!(bytes > data.len() as u64);
        let f = std::fs::read(
            dir.path()
                .join(format!("model-00001-of-{:05}.safetensors", files)),
        )
        .unwrap();
        assert!(safetensors::SafeTensors::deserialize(&f).is_ok());
    }

    #[test]
    fn dtypes_map_by_name() {
        for d in Dtype::ALL {
            let s = format!("{:?}", st_dtype(d)).replace('_', "");
            assert_eq!(s, d.as_str().replace('_', ""), "{d}");
        }
    }
}
