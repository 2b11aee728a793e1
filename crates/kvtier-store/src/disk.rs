//! G3: the disk tier, on one or more directories (local NVMe, an NVMe-oF
//! namespace, NFS, any mounted path).
//!
//! # Layout on disk
//!
//! All blocks of one store have one layout and so one size, so G3 is an
//! array of fixed-size **slots** in large preallocated (sparse) **segment
//! files**: `DIR/kvtier-g3/<layout>/seg-<n>.kvt`, where `<layout>` names
//! layers, KV heads, head dim, block tokens and dtype (e.g.
//! `l2-h2-d64-t16-f32`), so stores of different layouts never share slots. Slot `s` lives in
//! directory `s % dirs` (striping), at local index `s / dirs`, in segment
//! `local / slots_per_segment` at offset `(local % slots_per_segment) *
//! slot_bytes`. No log, no compaction: a put overwrites a whole slot with one
//! aligned write; a slot holds exactly one encoded block ([`crate::block`]).
//!
//! # The index survives restart
//!
//! The in-memory index (key -> slot) is rebuilt at open by reading every
//! slot's header (4 KiB each, many in flight). A header that fails its
//! checksum, or belongs to another layout, marks the slot free. Every read
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
//! Slots are reclaimed with CLOCK (second chance): a hit sets a slot's
//! reference bit; the hand clears set bits and takes the first clear one. A
//! slot being read is pinned and is never chosen, so a block cannot be
//! overwritten under a reader.
//!
//! # Not yet
//!
//! Open time grows with capacity / slot size (one 4 KiB header read per
//! slot: about 1.3 s per million slots at 3 GB/s). A checkpointed index
//! would make it constant; not needed at the sizes tested here.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kvtier_io::{
    AlignedBuf, DIRECT_IO_ALIGN, HostAllocator, IoDone, IoEngine, IoOp, open_direct, probe_direct,
};
use parking_lot::Mutex;

use crate::block::{BlockError, BlockHeader, HEADER_BYTES, decode_block};
use crate::key::BlockKey;
use crate::layout::KvLayout;
use crate::metrics::TierMetrics;

/// Configuration of a [`DiskTier`].
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Directories to stripe over (each its own device, ideally).
    pub dirs: Vec<PathBuf>,
    /// Bytes of slots in all (rounded down to whole slots per directory).
    pub capacity_bytes: u64,
    /// Layout of every block; one slot holds one encoded block of it.
    pub layout: KvLayout,
    /// Bytes of one segment file (rounded down to whole slots; at least one).
    pub segment_bytes: u64,
    /// Reads or writes in flight per batch.
    pub in_flight: usize,
    /// Force direct (`Some(true)`) or buffered (`Some(false)`) I/O; `None` probes.
    pub direct: Option<bool>,
}

