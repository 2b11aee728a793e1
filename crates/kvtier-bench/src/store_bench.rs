//! The store bench: write a KV block set into the disk tier (G3), read it
//! back cold at several in-flight depths, and compare with the device's own
//! limit measured between the cases (A B A B), in the same run
//! ([`run_g3`]). [`g4`] measures G4 restore against `redis-benchmark`.
//!
//! * [`block_set`]: the blocks, writing them, reading them back.
//! * [`slot_layout`]: the KV layout whose slot is exactly a block size.
//! * [`store_report`]: the G3 report; [`g4_report`]: the G4 one.
//! * [`redis_benchmark`]: running `redis-benchmark` beside G4.

pub mod block_set;
pub mod g4;
pub mod g4_report;
pub mod redis_benchmark;
pub mod slot_layout;
pub mod store_report;

use std::path::PathBuf;

use indicatif::ProgressBar;
use kvtier_io::{IoEngine, system_allocator};
use kvtier_store::{DiskConfig, DiskTier, StoreMetrics};

use crate::bench_error::{BenchError, Result, StepContext, fail};
use crate::common::progress::progress_bar;
use crate::common::size::format_size;
use crate::machine::device_limit::{DeviceLimit, limit_file_bytes};
use crate::machine::host::CacheDrops;
use crate::machine::run_dirs::RunDirs;
use crate::reporting::stats::{fraction, median, paired_fraction};
use block_set::{BlockReader, write_set};
use slot_layout::layout_for_block_bytes;
use store_report::{CaseReport, StoreBenchReport};

/// Most bytes of read buffers a case may use (the pool is shared by all).
pub const READ_POOL_BYTES: u64 = 512 << 20;
/// Segment file size of the bench's disk tier.
const SEGMENT_BYTES: u64 = 1 << 30;
/// Default total bytes of the G3 bench.
pub const G3_DEFAULT_TOTAL_BYTES: u64 = 4 << 30;
/// Default total bytes of the G4 bench (it must fit in the pool's memory).
pub const G4_DEFAULT_TOTAL_BYTES: u64 = 1 << 30;

