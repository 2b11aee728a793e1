//! Fast safetensors weight loading.
//!
//! Work is split by bytes, not by tensor: each shard file is read whole, in
//! `chunk_bytes` reads at aligned offsets, into one aligned allocation per
//! shard, with the chunks of all shards in one engine batch and `in_flight`
//! of them outstanding. Reads land in place (no bounce buffer, no copy), with
//! `O_DIRECT` where the file system takes it and buffered reads, with the
//! reason logged and reported, where it does not. Helper threads fault
//! the fresh destination in while the reads run, so that page faults overlap
//! the I/O instead of taking turns with it (`prefault`).
//!
//! Every header is read and validated before any shard buffer is allocated,
//! so a lying header cannot cause a huge allocation: the file length bounds
//! everything. After reading, the header bytes in the buffer are compared
//! with the ones validated; a file that changed under the loader is an error.
//!
//! Tensors are [`TensorView`]s borrowing their shard's buffer: the buffer
//! cannot be freed or reused while any view of it is alive.
//!
//! For a destination that is not host memory (a GPU), [`staged`] reads the
//! same chunks into a bounded ring of staging buffers and copies each one to
//! the device while the next reads run.

mod index;
mod load_error;
mod prefault;
mod shard;
mod shard_read;
pub mod staged;
mod window;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator, system_allocator};
use crate::io_engine::IoEngine;

pub use index::{INDEX_FILE, SINGLE_FILE, model_shards};
pub use load_error::LoadError;
pub use shard::{LoadedShard, TensorView};

/// How the loader reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Bytes per read: a non-zero multiple of 4096 (default 8 MiB).
    pub chunk_bytes: usize,
    /// Reads kept in flight (default 32).
    pub in_flight: usize,
    /// `Some(true)`: `O_DIRECT` required; `Some(false)`: buffered; `None`:
    /// probe each file with one direct read and fall back, with a logged
    /// reason, where it fails.
    pub direct: Option<bool>,
    /// Fault the destination memory in on helper threads while the reads
    /// run (default true). A cold load into fresh memory otherwise faults
    /// each read's pages in when it is submitted, in turn with the reads.
    pub prefault: bool,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        Self {
            chunk_bytes: 8 << 20,
            in_flight: 32,
            direct: None,
            prefault: true,
        }
    }
}

impl LoaderConfig {
    fn check(&self) -> Result<(), LoadError> {
        if self.chunk_bytes == 0 || !self.chunk_bytes.is_multiple_of(DIRECT_IO_ALIGN) {
            return Err(LoadError::BadConfig(format!(
                "chunk_bytes {} is not a non-zero multiple of {DIRECT_IO_ALIGN}",
                self.chunk_bytes
            )));
        }
        if self.in_flight == 0 {
            return Err(LoadError::BadConfig("in_flight must be at least 1".into()));
        }
        Ok(())
    }
}

/// What a load did.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadStats {
    /// Bytes read (the shard files' total length).
    pub bytes: u64,
    /// Wall time from the first header read to the last byte verified.
    pub seconds: f64,
    /// True when every shard was read with `O_DIRECT`.
    pub direct: bool,
    /// The engine backend ("io_uring" or "threads").
    pub io_backend: &'static str,
    /// Why some shard was read buffered, when one was.
    pub buffered_reason: Option<String>,
    /// Number of shards.
    pub shards: usize,
}

impl LoadStats {
    /// The stats of a load of `opened` begun at `start` on `engine`.
    pub(crate) fn of(opened: &[shard_read::OpenShard], start: Instant, engine: &IoEngine) -> Self {
        Self {
            bytes: opened.iter().map(|s| s.len).sum(),
            seconds: start.elapsed().as_secs_f64(),
            direct: !opened.is_empty() && opened.iter().all(|s| s.direct),
            io_backend: engine.backend().name(),
            buffered_reason: opened.iter().find_map(|s| s.buffered_reason.clone()),
            shards: opened.len(),
        }
    }

    /// Throughput in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

/// Loads every shard in `paths`: all headers are validated first, then one
/// buffer per shard is allocated from `alloc` and all shards are read in
/// one batch on `engine`.
pub fn load_shards(
    paths: &[PathBuf],
    cfg: &LoaderConfig,
    engine: &IoEngine,
    alloc: &Arc<dyn HostAllocator>,
) -> Result<(Vec<LoadedShard>, LoadStats), LoadError> {
    cfg.check()?;
    let start = Instant::now();
    let opened = paths
        .iter()
        .map(|p| shard_read::open_shard(p, cfg))
        .collect::<Result<Vec<_>, _>>()?;
    let mut bufs = Vec::with_capacity(opened.len());
    for shard in &opened {
        let len = shard_read::shard_len(shard)?;
        bufs.push(AlignedBuf::zeroed_in(alloc, len, DIRECT_IO_ALIGN)?);
    }
    shard_read::read_shards(&opened, &mut bufs, cfg, engine)?;
    for (shard, buf) in opened.iter().zip(&bufs) {
        shard_read::verify(shard, buf)?;
    }
    let stats = LoadStats::of(&opened, start, engine);
    let shards = opened
        .into_iter()
        .zip(bufs)
        .map(|(s, buf)| LoadedShard::new(s.path, s.header, buf, s.direct))
        .collect();
    Ok((shards, stats))
}

/// Loads the model in `dir` (see [`model_shards`]) with the shared engine
/// and the system allocator; with an index, also checks that every tensor
/// it lists is in the shard it names.
pub fn load_model_dir(
    dir: &Path,
    cfg: &LoaderConfig,
) -> Result<(Vec<LoadedShard>, LoadStats), LoadError> {
    let paths = model_shards(dir)?;
    let (shards, stats) = load_shards(&paths, cfg, IoEngine::shared(), &system_allocator())?;
    index::check_index(dir, shards.iter().map(|s| (s.path(), s.header())))?;
    Ok((shards, stats))
}
