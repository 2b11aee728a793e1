//! What a save is given and what it reports: the tensors ([`TensorRef`]),
//! the options ([`SaveOptions`]), the result ([`CheckpointInfo`]), the file
//! names every part of the writer and reader agree on, and the default
//! allocator of write buffers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::buffer::HostAllocator;
use crate::io_engine::IoEngine;
use crate::recycle::RecyclingAllocator;
use crate::safetensors::Dtype;

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
    /// ext4 this costs some bandwidth (the reserved extents are
    /// "unwritten" and each write converts them), a price kept for failing
    /// before any byte is written rather than mid-save (docs/decisions.md).
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
/// Why: fresh RAM faults in slowly on VMs whose host reclaims freed memory,
/// so a save that faulted in its write buffers every time fell short of
/// the device write limit where one with the buffers kept reached it
/// (docs/decisions.md). Trainers save
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
