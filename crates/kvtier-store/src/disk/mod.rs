//! G3: the disk tier, on one or more directories (local NVMe, an NVMe-oF
//! namespace, NFS, any mounted path).
//!
//! # Layout on disk
//!
//! All blocks of one store have one layout and so one size, so G3 is an
//! array of fixed-size **slots** in large preallocated (sparse) **segment
//! files**: `DIR/kvtier-g3/<layout>/seg-<n>.kvt`, where `<layout>` names
//! layers, KV heads, head dim, block tokens and dtype (e.g.
//! `l2-h2-d64-t16-f32`, plus the codec, the arrangement and the shard
//! when not uncoded, KV-major and unsharded), so stores of different layouts never share slots. Slot `s` lives in
//! directory `s % dirs` (striping), at local index `s / dirs`, in segment
//! `local / slots_per_segment` at offset `(local % slots_per_segment) *
//! slot_bytes`. No log, no compaction: a put overwrites a whole slot with one
//! aligned write; a slot holds exactly one encoded block ([`crate::block`]).
//!
//! # The index survives restart
//!
//! The in-memory index (key -> slot) is saved as a checkpoint plus a
//! journal of the slots taken, written and wiped since
//! (`saved_index`), so an open reads them instead of every slot. When
//! they are missing, torn or foreign, it is rebuilt by reading every
//! slot's header (4 KiB each, many in flight; `recover`): a header that
//! fails its checksum, or belongs to another layout, marks the slot free. Every read
//! verifies the whole block (header and payload checksums, the key and the
//! layout) before serving it, as each read completes while the others are
//! still in flight, so a block that was not fully written (a crash
//! mid-write, a truncated segment) is never served: it is a miss, it is
//! removed from the index and its header is wiped. Evicted blocks are only
//! dropped from the index; if the process dies before their slot is reused
//! they come back at the next open, which is harmless (same key, same bytes).
//!
//! # Eviction and leases
//!
//! Slots are reclaimed with CLOCK (second chance,
//! [`crate::eviction::clock`]): a hit sets a slot's reference bit; the hand
//! clears set bits and takes the first clear one. A slot being read is
//! pinned and is never chosen, so a block cannot be overwritten under a
//! reader.
//!
//! # One owner
//!
//! Each slot directory is locked at open (`dir_lock`): a second store on
//! the same directory, in any process, is refused with the holder's pid.
//!
//! # Files
//!
//! `dir_lock` (the owner lock), `slots` (the slot table: index, free
//! list, pins, CLOCK), `saved_index` (checkpoint and journal),
//! `recover` (the index rebuilt at open), `slot_read` (batched, verified reads),
//! `part_read` (reads in parts, layer-major, for a layer-wise restore),
//! `slot_write` (batched writes, wipes, sync), `remove` (a G3 no store
//! owns removed, kvtier's files only); this file holds the configuration
//! and opening.

mod dir_lock;
mod part_read;
mod recover;
mod remove;
mod saved_index;
mod slot_read;
mod slot_write;
mod slots;

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvtier_io::{AlignedBuf, HostAllocator, IoEngine, open_direct, probe_direct};
use parking_lot::Mutex;

use crate::block::BlockError;
use crate::eviction::EvictionKind;
use crate::key::{BlockKey, ModelFingerprint};
use crate::kv_layout::{Arrangement, KvLayout};
use crate::metrics::{Tier, TierMetrics};
use crate::outcome::{BlockFailure, BlockRead, Refused};
use crate::verify::BlockSpec;
pub use part_read::{OnLanded, ReadCuts};
pub use recover::Recovery;
use saved_index::SavedIndex;
use slots::SlotTable;

/// Configuration of a [`DiskTier`].
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Directories to stripe over (each its own device, ideally).
    pub dirs: Vec<PathBuf>,
    /// Bytes of slots in all (rounded down to whole slots per directory).
    pub capacity_bytes: u64,
    /// Layout of every block; one slot holds one encoded block of it.
    pub layout: KvLayout,
    /// The model every block read must come from (`None`: any model of this
    /// layout; keys are seeded by the model, so another's never match).
    pub fingerprint: Option<ModelFingerprint>,
    /// Bytes of one segment file (rounded down to whole slots; at least one).
    pub segment_bytes: u64,
    /// Reads or writes in flight per batch.
    pub in_flight: usize,
    /// Force direct (`Some(true)`) or buffered (`Some(false)`) I/O; `None` probes.
    pub direct: Option<bool>,
    /// Which block to reclaim when the slots are full (default kvtier's
    /// own; a store sets it to its [`StoreConfig::eviction`](crate::StoreConfig::eviction)).
    pub eviction: EvictionKind,
}

