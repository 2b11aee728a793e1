//! Crash-safe checkpoint saving and verified loading.
//!
//! A checkpoint is a set of named tensors saved as sharded safetensors
//! files plus a `manifest.json` that commits them. The decisions:
//!
//! # Files
//!
//! * **Shards.** Tensors are packed in the order given into shard files of
//!   about [`SaveOptions::shard_bytes`] of data (default 2 GiB). A tensor is
//!   never split: one bigger than the target gets a shard of its own.
//! * **Names.** Generation `g` writes
//!   `ckpt-<g, 6 digits>-<i, 5 digits>-of-<n, 5 digits>.safetensors`
//!   ([`shard_file_name`]), always new files: a save never overwrites a
//!   committed file.
//! * **Alignment.** Each shard's header is padded with spaces so that the
//!   data section starts at a multiple of 4096 (4096 itself unless the header
//!   is larger), and every tensor starts at a 4096-aligned offset in the data
//!   section, hence in the file. The safetensors format forbids gaps between
//!   tensors, so the alignment is explicit: padding tensors named
//!   `__kvtier_pad_<n>` ([`PAD_PREFIX`]), dtype `U8`, shape `[k]`, zero-filled,
//!   sit between tensors where needed. Each shard is therefore a valid
//!   safetensors file that any reader (the reference `safetensors` crate
//!   included) loads; the padding tensors carry no data and **loaders skip
//!   names starting with `__kvtier_pad_`**. [`Checkpoint`] only shows the
//!   tensors listed in the manifest. Names with that prefix, and
//!   `__metadata__`, are rejected by `save`.
//! * **Manifest.** `manifest.json` ([`Manifest`]) holds the format version,
//!   the generation number, the shard files with their exact lengths, and per
//!   tensor: shard, name, dtype, shape, data offsets and crc32c. The caller's
//!   [`SaveOptions::metadata`] goes into the manifest and into every shard's
//!   `__metadata__`.
//!
//! # Writing
//!
//! Each shard file image (header, tensors, zero padding) is cut into aligned
//! chunks of [`SaveOptions::chunk_bytes`] (default 8 MiB) and written with
//! the [`IoEngine`], [`SaveOptions::in_flight`] writes
//! outstanding. Files are opened with `O_DIRECT` when the directory accepts
//! it ([`probe_direct`](crate::direct::probe_direct)); otherwise writes are buffered,
//! a warning is logged and [`CheckpointInfo::direct`] is false with the
//! reason in [`CheckpointInfo::direct_reason`]. Space is reserved up front
//! with `fallocate` ([`SaveOptions::preallocate`]), so a full disk is
//! usually found before any data is written. The last chunk of a file is
//! written padded to 4 KiB with zeros, and the file is then truncated
//! (`ftruncate`) to its exact length.
//!
//! A synchronous [`save`] streams chunk writes through the I/O engine,
//! [`SaveOptions::in_flight`] outstanding. A tensor of at least an eighth of
//! a chunk whose bytes start at a 4 KiB-aligned address (a page-aligned
//! allocation, pinned staging memory, a tensor loaded by kvtier's loader
//! from a kvtier checkpoint) is written straight from the caller's memory,
//! up to its last whole 4 KiB block, with no copy
//! ([`CheckpointInfo::borrowed_bytes`]). Everything else (headers, small or
//! unaligned tensors, tensor tails, padding) is gathered by
//! [`SaveOptions::threads`] threads into aligned chunk buffers, each
//! refilled as soon as its write completes. The same threads compute the
//! crc32c values, from what they just copied or while a borrowed write is
//! in flight. The buffers come from
//! [`SaveOptions::allocator`], by default [`default_write_allocator`], which
//! keeps them for the process's next save. [`save_async`] copies the file images into host buffers
//! from [`SaveOptions::allocator`] (the snapshot), returns a [`SaveHandle`],
//! and writes them from a background thread with no further copy.
//!
//! # Commit protocol
//!
//! Under an exclusive `flock` on `.kvtier-checkpoint.lock` in the directory
//! (so two saves never interleave; the kernel drops it if the process dies):
//!
//! 1. read `manifest.json` (the committed generation `g`, or none) and remove
//!    files of uncommitted generations left by earlier crashes ([`cleanup`]);
//! 2. write the shard files of generation `g + 1`, truncate and fsync each;
//!    fsync the directory;
//! 3. write the manifest to `manifest.json.tmp`, fsync it, rename it over
//!    `manifest.json`, fsync the directory: **this is the commit point**;
//! 4. only then delete generation `g`'s shard files.
//!
//! A crash (or SIGKILL) anywhere leaves `manifest.json` naming either the
//! complete old generation or the complete new one, never a mix; stray files
//! of an uncommitted generation are ignored by [`load`] and removed by the
//! next save. An error before the commit point (a full disk included:
//! [`CheckpointError::DiskFull`]) removes the new generation's files and
//! leaves the previous checkpoint committed and loadable. If the final
//! directory fsync fails, no file is deleted and the error is returned.
//!
//! # Loading
//!
//! [`load`] reads `manifest.json`, checks each shard's length, loads the
//! shards with the [loader](crate::loader), checks every tensor's dtype,
//! shape and offsets against the manifest, and verifies every tensor's
//! crc32c: a flipped byte is [`CheckpointError::Checksum`] naming the tensor.

mod background;
mod dirs;
mod error;
mod layout;
mod manifest;
mod reader;
mod writer;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::buffer::HostAllocator;
use crate::engine::IoEngine;
use crate::recycle::RecyclingAllocator;
use crate::safetensors::Dtype;

