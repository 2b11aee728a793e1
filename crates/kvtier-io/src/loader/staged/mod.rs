//! Loading shards into device memory through a bounded ring of staging
//! buffers, with copies to the device overlapped with the reads.
//!
//! When the destination is not host memory (a GPU), reads cannot land in
//! place. Each chunk read lands in one of `ring` host staging buffers
//! (page-locked memory on CUDA, so the copy engine can DMA from it), and the
//! moment the read completes an asynchronous copy into the shard's device
//! memory is queued, while the other buffers keep reading: the disk and the
//! copy engine work at the same time. The device memory is one allocation
//! per shard, as on the host path.
//!
//! **Buffer lifetimes are explicit.** A staging buffer goes back to the free
//! list only once the fence of the copy reading it has completed; when no
//! buffer is free, the ring waits on the oldest copy (copies complete in
//! order on one stream). At the end, and on every error path, every queued
//! copy is waited for before a buffer is freed. A buffer whose fence fails
//! (the device is in an unknown state) is leaked, never reused or freed
//! under a copy that may still read it.
//!
//! The ring is generic over a [`DeviceSink`]: `CudaSink` (feature `cuda`)
//! copies into GPU memory; [`ThreadCopySink`] copies into host memory on a
//! copy thread, which is how the ring's ordering and lifetimes are tested on
//! machines without a GPU.

mod sink;
mod thread_sink;

#[cfg(feature = "cuda")]
mod cuda;

use std::collections::VecDeque;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator};
use crate::io_engine::IoEngine;
use crate::io_op::{IoDone, IoOp};
use crate::safetensors::{Header, TensorInfo};

use super::index::{check_index, model_shards};
use super::load_error::LoadError;
use super::shard_read::{self, OpenShard};
use super::{LoadStats, LoaderConfig};

#[cfg(feature = "cuda")]
pub use cuda::{CudaPinnedAllocator, CudaSink};
pub use sink::{CopyFence, DeviceSink};
pub use thread_sink::{ThreadCopySink, ThreadFence};

/// Staging buffers in the ring when a caller names no count: the loader's
/// default reads in flight (32) plus 8 buffers whose copies are queued.
/// With 8 MiB chunks that is 320 MiB of page-locked memory.
pub const DEFAULT_RING: usize = 40;

/// One shard read whole into device memory.
#[derive(Debug)]
pub struct DeviceShard<M> {
    path: PathBuf,
    header: Header,
    memory: M,
    direct: bool,
}

impl<M> DeviceShard<M> {
    /// The file this shard was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The device memory holding the whole file (prefix, header, data).
    pub fn memory(&self) -> &M {
        &self.memory
    }

    /// Gives the device memory to the caller.
    pub fn into_memory(self) -> M {
        self.memory
    }

    /// True when the shard was read with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Every tensor, in file order, with the byte range it occupies in
    /// [`memory`](Self::memory).
    pub fn tensors(&self) -> impl Iterator<Item = (&TensorInfo, Range<usize>)> {
        self.header
            .tensors
            .iter()
            .filter_map(|t| Some((t, self.header.file_range(t)?)))
    }

    /// The tensor named `name` and its byte range in device memory.
    pub fn tensor(&self, name: &str) -> Option<(&TensorInfo, Range<usize>)> {
        let t = self.header.get(name)?;
        Some((t, self.header.file_range(t)?))
    }
}

/// One chunk of the plan: `len` bytes (a multiple of 4 KiB) read at
/// `offset` of shard `shard`.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    shard: usize,
    offset: usize,
    len: usize,
}

/// Everything the read stream's two callbacks share.
struct Ring<S: DeviceSink> {
    sink: S,
    alloc: Arc<dyn HostAllocator>,
    chunk_bytes: usize,
    /// Most staging buffers that may exist at once.
    cap: usize,
    /// Staging buffers allocated so far (at most `cap`).
    made: usize,
    free: Vec<AlignedBuf>,
    /// Copies queued, oldest first, each with the buffer it reads from.
    pending: VecDeque<(S::Fence, AlignedBuf)>,
    memory: Vec<S::Memory>,
    plan: Vec<Chunk>,
    next: usize,
    /// Reads handed back by the engine.
    done: usize,
    /// Most copies ever queued at once, for tests and reports.
    max_pending: usize,
    error: Option<LoadError>,
}