impl DiskConfig {
    /// A configuration with defaults: any model, 1 GiB segments, 32 in
    /// flight, probed direct I/O.
    pub fn new(dirs: Vec<PathBuf>, capacity_bytes: u64, layout: KvLayout) -> Self {
        Self {
            dirs,
            capacity_bytes,
            layout,
            fingerprint: None,
            segment_bytes: 1 << 30,
            in_flight: 32,
            direct: None,
            eviction: EvictionKind::default(),
        }
    }
}

/// Why a G3 operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The configuration cannot work.
    #[error("bad G3 configuration: {0}")]
    Config(String),
    /// Opening or creating a directory or segment failed.
    #[error("G3 cannot open {path}: {source}")]
    Open {
        /// Path involved.
        path: PathBuf,
        /// Underlying error.
        source: io::Error,
    },
    /// The layout is invalid.
    #[error("bad G3 layout: {0}")]
    Layout(#[from] BlockError),
    /// A block has the wrong size for this tier's slots.
    #[error("block of {got} bytes does not fit G3 slots of {slot} bytes")]
    WrongSize {
        /// Bytes given.
        got: usize,
        /// Slot size.
        slot: usize,
    },
    /// Every slot is pinned by a reader or being written.
    #[error("G3 full: no slot can be reclaimed (all pinned or being written)")]
    Full,
    /// The write failed (ENOSPC on a full device, EIO, ...).
    #[error("G3 write failed: {0}")]
    Io(#[source] io::Error),
    /// Allocating a buffer failed.
    #[error("G3 buffer allocation failed: {0}")]
    Alloc(String),
    /// Another store (in this or another process) holds the directory's
    /// owner lock.
    #[error(
        "G3 directory {} is in use by {} (lock {}); two kvtier stores must not share a cache directory: stop the other or use another cache directory",
        path.parent().unwrap_or(path).display(),
        dir_lock::holder_text(holder),
        path.display()
    )]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// The holder's pid, as it wrote it.
        holder: Option<u32>,
    },
}

/// What a read of one key found (the buffer travels beside it, in
/// [`DiskRead`]): a hit verified in the buffer, a miss (not in the index), a
/// block that failed verification (removed; a miss to the caller), or a
/// failed read (a miss to the caller; the block stays indexed).
pub type ReadOutcome = BlockRead<()>;

/// A block G3 held and refused.
pub(crate) fn refused(reason: BlockError) -> ReadOutcome {
    BlockRead::Corrupt(Refused {
        tier: Tier::G3,
        reason,
    })
}

/// A G3 read that failed.
pub(crate) fn failed(e: &io::Error) -> ReadOutcome {
    BlockRead::Failed(BlockFailure::disk(e))
}

/// One result of [`DiskTier::read_many`].
#[derive(Debug)]
pub struct DiskRead {
    /// The key asked for.
    pub key: BlockKey,
    /// The caller's buffer, handed back (holding the block on a hit).
    pub buf: AlignedBuf,
    /// What was found.
    pub outcome: ReadOutcome,
}

/// Result of putting one block.
#[derive(Debug)]
pub enum PutOutcome {
    /// Written now.
    Written,
    /// Already stored (or being stored by another caller): nothing written.
    Present,
}

/// The G3 tier. Thread-safe; every method takes `&self`.
#[derive(Debug)]
pub struct DiskTier {
    spec: BlockSpec,
    slot_bytes: usize,
    slots_per_segment: u64,
    dirs: Vec<PathBuf>,
    /// `segments[dir][segment]`
    segments: Vec<Vec<File>>,
    direct: bool,
    direct_reason: Option<String>,
    engine: IoEngine,
    in_flight: usize,
    alloc: Arc<dyn HostAllocator>,
    slots: Mutex<SlotTable>,
    metrics: TierMetrics,
    /// The index on disk (`None` only while opening).
    saved: Option<SavedIndex>,
    /// How the index was rebuilt at open.
    recovery: Recovery,
    /// One per directory, held while the tier lives.
    _locks: Vec<dir_lock::DirLock>,
}