impl DiskConfig {
    /// A configuration with defaults: 1 GiB segments, 32 in flight, probed
    /// direct I/O.
    pub fn new(dirs: Vec<PathBuf>, capacity_bytes: u64, layout: KvLayout) -> Self {
        Self {
            dirs,
            capacity_bytes,
            layout,
            segment_bytes: 1 << 30,
            in_flight: 32,
            direct: None,
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
}

/// What a read of one key found.
#[derive(Debug)]
pub enum ReadOutcome {
    /// The block was found and verified; the buffer holds it.
    Hit,
    /// Not in the index.
    Miss,
    /// Found but failed verification; it was removed. Served as a miss.
    Corrupt(BlockError),
    /// The read failed. Served as a miss; the block stays indexed.
    Io(io::Error),
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Reserved for a write (or a wipe) in progress.
    Writing,
    Valid,
    /// Removed while pinned; freed by the last unpin.
    Dead,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    key: BlockKey,
    state: SlotState,
    referenced: bool,
    pins: u32,
}

#[derive(Debug)]
struct State {
    index: HashMap<BlockKey, u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    hand: usize,
    writing: HashSet<BlockKey>,
    valid: u64,
}

/// The G3 tier. Thread-safe; every method takes `&self`.
#[derive(Debug)]
pub struct DiskTier {
    layout: KvLayout,
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
    state: Mutex<State>,
    metrics: TierMetrics,
}

impl DiskTier {
    /// Opens (creating as needed) the tier and rebuilds its index from the
    /// slot headers on disk.
    pub fn open(
        config: DiskConfig,
        engine: IoEngine,
        alloc: Arc<dyn HostAllocator>,
        metrics: TierMetrics,
    ) -> Result<Self, DiskError> {
        config.layout.validate()?;
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
        let mut segments = Vec::new();
        let mut direct = true;
        let mut direct_reason = None;
        for root in &config.dirs {
            let dir = Self::slot_dir(root, &config.layout);
            std::fs::create_dir_all(&dir).map_err(|source| DiskError::Open {
                path: dir.clone(),
                source,
            })?;
            match config.direct {
                Some(d) => {
                    if !d {
                        direct = false;
                        direct_reason = Some("buffered I/O requested by configuration".into());
                    }
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
        for dir in &dirs {
            let mut files = Vec::new();
            for seg in 0..nseg {
                let slots_here = slots_per_segment.min(per_dir - seg * slots_per_segment);
                let path = dir.join(format!("seg-{seg:05}.kvt"));
                let file = open_direct(&path, true, direct).map_err(|source| DiskError::Open {
                    path: path.clone(),
                    source,
                })?;
                let want = slots_here * slot_bytes;
                let have = file
                    .metadata()
                    .map_err(|source| DiskError::Open {
                        path: path.clone(),
                        source,
                    })?
                    .len();
                if have < want {
                    // Sparse: space is taken when slots are written, so a
                    // full device shows up as a failed put, counted, not as
                    // a failed open. A truncated segment is re-extended; the
                    // slots it lost read as empty.
                    file.set_len(want).map_err(|source| DiskError::Open {
                        path: path.clone(),
                        source,
                    })?;
                }
                files.push(file);
            }
            segments.push(files);
        }

        metrics.capacity_bytes.set((total * slot_bytes) as i64);
        let tier = Self {
            layout: config.layout,
            slot_bytes: slot_bytes as usize,
            slots_per_segment,
            dirs,
            segments,
            direct,
            direct_reason,
            in_flight: config.in_flight.max(1),
            engine,
            alloc,
            state: Mutex::new(State {
                index: HashMap::new(),
                slots: vec![
                    Slot {
                        key: BlockKey([0; 16]),
                        state: SlotState::Free,
                        referenced: false,
                        pins: 0,
                    };
                    total as usize
                ],
                free: Vec::new(),
                hand: 0,
                writing: HashSet::new(),
                valid: 0,
            }),
            metrics,
        };
        tier.rebuild_index()?;
        Ok(tier)
    }

    fn locate(&self, slot: u32) -> (&File, u64) {
        let ndirs = self.dirs.len() as u64;
        let s = slot as u64;
        let dir = (s % ndirs) as usize;
        let local = s / ndirs;
        let seg = (local / self.slots_per_segment) as usize;
        let off = (local % self.slots_per_segment) * self.slot_bytes as u64;
        (&self.segments[dir][seg], off)
    }

    /// Reads every slot header and rebuilds the index.
    fn rebuild_index(&self) -> Result<(), DiskError> {
        let total = self.state.lock().slots.len() as u32;
        const CHUNK: u32 = 1024;
        let mut pool: Vec<AlignedBuf> = Vec::new();
        let mut state = self.state.lock();
        let mut start = 0u32;
        while start < total {
            let end = (start + CHUNK).min(total);
            let mut ops = Vec::with_capacity((end - start) as usize);
            for slot in start..end {
                let buf = match pool.pop() {
                    Some(mut b) => {
                        b.set_len(DIRECT_IO_ALIGN);
                        b
                    }
                    None => AlignedBuf::zeroed_in(&self.alloc, DIRECT_IO_ALIGN, DIRECT_IO_ALIGN)
                        .map_err(|e| DiskError::Alloc(e.to_string()))?,
                };
                let (file, off) = self.locate(slot);
                ops.push(IoOp::read(file, off, buf));
            }
            for (i, done) in self
                .engine
                .run_batch(ops, self.in_flight)
                .into_iter()
                .enumerate()
            {
                let slot = start + i as u32;
                let header = match &done.result {
                    Ok(n) if *n >= HEADER_BYTES => {
                        BlockHeader::decode(&done.buf[..HEADER_BYTES]).ok()
                    }
                    _ => None,
                };
                match header {
                    Some(h)
                        if h.encoded_len() == self.slot_bytes
                            && !state.index.contains_key(&h.key) =>
                    {
                        state.index.insert(h.key, slot);
                        let s = &mut state.slots[slot as usize];
                        s.key = h.key;
                        s.state = SlotState::Valid;
                        state.valid += 1;
                    }
                    _ => state.free.push(slot),
                }
                if let Some(b) = done.buf.into_owned() {
                    pool.push(b);
                }
            }
            start = end;
        }
        // Hand out low slots first.
        state.free.reverse();
        self.metrics
            .occupancy_bytes
            .set((state.valid * self.slot_bytes as u64) as i64);
        Ok(())
    }

    /// Bytes of one slot (= one encoded block).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of slots.
    pub fn capacity_slots(&self) -> usize {
        self.state.lock().slots.len()
    }

    /// Blocks stored.
    pub fn len(&self) -> usize {
        self.state.lock().index.len()
    }

    /// True when no block is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when `key` is indexed (no hit is recorded).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.state.lock().index.contains_key(key)
    }

    /// Every stored key (any order).
    pub fn keys(&self) -> Vec<BlockKey> {
        self.state.lock().index.keys().copied().collect()
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
        let slot = *self.state.lock().index.get(key)?;
        let ndirs = self.dirs.len() as u64;
        let local = slot as u64 / ndirs;
        let dir = &self.dirs[(slot as u64 % ndirs) as usize];
        let seg = local / self.slots_per_segment;
        let off = (local % self.slots_per_segment) * self.slot_bytes as u64;
        Some((dir.join(format!("seg-{seg:05}.kvt")), off))
    }

    /// Takes a free slot, or reclaims one with CLOCK. `None` when every slot
    /// is pinned or being written.
    fn alloc_slot(&self, st: &mut State) -> Option<u32> {
        if let Some(s) = st.free.pop() {
            return Some(s);
        }
        let n = st.slots.len();
        for _ in 0..2 * n {
            let i = st.hand;
            st.hand = (st.hand + 1) % n;
            let slot = &mut st.slots[i];
            if slot.state != SlotState::Valid || slot.pins > 0 {
                continue;
            }
            if slot.referenced {
                slot.referenced = false;
                continue;
            }
            let key = slot.key;
            slot.state = SlotState::Free;
            st.index.remove(&key);
            st.valid -= 1;
            self.metrics.evictions.inc();
            return Some(i as u32);
        }
        None
    }

    /// Writes encoded blocks (each exactly one slot long), all in flight at
    /// once up to the configured depth. Blocks already stored are skipped.
    /// A failed write frees its slot and damages nothing already stored.
    pub fn put_many(
        &self,
        blocks: &[(BlockKey, Arc<AlignedBuf>)],
    ) -> Vec<Result<PutOutcome, DiskError>> {
        let mut results: Vec<Option<Result<PutOutcome, DiskError>>> =
            (0..blocks.len()).map(|_| None).collect();
        let mut planned: Vec<(usize, u32)> = Vec::new();
        {
            let mut st = self.state.lock();
            for (i, (key, buf)) in blocks.iter().enumerate() {
                if buf.len() != self.slot_bytes {
                    results[i] = Some(Err(DiskError::WrongSize {
                        got: buf.len(),
                        slot: self.slot_bytes,
                    }));
                    continue;
                }
                if st.index.contains_key(key) || st.writing.contains(key) {
                    results[i] = Some(Ok(PutOutcome::Present));
                    continue;
                }
                match self.alloc_slot(&mut st) {
                    Some(slot) => {
                        let s = &mut st.slots[slot as usize];
                        s.state = SlotState::Writing;
                        s.key = *key;
                        s.referenced = false;
                        st.writing.insert(*key);
                        planned.push((i, slot));
                    }
                    None => results[i] = Some(Err(DiskError::Full)),
                }
            }
        }
        if !planned.is_empty() {
            let ops = planned
                .iter()
                .map(|&(i, slot)| {
                    let (file, off) = self.locate(slot);
                    IoOp::write_shared(file, off, blocks[i].1.clone())
                })
                .collect();
            let t = Instant::now();
            let done = self.engine.run_batch(ops, self.in_flight);
            self.metrics
                .write_seconds
                .observe(t.elapsed().as_secs_f64());
            let mut failed = Vec::new();
            let mut st = self.state.lock();
            for (&(i, slot), d) in planned.iter().zip(done) {
                let key = blocks[i].0;
                st.writing.remove(&key);
                match d.result {
                    Ok(_) => {
                        st.slots[slot as usize].state = SlotState::Valid;
                        st.index.insert(key, slot);
                        st.valid += 1;
                        self.metrics.written_bytes.inc_by(self.slot_bytes as u64);
                        results[i] = Some(Ok(PutOutcome::Written));
                    }
                    Err(e) => {
                        // The slot stays reserved until its header is wiped:
                        // a partly written header must not index it again
                        // after a restart.
                        failed.push(slot);
                        self.metrics.put_errors.inc();
                        results[i] = Some(Err(DiskError::Io(e)));
                    }
                }
            }
            self.metrics
                .occupancy_bytes
                .set((st.valid * self.slot_bytes as u64) as i64);
            drop(st);
            if !failed.is_empty() {
                self.wipe(&failed);
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(DiskError::Full)))
            .collect()
    }

    /// Reads `reqs` (key, buffer of at least one slot) with all reads in
    /// flight at once up to the configured depth, verifies each block, and
    /// hands every buffer back. Blocks being read are pinned: they cannot be
    /// evicted or overwritten until their read completes.
    pub fn read_many(&self, reqs: Vec<(BlockKey, AlignedBuf)>) -> Vec<DiskRead> {
        self.read_many_with(reqs, self.in_flight)
    }

    /// [`read_many`](Self::read_many) with an explicit in-flight depth.
    pub fn read_many_with(
        &self,
        reqs: Vec<(BlockKey, AlignedBuf)>,
        in_flight: usize,
    ) -> Vec<DiskRead> {
        let mut out: Vec<Option<DiskRead>> = (0..reqs.len()).map(|_| None).collect();
        let mut plan: Vec<(usize, BlockKey, u32)> = Vec::new();
        let mut bufs: Vec<AlignedBuf> = Vec::new();
        {
            let mut st = self.state.lock();
            for (i, (key, mut buf)) in reqs.into_iter().enumerate() {
                let slot = st.index.get(&key).copied();
                match slot {
                    Some(slot) if buf.capacity() >= self.slot_bytes => {
                        let s = &mut st.slots[slot as usize];
                        s.pins += 1;
                        s.referenced = true;
                        buf.set_len(self.slot_bytes);
                        plan.push((i, key, slot));
                        bufs.push(buf);
                    }
                    Some(_) => {
                        out[i] = Some(DiskRead {
                            key,
                            buf,
                            outcome: ReadOutcome::Io(io::Error::new(
                                io::ErrorKind::InvalidInput,
                                "read buffer smaller than a G3 slot",
                            )),
                        });
                    }
                    None => {
                        self.metrics.misses.inc();
                        out[i] = Some(DiskRead {
                            key,
                            buf,
                            outcome: ReadOutcome::Miss,
                        });
                    }
                }
            }
        }
        if !plan.is_empty() {
            let ops = plan
                .iter()
                .zip(bufs)
                .map(|(&(_, _, slot), buf)| {
                    let (file, off) = self.locate(slot);
                    IoOp::read(file, off, buf)
                })
                .collect();
            // Each block is verified as its read completes, while the rest
            // are still in flight, so checksums overlap I/O.
            let verify = |j: usize, d: &IoDone| -> Option<Result<(), BlockError>> {
                let key = plan.get(j).map(|p| p.1)?;
                d.result.as_ref().ok()?;
                Some(self.verify(&d.buf, &key))
            };
            let t = Instant::now();
            let done = self.engine.run_batch_map(ops, in_flight, verify);
            self.metrics.read_seconds.observe(t.elapsed().as_secs_f64());
            let mut corrupt: Vec<u32> = Vec::new();
            let mut finished = Vec::with_capacity(plan.len());
            for (&(i, key, slot), (d, verified)) in plan.iter().zip(done) {
                let Some(buf) = d.buf.into_owned() else {
                    continue;
                };
                let outcome = match (d.result, verified) {
                    (Err(e), _) => ReadOutcome::Io(e),
                    (Ok(_), Some(Ok(()))) => ReadOutcome::Hit,
                    (Ok(_), Some(Err(e))) => ReadOutcome::Corrupt(e),
                    (Ok(_), None) => ReadOutcome::Io(io::Error::other("read not verified")),
                };
                finished.push((i, key, slot, buf, outcome));
            }
            let mut st = self.state.lock();
            for (i, key, slot, buf, outcome) in finished {
                st.slots[slot as usize].pins -= 1;
                match &outcome {
                    ReadOutcome::Hit => {
                        self.metrics.hits.inc();
                        self.metrics.read_bytes.inc_by(self.slot_bytes as u64);
                    }
                    ReadOutcome::Corrupt(e) => {
                        self.metrics.misses.inc();
                        if st.index.get(&key) == Some(&slot) {
                            // Counted once per block, however many readers saw it.
                            tracing::warn!("G3 block {key} failed verification ({e}); deleting it");
                            self.metrics.corrupt_blocks.inc();
                            st.index.remove(&key);
                            st.valid -= 1;
                            st.slots[slot as usize].state = SlotState::Dead;
                        }
                    }
                    ReadOutcome::Io(e) => {
                        tracing::warn!("G3 read of {key} failed: {e}");
                        self.metrics.misses.inc();
                    }
                    ReadOutcome::Miss => {}
                }
                let s = &mut st.slots[slot as usize];
                if s.state == SlotState::Dead && s.pins == 0 {
                    // Reserve it for the wipe; freed after.
                    s.state = SlotState::Writing;
                    corrupt.push(slot);
                }
                out[i] = Some(DiskRead { key, buf, outcome });
            }
            self.metrics
                .occupancy_bytes
                .set((st.valid * self.slot_bytes as u64) as i64);
            drop(st);
            if !corrupt.is_empty() {
                self.wipe(&corrupt);
            }
        }
        out.into_iter().flatten().collect()
    }

    /// Zeroes the header page of reserved slots so deleted (or partly
    /// written) blocks do not come back at the next open, then frees them.
    fn wipe(&self, slots: &[u32]) {
        let mut ops = Vec::new();
        for &slot in slots {
            let (file, off) = self.locate(slot);
            match AlignedBuf::zeroed_in(&self.alloc, DIRECT_IO_ALIGN, DIRECT_IO_ALIGN) {
                Ok(buf) => ops.push(IoOp::write(file, off, buf)),
                Err(e) => tracing::warn!("cannot wipe G3 slot {slot}: {e}"),
            }
        }
        for d in self.engine.run_batch(ops, self.in_flight) {
            if let Err(e) = d.result {
                tracing::warn!("wiping a corrupt G3 slot failed: {e}");
            }
        }
        let mut st = self.state.lock();
        for &slot in slots {
            st.slots[slot as usize].state = SlotState::Free;
            st.free.push(slot);
        }
    }

    /// Reads blocks into fresh buffers from the allocation hook; `None` for a
    /// miss (including a corrupt block, which is deleted).
    pub fn get_many(&self, keys: &[BlockKey]) -> Vec<Option<AlignedBuf>> {
        let mut reqs = Vec::with_capacity(keys.len());
        for key in keys {
            match AlignedBuf::zeroed_in(&self.alloc, self.slot_bytes, DIRECT_IO_ALIGN) {
                Ok(buf) => reqs.push((*key, buf)),
                Err(e) => {
                    tracing::warn!("G3 read buffer allocation failed: {e}");
                    reqs.push((*key, AlignedBuf::empty()));
                }
            }
        }
        self.read_many(reqs)
            .into_iter()
            .map(|r| matches!(r.outcome, ReadOutcome::Hit).then_some(r.buf))
            .collect()
    }

    /// Drops `key` from the index (its slot becomes free once unpinned).
    pub fn remove(&self, key: &BlockKey) -> bool {
        let mut st = self.state.lock();
        let Some(slot) = st.index.remove(key) else {
            return false;
        };
        st.valid -= 1;
        let s = &mut st.slots[slot as usize];
        if s.pins == 0 {
            s.state = SlotState::Free;
            st.free.push(slot);
        } else {
            s.state = SlotState::Dead;
        }
        true
    }

    /// Makes every completed write durable (`fdatasync` on each segment).
    pub fn sync(&self) -> io::Result<()> {
        for files in &self.segments {
            for f in files {
                f.sync_data()?;
            }
        }
        Ok(())
    }

    /// The directory a store rooted at `root` uses for blocks of `layout`.
    pub fn slot_dir(root: &Path, layout: &KvLayout) -> PathBuf {
        root.join("kvtier-g3").join(format!(
            "l{}-h{}-d{}-t{}-{}",
            layout.layers,
            layout.kv_heads,
            layout.head_dim,
            layout.block_tokens,
            layout.dtype.name()
        ))
    }

    /// The layout of every block in this tier.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Full verification of one read slot: checksums, key and layout.
    fn verify(&self, bytes: &[u8], key: &BlockKey) -> Result<(), BlockError> {
        let (header, _) = decode_block(bytes, Some(key))?;
        if header.layout != self.layout {
            return Err(BlockError::BadLayout(format!(
                "block has layout {}, this tier holds {}",
                header.layout, self.layout
            )));
        }
        Ok(())
    }
}