impl<S: DeviceSink> Ring<S> {
    fn fail(&mut self, e: LoadError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    fn device_err(&self, msg: String) -> LoadError {
        LoadError::Device {
            device: self.sink.describe(),
            msg,
        }
    }

    /// Waits for the oldest queued copy and frees its buffer; a failed
    /// fence leaks the buffer (the copy may still be reading it).
    fn retire_oldest(&mut self) -> Result<(), LoadError> {
        let Some((fence, buf)) = self.pending.pop_front() else {
            return Ok(());
        };
        match fence.wait() {
            Ok(()) => {
                self.free.push(buf);
                Ok(())
            }
            Err(msg) => {
                std::mem::forget(buf);
                Err(self.device_err(format!("copy to device failed: {msg}")))
            }
        }
    }

    /// A staging buffer for the next read: a free one, a new one while
    /// fewer than `cap` exist, or the oldest copy's once it completes.
    fn take_buffer(&mut self) -> Result<AlignedBuf, LoadError> {
        if let Some(b) = self.free.pop() {
            return Ok(b);
        }
        if self.made < self.cap {
            self.made += 1;
            return Ok(AlignedBuf::zeroed_in(
                &self.alloc,
                self.chunk_bytes,
                DIRECT_IO_ALIGN,
            )?);
        }
        self.retire_oldest()?;
        self.free.pop().ok_or_else(|| {
            self.device_err("no staging buffer came back (more reads than buffers)".into())
        })
    }

    fn next_op<'f>(&mut self, shards: &'f [OpenShard]) -> Option<IoOp<'f>> {
        if self.error.is_some() {
            return None;
        }
        let c = *self.plan.get(self.next)?;
        let mut buf = match self.take_buffer() {
            Ok(b) => b,
            Err(e) => {
                self.fail(e);
                return None;
            }
        };
        self.next += 1;
        buf.set_len(c.len);
        Some(IoOp::read(&shards.get(c.shard)?.file, c.offset as u64, buf))
    }

    fn on_read(&mut self, i: usize, d: IoDone<'_>, shards: &[OpenShard]) {
        self.done += 1;
        let Some(buf) = d.buf.into_owned() else {
            return;
        };
        let (Some(&c), true) = (self.plan.get(i), self.error.is_none()) else {
            self.free.push(buf);
            return;
        };
        let Some(shard) = shards.get(c.shard) else {
            self.free.push(buf);
            return;
        };
        let valid = (shard.len - c.offset as u64).min(c.len as u64) as usize;
        let checked = shard_read::check_read(shard, c.offset, valid, d.result)
            .and_then(|()| shard_read::check_prefix(shard, c.offset, &buf[..valid]));
        if let Err(e) = checked {
            self.free.push(buf);
            self.fail(e);
            return;
        }
        let Some(dst) = self.memory.get_mut(c.shard) else {
            self.free.push(buf);
            return;
        };
        // SAFETY: `buf` goes into `pending` with the fence and is neither
        // written nor freed until that fence's wait has returned Ok (or is
        // leaked if it fails): see `retire_oldest` and `drain`.
        match unsafe { self.sink.copy_async(&buf[..valid], dst, c.offset) } {
            Ok(fence) => {
                self.pending.push_back((fence, buf));
                self.max_pending = self.max_pending.max(self.pending.len());
            }
            Err(msg) => {
                // A copy that failed to queue may still have been partly
                // queued: leak the buffer rather than risk it.
                std::mem::forget(buf);
                let e = self.device_err(format!("queueing a copy failed: {msg}"));
                self.fail(e);
            }
        }
    }

    /// Waits for every queued copy.
    fn drain(&mut self) {
        while !self.pending.is_empty() {
            if let Err(e) = self.retire_oldest() {
                self.fail(e);
            }
        }
    }
}

/// What a staged load did, beyond [`LoadStats`].
#[derive(Debug, Clone, PartialEq)]
pub struct StagedStats {
    /// Bytes, time, I/O mode.
    pub load: LoadStats,
    /// The sink, e.g. "cuda:0".
    pub device: String,
    /// Staging buffers allocated (never more than the ring size).
    pub staging_buffers: usize,
    /// Most copies queued at once: above 0, copies ran while reads did.
    pub max_queued_copies: usize,
}

/// The result of [`load_shards_staged`].
#[derive(Debug)]
pub struct StagedLoad<M> {
    /// The shards, in the order asked.
    pub shards: Vec<DeviceShard<M>>,
    /// What the load did.
    pub stats: StagedStats,
}