impl DiskTier {
    /// Opens (creating as needed) the tier and rebuilds its index: from
    /// the saved index when it is whole, else from the slot headers.
    pub fn open(
        config: DiskConfig,
        engine: IoEngine,
        alloc: Arc<dyn HostAllocator>,
        metrics: TierMetrics,
    ) -> Result<Self, DiskError> {
        config.layout.validate().map_err(BlockError::from)?;
        let slot_bytes = config.layout.encoded_bytes();
        if config.dirs.is_empty() {
            return Err(DiskError::Config("no G3 directory given".into()));
        }
        let ndirs = config.dirs.len() as u64;
        let per_dir = config.capacity_bytes / slot_bytes / ndirs;
        if per_dir == 0 {
            return Err(DiskError::Config(format!(
                "capacity {} bytes holds no {slot_bytes}-byte slot in each of {ndirs} directories",
                config.capacity_bytes
            )));
        }
        let total = per_dir * ndirs;
        if total > u32::MAX as u64 {
            return Err(DiskError::Config(format!(
                "{total} slots is more than supported"
            )));
        }
        let slots_per_segment = (config.segment_bytes / slot_bytes).max(1);
        let nseg = per_dir.div_ceil(slots_per_segment);

        let mut dirs = Vec::new();
        let mut direct = true;
        let mut direct_reason = None;
        let mut locks = Vec::new();
        for root in &config.dirs {
            let dir = Self::slot_dir(root, &config.layout);
            std::fs::create_dir_all(&dir).map_err(|source| DiskError::Open {
                path: dir.clone(),
                source,
            })?;
            locks.push(dir_lock::DirLock::acquire(&dir)?);
            match config.direct {
                Some(true) => {}
                Some(false) => {
                    direct = false;
                    direct_reason = Some("buffered I/O requested by configuration".into());
                }
                None => {
                    let probe = probe_direct(&dir);
                    if !probe.direct {
                        direct = false;
                        direct_reason = probe.reason;
                    }
                }
            }
            dirs.push(dir);
        }
        let mut segments = Vec::new();
        // A segment shorter than its slots (new, or truncated while kvtier
        // was not running) holds no block a saved index may vouch for.
        let mut resized = None;
        for dir in &dirs {
            let mut files = Vec::new();
            for seg in 0..nseg {
                let slots_here = slots_per_segment.min(per_dir - seg * slots_per_segment);
                let path = dir.join(segment_name(seg));
                let (file, extended) = open_segment(&path, slots_here * slot_bytes, direct)?;
                if extended && resized.is_none() {
                    resized = Some(path);
                }
                files.push(file);
            }
            segments.push(files);
        }

        metrics.capacity_bytes.set((total * slot_bytes) as i64);
        let mut tier = Self {
            spec: BlockSpec {
                layout: config.layout,
                fingerprint: config.fingerprint,
            },
            slot_bytes: slot_bytes as usize,
            slots_per_segment,
            dirs,
            segments,
            direct,
            direct_reason,
            in_flight: config.in_flight.max(1),
            engine,
            alloc,
            slots: Mutex::new(SlotTable::new(total as u32, config.eviction)),
            metrics,
            saved: None,
            recovery: Recovery::Scanned {
                why: "not opened yet".into(),
            },
            _locks: locks,
        };
        tier.recover_index(resized)?;
        Ok(tier)
    }

    /// Where slot `slot` lives: (directory, segment, byte offset).
    fn place(&self, slot: u32) -> (usize, u64, u64) {
        let ndirs = self.dirs.len() as u64;
        let s = u64::from(slot);
        let local = s / ndirs;
        (
            (s % ndirs) as usize,
            local / self.slots_per_segment,
            (local % self.slots_per_segment) * self.slot_bytes as u64,
        )
    }

    /// The open segment file and offset of slot `slot`.
    fn locate(&self, slot: u32) -> (&File, u64) {
        let (dir, seg, off) = self.place(slot);
        (&self.segments[dir][seg as usize], off)
    }