/// What the G3 bench measures (`kvtier store bench`).
#[derive(Debug, Clone)]
pub struct G3BenchOptions {
    /// Directories to stripe the block set over (ideally one per device);
    /// a `kvtier-bench-<pid>` directory is made in each.
    pub dirs: Vec<PathBuf>,
    /// Bytes of blocks to write and read back.
    pub total_bytes: u64,
    /// Size of one block, i.e. one disk slot: a multiple of 4 KiB from 8 KiB
    /// to 1 GiB ([`slot_layout::check_block_bytes`]).
    pub block_bytes: u64,
    /// Reads in flight for each case (1 to 256 each).
    pub in_flight: Vec<u32>,
    /// Times to run every case; the median is reported.
    pub repeat: u32,
    /// Blocks per store read call (default: [`chunk_blocks`)'s rule].
    pub chunk_blocks: Option<u32>,
    /// Keep the bench files instead of deleting them at the end.
    pub keep: bool,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl Default for G3BenchOptions {
    fn default() -> Self {
        Self {
            dirs: vec![PathBuf::from("./kvtier-cache/bench")],
            total_bytes: G3_DEFAULT_TOTAL_BYTES,
            block_bytes: 2 << 20,
            in_flight: vec![1, 4, 16, 32],
            repeat: 3,
            chunk_blocks: None,
            keep: false,
            progress: true,
        }
    }
}

/// Blocks per store read call for `in_flight` reads of `block_bytes`:
/// max(4 x in-flight, 64), capped at [`READ_POOL_BYTES`] of buffers but never
/// below `in_flight`, and never more than the set. `requested` overrides the
/// rule (still capped by the set).
pub fn chunk_blocks(in_flight: u32, block_bytes: u64, blocks: u64, requested: Option<u32>) -> u64 {
    let chunk = match requested {
        Some(c) => u64::from(c),
        None => {
            let want = (u64::from(in_flight) * 4).max(64);
            let cap = (READ_POOL_BYTES / block_bytes).max(u64::from(in_flight));
            want.min(cap)
        }
    };
    chunk.min(blocks).max(1)
}

/// Runs the G3 bench (see the module docs) and returns its report.
pub fn run_g3(opts: &G3BenchOptions) -> Result<StoreBenchReport> {
    let block_bytes = opts.block_bytes;
    let total_bytes = opts.total_bytes;
    let layout = layout_for_block_bytes(block_bytes).map_err(BenchError::Failed)?;
    let roots = opts.dirs.clone();
    if roots.is_empty() {
        fail!("no bench directory given");
    }
    let ndirs = roots.len() as u64;
    let per_dir = total_bytes / block_bytes / ndirs;
    if per_dir == 0 {
        fail!(
            "--total-bytes {} holds no {} block in each of {ndirs} director{}",
            format_size(total_bytes),
            format_size(block_bytes),
            if ndirs == 1 { "y" } else { "ies" }
        );
    }
    let blocks = per_dir * ndirs;
    let total = blocks * block_bytes;
    let limit_bytes = limit_file_bytes(total);
    let in_flights: Vec<u32> = opts.in_flight.clone();
    if in_flights.is_empty() {
        fail!("--in-flight needs at least one depth");
    }

    let run_dirs = RunDirs::create(&roots, per_dir * block_bytes, limit_bytes, opts.keep)?;
    let engine = IoEngine::shared().clone();
    let metrics = StoreMetrics::new();
    let mut config = DiskConfig::new(run_dirs.dirs().to_vec(), total, layout);
    config.segment_bytes = SEGMENT_BYTES;
    config.direct = None;
    let disk = DiskTier::open(
        config,
        engine.clone(),
        system_allocator(),
        metrics.g3.clone(),
    )
    .step("opening the bench disk tier")?;
    if disk.capacity_slots() as u64 != blocks {
        fail!(
            "the disk tier has {} slots, expected {blocks}",
            disk.capacity_slots()
        );
    }
    tracing::info!(
        "bench: {blocks} blocks of {} ({layout}) in {}; {}",
        format_size(block_bytes),
        run_dirs
            .dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        disk.describe_io()
    );

    let cases = in_flights.len() as u64;
    let repeats = u64::from(opts.repeat);
    let work = total + limit_bytes + repeats * cases * (total + limit_bytes) + limit_bytes;
    let pb = progress_bar(work, !opts.progress);

    pb.set_message("writing block set");
    let write_gbps = write_set(&disk, layout, blocks, &pb)?;

    pb.set_message("writing device-limit file");
    let (mut limit, limit_write_gbps) = DeviceLimit::create(
        &run_dirs.first().join("device-limit.dat"),
        limit_bytes,
        disk.direct(),
        &engine,
    )?;
    pb.inc(limit.bytes());

    let chunks: Vec<u64> = in_flights
        .iter()
        .map(|&q| chunk_blocks(q, block_bytes, blocks, opts.chunk_blocks))
        .collect();
    let pool = chunks.iter().copied().max().unwrap_or(1);
    pb.set_message("touching read buffers");
    let mut reader = BlockReader::new(block_bytes, pool as usize)?;

    let mut drops = CacheDrops::default();
    let mut limit_samples = Vec::new();
    let mut case_samples: Vec<Vec<f64>> = vec![Vec::new(); in_flights.len()];
    let mut case_io: Vec<Vec<f64>> = vec![Vec::new(); in_flights.len()];
    // Index of the limit sample taken just before each case sample.
    let mut case_pos: Vec<Vec<usize>> = vec![Vec::new(); in_flights.len()];
    let mut measure_limit = |pb: &ProgressBar, drops: &mut CacheDrops| -> Result<f64> {
        pb.set_message("device limit");
        drops.drop_now();
        let g = limit.measure(&engine)?;
        pb.inc(limit_bytes);
        tracing::debug!("device limit sample: {g:.3} GB/s");
        Ok(g)
    };
    for rep in 0..opts.repeat {
        for (c, &q) in in_flights.iter().enumerate() {
            limit_samples.push(measure_limit(&pb, &mut drops)?);
            case_pos[c].push(limit_samples.len() - 1);
            pb.set_message(format!("read, {q} in flight ({}/{})", rep + 1, opts.repeat));
            drops.drop_now();
            let pass =
                reader.read_all(&disk, &metrics, blocks, q as usize, chunks[c] as usize, &pb)?;
            tracing::debug!("{q} in flight: {:.3} GB/s", pass.gbps);
            case_samples[c].push(pass.gbps);
            case_io[c].push(pass.io_time_fraction);
        }
    }
    limit_samples.push(measure_limit(&pb, &mut drops)?);
    pb.finish_and_clear();

    let device_limit_gbps = median(&limit_samples);
    let cases = in_flights
        .iter()
        .enumerate()
        .map(|(c, &q)| {
            let gbps = median(&case_samples[c]);
            CaseReport {
                in_flight: q,
                block_bytes,
                gbps,
                fraction_of_limit: fraction(gbps, device_limit_gbps),
                samples_gbps: case_samples[c].clone(),
                paired_fraction: paired_fraction(&case_samples[c], &case_pos[c], &limit_samples),
                chunk_blocks: chunks[c] as u32,
                io_time_fraction: median(&case_io[c]),
            }
        })
        .collect();
    let report = StoreBenchReport {
        device_limit_gbps,
        cases,
        io_mode: disk.describe_io(),
        io_backend: engine.backend().name().to_string(),
        direct_io: disk.direct(),
        total_bytes: total,
        write_gbps,
        device_limit_samples_gbps: limit_samples,
        page_cache_dropped: drops.failed.is_none(),
        page_cache_note: drops.failed.clone(),
        block_bytes,
        blocks,
        layout: layout.to_string(),
        repeat: opts.repeat,
        dirs: run_dirs
            .dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect(),
        limit_file_bytes: limit_bytes,
        limit_write_gbps,
        first_touch_gbps: reader.first_touch_gbps(),
    };
    drop(disk);
    drop(run_dirs);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_rule() {
        let mib = 1 << 20;
        assert_eq!(chunk_blocks(1, 2 * mib, 2048, None), 64);
        assert_eq!(chunk_blocks(16, 2 * mib, 2048, None), 64);
        assert_eq!(chunk_blocks(32, 2 * mib, 2048, None), 128);
        assert_eq!(chunk_blocks(32, 16 * mib, 128, None), 32);
        assert_eq!(chunk_blocks(4, 256 << 10, 8192, None), 64);
        assert_eq!(chunk_blocks(4, 256 << 10, 10, None), 10);
        assert_eq!(chunk_blocks(4, 2 * mib, 2048, Some(512)), 512);
        assert_eq!(chunk_blocks(4, 2 * mib, 100, Some(512)), 100);
    }
}