/// Loads every shard in `paths` into memory from `sink`: all headers are
/// validated first, then one device allocation is made per shard, and the
/// shards are read in `cfg.chunk_bytes` chunks into at most `ring_len` staging
/// buffers, each copied to the device as soon as its read completes.
///
/// Reads in flight are `min(cfg.in_flight, ring_len)`; `ring_len` must be at least
/// 2, so that a copy can run while a read does. `cfg.prefault` does not
/// apply (the staging buffers are reused, not fresh).
pub fn load_shards_staged<S: DeviceSink>(
    paths: &[PathBuf],
    cfg: &LoaderConfig,
    ring_len: usize,
    engine: &IoEngine,
    sink: S,
) -> Result<StagedLoad<S::Memory>, LoadError> {
    cfg.check()?;
    if ring_len < 2 {
        return Err(LoadError::BadConfig(format!(
            "the staging ring needs at least 2 buffers, got {ring_len}"
        )));
    }
    let start = Instant::now();
    let opened = paths
        .iter()
        .map(|p| shard_read::open_shard(p, cfg))
        .collect::<Result<Vec<_>, _>>()?;
    let mut sink = sink;
    let mut memory = Vec::with_capacity(opened.len());
    let mut plan = Vec::new();
    for (i, shard) in opened.iter().enumerate() {
        let len = shard_read::shard_len(shard)?;
        let mem = sink.allocate(len).map_err(|msg| LoadError::Device {
            device: sink.describe(),
            msg: format!("allocating {len} bytes: {msg}"),
        })?;
        memory.push(mem);
        let mut offset = 0;
        while offset < len {
            let valid = cfg.chunk_bytes.min(len - offset);
            plan.push(Chunk {
                shard: i,
                offset,
                len: crate::align_up(valid, DIRECT_IO_ALIGN),
            });
            offset += valid;
        }
    }
    let ring = Ring {
        alloc: sink.staging_allocator(),
        sink,
        memory,
        chunk_bytes: cfg.chunk_bytes,
        cap: ring_len,
        made: 0,
        free: Vec::new(),
        pending: VecDeque::new(),
        plan,
        next: 0,
        done: 0,
        max_pending: 0,
        error: None,
    };
    let state = Mutex::new(ring);
    let lock = || state.lock().unwrap_or_else(PoisonError::into_inner);
    engine.run_stream(
        cfg.in_flight.min(ring_len),
        || lock().next_op(&opened),
        |i, d| lock().on_read(i, d, &opened),
    );
    let mut ring = state.into_inner().unwrap_or_else(PoisonError::into_inner);
    ring.drain();
    if ring.done != ring.next {
        // The engine kept buffers it could not reclaim from the kernel;
        // they are leaked there, and the load has failed.
        let path = opened.first().map(|s| s.path.clone()).unwrap_or_default();
        ring.fail(LoadError::Io {
            path,
            source: std::io::Error::other("the I/O engine failed with reads in flight"),
        });
    }
    if let Some(e) = ring.error.take() {
        return Err(e);
    }
    for shard in &opened {
        shard_read::check_unchanged(shard)?;
    }
    let stats = StagedStats {
        load: LoadStats::of(&opened, start, engine),
        device: ring.sink.describe(),
        staging_buffers: ring.made,
        max_queued_copies: ring.max_pending,
    };
    let shards = opened
        .into_iter()
        .zip(ring.memory)
        .map(|(s, memory)| DeviceShard {
            path: s.path,
            header: s.header,
            memory,
            direct: s.direct,
        })
        .collect();
    Ok(StagedLoad { shards, stats })
}

/// [`load_shards_staged`] for the model in `dir` (see
/// [`model_shards`]) on the shared engine; with an index, also checks that
/// every tensor it lists is in the shard it names.
pub fn load_model_dir_staged<S: DeviceSink>(
    dir: &Path,
    cfg: &LoaderConfig,
    ring_len: usize,
    sink: S,
) -> Result<StagedLoad<S::Memory>, LoadError> {
    let paths = model_shards(dir)?;
    let load = load_shards_staged(&paths, cfg, ring_len, IoEngine::shared(), sink)?;
    check_index(dir, load.shards.iter().map(|s| (s.path(), s.header())))?;
    Ok(load)
}