    /// Updates the occupancy gauge from the slot table.
    fn set_occupancy(&self, slots: &SlotTable) {
        self.metrics
            .occupancy_bytes
            .set((slots.valid() * self.slot_bytes as u64) as i64);
    }

    /// Bytes of one slot (= one encoded block).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of slots.
    pub fn capacity_slots(&self) -> usize {
        self.slots.lock().len()
    }

    /// Blocks stored.
    pub fn len(&self) -> usize {
        self.slots.lock().blocks()
    }

    /// True when no block is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when `key` is indexed (no hit is recorded).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.slots.lock().slot_of(key).is_some()
    }

    /// [`contains`](Self::contains) for each of `keys`, under one lock.
    pub fn contains_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        let slots = self.slots.lock();
        keys.iter().map(|k| slots.slot_of(k).is_some()).collect()
    }

    /// Every stored key (any order).
    pub fn keys(&self) -> Vec<BlockKey> {
        self.slots.lock().keys()
    }

    /// True when the tier uses `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// The I/O engine in use.
    pub fn engine(&self) -> &IoEngine {
        &self.engine
    }

    /// One line: backend and direct/buffered, with the fallback reason.
    pub fn describe_io(&self) -> String {
        let mode = if self.direct { "direct" } else { "buffered" };
        match &self.direct_reason {
            Some(r) => format!("{}, {mode} ({r})", self.engine.describe()),
            None => format!("{}, {mode}", self.engine.describe()),
        }
    }

    /// The segment directories.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Where `key`'s block lives: segment file and byte offset (for tools
    /// and fault-injection tests).
    pub fn locate_key(&self, key: &BlockKey) -> Option<(PathBuf, u64)> {
        let slot = self.slots.lock().slot_of(key)?;
        let (dir, seg, off) = self.place(slot);
        Some((self.dirs[dir].join(segment_name(seg)), off))
    }

    /// The directory a store rooted at `root` uses for blocks of `layout`.
    /// A codec, an arrangement other than KV-major and a shard add their
    /// names: `l2-h2-d64-t128-f32-as-int8-layer-fused-tp1of2`.
    pub fn slot_dir(root: &Path, layout: &KvLayout) -> PathBuf {
        let mut name = format!(
            "l{}-h{}-d{}-t{}-{}",
            layout.layers,
            layout.kv_heads,
            layout.head_dim,
            layout.block_tokens,
            layout.dtype.name()
        );
        if layout.codec != crate::KvCodec::None {
            name = format!("{name}-as-{}", layout.codec.name());
        }
        if layout.arrangement != Arrangement::KvMajor {
            name = format!("{name}-{}", layout.arrangement.name());
        }
        if let Some(s) = layout.shard {
            name = format!("{name}-tp{}of{}", s.rank, s.world);
        }
        root.join("kvtier-g3").join(name)
    }

    /// The layout of every block in this tier.
    pub fn layout(&self) -> KvLayout {
        self.spec.layout
    }

    /// How the index was rebuilt when the tier opened.
    pub fn recovery(&self) -> &Recovery {
        &self.recovery
    }

    /// Records slot changes in the saved index's journal.
    fn journal(&self, changes: &[saved_index::Change]) {
        if let Some(s) = &self.saved {
            s.append(changes);
        }
    }

    /// Writes a checkpoint of the index now (a clean stop does, through
    /// [`sync`](Self::sync); so does a long journal).
    pub fn checkpoint(&self) {
        if let Some(s) = &self.saved {
            s.checkpoint(|| self.slots.lock().entries());
        }
    }
}

/// The file name of segment `seg`.
fn segment_name(seg: u64) -> String {
    format!("seg-{seg:05}.kvt")
}

/// Opens (creating) one segment and extends it to `want` bytes; true when
/// it had to be extended.
fn open_segment(path: &Path, want: u64, direct: bool) -> Result<(File, bool), DiskError> {
    let open_err = |source| DiskError::Open {
        path: path.to_path_buf(),
        source,
    };
    let file = open_direct(path, true, direct).map_err(open_err)?;
    let have = file.metadata().map_err(open_err)?.len();
    if have < want {
        // Sparse: space is taken when slots are written, so a full device
        // shows up as a failed put, counted, not as a failed open. A
        // truncated segment is re-extended; the slots it lost read as empty.
        file.set_len(want).map_err(open_err)?;
    }
    Ok((file, have < want))
}