pub use background::{SaveHandle, save_async};
pub use dirs::{cleanup, fsync_dir, shard_file_name};
pub use error::CheckpointError;
pub use layout::TENSOR_ALIGN;
pub use manifest::{
    MANIFEST_FORMAT, MANIFEST_VERSION, Manifest, ShardEntry, TensorEntry, current_generation,
    read_manifest,
};
pub use reader::{Checkpoint, LoadOptions, load, load_with};
pub use writer::save;

/// Name prefix of the zero-filled `U8` padding tensors that align real
/// tensors inside shard files; loaders skip tensors with this prefix.
pub const PAD_PREFIX: &str = "__kvtier_pad_";
/// The commit record's file name.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The temp name a manifest is written under before the committing rename.
pub const MANIFEST_TMP: &str = "manifest.json.tmp";
/// The lock file serialising writers in a checkpoint directory.
pub const LOCK_FILE: &str = ".kvtier-checkpoint.lock";

/// One tensor to save: borrowed name, shape and bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    /// Unique name; must not start with [`PAD_PREFIX`] or be `__metadata__`.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: &'a [usize],
    /// Row-major little-endian element bytes: exactly shape x dtype size.
    pub data: &'a [u8],
}

impl<'a> TensorRef<'a> {
    /// A tensor to save.
    pub fn new(name: &'a str, dtype: Dtype, shape: &'a [usize], data: &'a [u8]) -> Self {
        Self {
            name,
            dtype,
            shape,
            data,
        }
    }
}

/// How to save.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// Target bytes of tensor data per shard file (default 2 GiB). A tensor
    /// is never split; one larger than this gets a shard of its own.
    pub shard_bytes: u64,
    /// Bytes per write: a non-zero multiple of 4096 (default 8 MiB).
    pub chunk_bytes: usize,
    /// Writes kept in flight (default 32). A synchronous save holds up to
    /// `(in_flight + threads) x chunk_bytes` of write buffers (about 256 MiB
    /// by default), reused from chunk to chunk.
    pub in_flight: usize,
    /// Threads gathering tensor bytes into chunk buffers, and later
    /// fsyncing the shard files (default: available cores, at most 4). A
    /// synchronous save holds up to `in_flight + threads` chunk buffers.
    pub threads: usize,
    /// Use `O_DIRECT` where the directory accepts it (default true); false
    /// forces buffered writes.
    pub direct: bool,
    /// Reserve each file's space with `fallocate` before writing (default
    /// true): a full disk fails fast and extents are allocated once. On
    /// ext4 this costs a few percent of bandwidth (the reserved extents are
    /// "unwritten" and each write converts them; measured 0.90-0.93 vs
    /// 0.95-0.98 of the write limit), a price kept for failing before any
    /// byte is written rather than mid-save.
    pub preallocate: bool,
    /// String metadata stored in the manifest and every shard's
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
    /// The engine that runs the writes.
    pub engine: IoEngine,
    /// Where write buffers and async snapshots come from (default
    /// [`default_write_allocator`]).
    pub allocator: Arc<dyn HostAllocator>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            shard_bytes: 2 << 30,
            chunk_bytes: 8 << 20,
            in_flight: DEFAULT_IN_FLIGHT,
            threads: default_threads(),
            direct: true,
            preallocate: true,
            metadata: BTreeMap::new(),
            engine: IoEngine::shared().clone(),
            allocator: default_write_allocator(),
        }
    }
}

/// What a committed save did.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointInfo {
    /// The generation committed.
    pub generation: u64,
    /// Bytes made durable: the shard files' total length (headers and
    /// padding included; the manifest excluded).
    pub bytes: u64,
    /// Bytes of tensor data.
    pub tensor_bytes: u64,
    /// The shard files written, in order.
    pub files: Vec<PathBuf>,
    /// Seconds from the call to the commit (snapshot included for an
    /// asynchronous save).
    pub seconds: f64,
    /// Seconds the asynchronous snapshot took (0 for a synchronous save).
    pub snapshot_seconds: f64,
    /// True when the files were written with `O_DIRECT`.
    pub direct: bool,
    /// Why the writes were buffered, when they were.
    pub direct_reason: Option<String>,
    /// Bytes written straight from the caller's tensors, with no copy (a
    /// synchronous save of 4 KiB-aligned tensors; 0 for an asynchronous
    /// save, whose snapshot is the copy).
    pub borrowed_bytes: u64,
}

impl CheckpointInfo {
    /// Durable write throughput in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

/// Writes a save keeps in flight by default ([`SaveOptions::in_flight`]).
const DEFAULT_IN_FLIGHT: usize = 32;

/// The allocator saves use by default: one per process, which keeps the
/// chunk buffers of a default save (`in_flight + threads` of 8 MiB, about
/// 256 MiB) for the next save instead of handing them back to the system.
///
/// Why: fresh RAM faults in slowly on VMs whose host reclaims freed memory
/// (0.38 GB/s on the reference VM). A save that faulted in its write
/// buffers every time measured 0.79 of the device write limit there, and
/// 1.0 with the buffers kept (docs/benchmarks.md). Trainers save
/// periodically, so from the second save on no new memory is needed; the
/// price is that memory staying with the process between saves.
pub fn default_write_allocator() -> Arc<dyn HostAllocator> {
    static POOL: OnceLock<Arc<RecyclingAllocator>> = OnceLock::new();
    POOL.get_or_init(|| {
        Arc::new(RecyclingAllocator::new(
            DEFAULT_IN_FLIGHT + default_threads(),
        ))
    })
    .clone()
}

pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().min(4))
}
