//! Loads and saves between the store and memory the caller owns: the
//! interface for engines that keep their own KV pages (vLLM's CPU or GPU
//! block tensors, a PyTorch buffer).
//!
//! * The caller names each block's memory as [`BlockRegions`]: pieces of
//!   its own memory, each mapped to a byte range of the block's payload
//!   ([`KvLayout::layer_range`], [`KvLayout::part_range`] give the ranges
//!   of an arrangement), together covering the payload exactly. A vLLM CPU
//!   page is one piece per layer (`layer-fused`), found in that layer's
//!   `[num_blocks, ...]` tensor at the block's index.
//! * [`TieredStore::load`] and [`TieredStore::save`] return a [`Transfer`]
//!   at once: the work runs on the store's threads, the caller's thread
//!   never blocks unless it waits. A transfer reports one [`BlockResult`]
//!   per block: hit (and from which tier), miss, corrupt (the block failed
//!   verification and was deleted; never copied), error (a read failed, G4
//!   did not answer) and, for saves, stored or present. Errors are never
//!   reported as misses.
//! * **Cancel** ([`Transfer::cancel`]): blocks not yet copied are left
//!   alone and report [`BlockResult::Cancelled`]; every block that reports
//!   anything else was copied whole (or, for a miss, not touched; a
//!   layer-wise load may have written a block that then failed its check).
//!   Dropping a transfer cancels it and waits for the block being copied,
//!   so the caller's memory is never written after the handle is gone.
//! * **Layer by layer** ([`TieredStore::load_layers`], `layers.rs`): each
//!   block's layers are decoded into the caller's memory as they land, and
//!   [`Transfer::wait_layer`] returns once one layer of every block is in
//!   (or will not come), so an engine can run that layer's attention while
//!   the later layers are still being read.
//!
//! # Copies
//!
//! One copy per block each way, between the caller's memory and the
//! store's block buffer (with a codec, the copy is the coding: a load
//! decodes straight into the caller's memory, a save codes straight from
//! it, `codec.rs`), which is also the block's G2 copy (hits from G3
//! or G4 are promoted into G2) and the buffer G3's direct I/O reads into
//! and writes from. Direct I/O cannot land in the caller's memory itself:
//! a slot's payload starts 128 bytes in (after the header), off the device
//! block alignment `O_DIRECT` demands, and the header and checksums must be
//! checked before a byte reaches the caller. So this is the one bounce
//! direct I/O demands, and it is the only copy.
//!
//! Work is cut into chunks of about [`CHUNK_BYTES`] (4 to 64 blocks,
//! [`chunk_blocks`]), run by the store's reader (loads) or saver (saves)
//! threads, so one chunk's copies overlap the next one's reads and each
//! chunk has enough reads in flight to keep the device busy.

mod layers;

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::codec::CodecError;
use crate::key::BlockKey;
use crate::kv_layout::KvLayout;
use crate::layer_progress::LayerProgress;
use crate::metrics::Tier;
use crate::outcome::{BlockFailure, BlockRead, Refused};
use crate::store::{StoreError, TieredStore};

/// Bytes of blocks per unit of work on a store thread.
pub const CHUNK_BYTES: u64 = 64 << 20;

/// Blocks per unit of work for blocks of `layout`: [`CHUNK_BYTES`] of
/// slots, at least 4 and at most 64.
pub fn chunk_blocks(layout: &KvLayout) -> usize {
    (CHUNK_BYTES / layout.encoded_bytes().max(1)).clamp(4, 64) as usize
}

/// What a load or a save did with one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockResult {
    /// Loaded: found in this tier, verified, copied into the caller's
    /// memory.
    Hit(Tier),
    /// Loaded: no tier holds it; the caller's memory was not touched.
    Miss,
    /// Loaded: a tier held it but it failed verification (so it was
    /// deleted there and not copied, though a layer-wise load may have
    /// written layers of it as they landed); which tier, and why.
    Corrupt(Refused),
    /// The read or the save failed (an I/O error, G4 unreachable, no
    /// memory for the block, a value a codec cannot code); why. The
    /// caller's memory was not touched.
    Error(BlockFailure),
    /// Saved: stored in G2 and queued for G3 (and G4).
    Stored,
    /// Saved: the store already held it; nothing copied.
    Present,
    /// Cancelled before it was copied; the caller's memory was not
    /// touched.
    Cancelled,
}

impl BlockResult {
    /// The lower-case name the Python API and logs use: `hit`, `miss`,
    /// `corrupt`, `error`, `stored`, `present`, `cancelled`.
    pub fn name(&self) -> &'static str {
        match self {
            BlockResult::Hit(_) => "hit",
            BlockResult::Miss => "miss",
            BlockResult::Corrupt(_) => "corrupt",
            BlockResult::Error(_) => "error",
            BlockResult::Stored => "stored",
            BlockResult::Present => "present",
            BlockResult::Cancelled => "cancelled",
        }
    }
}

/// One piece of caller memory and the payload bytes it holds.
#[derive(Debug, Clone, Copy)]
struct Region {
    /// Where in the payload the piece starts.
    offset: usize,
    ptr: *mut u8,
    len: usize,
}

/// The caller's memory for one block's payload: pieces that together
/// cover every payload byte exactly once.
#[derive(Debug)]
pub struct BlockRegions {
    regions: Vec<Region>,
}

// SAFETY: the memory is the caller's, which promised (in `from_raw`) that
// it stays valid and unused by others until the transfer finishes; the
// pointers are only dereferenced by the store threads running the block's
// chunk, never two of them on the same bytes.
unsafe impl Send for BlockRegions {}

impl BlockRegions {
    /// Pieces `(payload offset, pointer, length)` of one block's payload,
    /// checked to cover `layout`'s payload exactly once (in any order).
    /// With a codec ([`KvLayout::codec`]) each piece must also start and
    /// end on a `head_dim`-element boundary, where the stored form can be
    /// decoded from and coded into.
    ///
    /// # Safety
    ///
    /// Each pointer must be valid for `length` bytes of reads (a save) or
    /// writes (a load) until the [`Transfer`] it is given to has finished
    /// ([`Transfer::is_done`], [`Transfer::wait`], or its drop), and nothing
    /// else may write those bytes (or, for a load, read them) meanwhile.
    pub unsafe fn from_raw(
        layout: &KvLayout,
        pieces: &[(u64, *mut u8, usize)],
    ) -> Result<Self, StoreError> {
        let payload = layout.payload_bytes();
        let mut regions: Vec<Region> = Vec::with_capacity(pieces.len());
        for &(offset, ptr, len) in pieces {
            let end = offset.checked_add(len as u64);
            if ptr.is_null() || end.is_none_or(|e| e > payload) {
                return Err(StoreError::Regions(format!(
                    "piece at payload offset {offset} of {len} bytes is null or ends past the {payload}-byte payload"
                )));
            }
            if end.and_then(|e| layout.stored_range(offset..e)).is_none() {
                return Err(StoreError::Regions(format!(
                    "piece at payload offset {offset} of {len} bytes does not start and end on a \
                     {}-element boundary, which the {} codec needs",
                    layout.head_dim, layout.codec
                )));
            }
            regions.push(Region {
                offset: offset as usize,
                ptr,
                len,
            });
        }
        regions.sort_by_key(|r| r.offset);
        let mut at = 0usize;
        for r in &regions {
            if r.offset != at {
                return Err(StoreError::Regions(format!(
                    "pieces must cover the {payload}-byte payload exactly: {} at byte {at}",
                    if r.offset > at { "a gap" } else { "an overlap" }
                )));
            }
            at += r.len;
        }
        if at as u64 != payload {
            return Err(StoreError::Regions(format!(
                "pieces cover {at} of the {payload}-byte payload"
            )));
        }
        Ok(Self { regions })
    }

    /// Decodes `stored` (a verified block's stored payload, of `layout`)
    /// into the caller's memory: a plain copy without a codec.
    fn fill_from(&self, layout: &KvLayout, stored: &[u8]) -> Result<(), CodecError> {
        self.fill_layers(layout, 0..layout.layers, stored)
    }

    /// Decodes `stored`, the stored bytes of layers `layers` of a block of
    /// `layout` (all of them, or a run of layers of a layout that keeps a
    /// layer contiguous), into the caller's memory for those layers.
    fn fill_layers(
        &self,
        layout: &KvLayout,
        layers: Range<u32>,
        stored: &[u8],
    ) -> Result<(), CodecError> {
        let shape = |why: String| CodecError::Shape(why);
        let logical = layer_span(layout, layers.clone())
            .ok_or_else(|| shape(format!("layers {layers:?} of {layout} are not contiguous")))?;
        let base = layout
            .stored_range(logical.clone())
            .ok_or_else(|| shape(format!("layers {layers:?} of {layout} are off its groups")))?
            .start;
        for r in &self.regions {
            let (start, end) = (r.offset as u64, (r.offset + r.len) as u64);
            let (a, b) = (start.max(logical.start), end.min(logical.end));
            if a >= b {
                continue;
            }
            let src = layout
                .stored_range(a..b)
                .and_then(|s| stored.get((s.start - base) as usize..(s.end - base) as usize))
                .ok_or_else(|| {
                    shape(format!(
                        "{} stored bytes do not hold layers {layers:?} of {layout}",
                        stored.len()
                    ))
                })?;
            // SAFETY: `from_raw`'s contract: the caller's memory is valid
            // for writes and ours alone until the transfer finishes; `a..b`
            // lies within this piece.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(r.ptr.add((a - start) as usize), (b - a) as usize)
            };
            crate::codec::decode(
                layout.codec,
                layout.dtype,
                layout.head_dim as usize,
                src,
                dst,
            )?;
        }
        Ok(())
    }

    /// Codes the caller's memory into `stored` (a block's stored payload,
    /// of `layout`): a plain copy without a codec.
    fn copy_to(&self, layout: &KvLayout, stored: &mut [u8]) -> Result<(), CodecError> {
        for r in &self.regions {
            // SAFETY: as in `fill_from`, for reads.
            let src = unsafe { std::slice::from_raw_parts(r.ptr.cast_const(), r.len) };
            layout.encode_into(r.offset as u64, src, stored)?;
        }
        Ok(())
    }
}

/// Where the payload bytes of layers `layers` of a block of `layout` lie:
/// the whole payload for all layers, else (a layout that keeps a layer
/// contiguous) from the first's start to the last's end.
fn layer_span(layout: &KvLayout, layers: Range<u32>) -> Option<Range<u64>> {
    if layers == (0..layout.layers) {
        return Some(0..layout.payload_bytes());
    }
    let first = layout.layer_range(layers.start)?;
    let last = layout.layer_range(layers.end.checked_sub(1)?)?;
    (first.start < last.end).then_some(first.start..last.end)
}

/// What a transfer's chunks do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    Load,
    /// A load handing each layer over as it lands (`layers.rs`).
    LoadLayers,
    Save,
}

struct State {
    results: Vec<Option<BlockResult>>,
    /// Chunks not finished yet.
    chunks_left: usize,
    notify: Option<Box<dyn FnOnce() + Send>>,
    /// For a layer-wise load: which layers of which blocks are in.
    layers: Option<LayerProgress>,
}

struct Shared {
    state: Mutex<State>,
    finished: Condvar,
    cancelled: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records a chunk's results; the last chunk wakes the waiters and runs
    /// the callback.
    fn chunk_done(&self, first: usize, results: Vec<BlockResult>) {
        let notify = {
            let mut st = self.state.lock();
            let blocks = first..first + results.len();
            for (slot, r) in st.results[first..].iter_mut().zip(results) {
                *slot = Some(r);
            }
            if let Some(p) = &mut st.layers {
                // Nothing more lands for these blocks.
                p.settle(blocks);
            }
            st.chunks_left -= 1;
            if st.chunks_left > 0 {
                return;
            }
            st.notify.take()
        };
        self.finished.notify_all();
        if let Some(n) = notify {
            n();
        }
    }
}

/// A load or save running on the store's threads (see the module docs).
pub struct Transfer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("blocks", &self.len())
            .field("done", &self.is_done())
            .finish()
    }
}

impl Transfer {
    fn start(
        blocks: usize,
        chunks: usize,
        layers: Option<u32>,
        notify: Option<Box<dyn FnOnce() + Send>>,
    ) -> Self {
        let t = Transfer {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    results: vec![None; blocks],
                    chunks_left: chunks,
                    notify,
                    layers: layers.map(|n| LayerProgress::new(blocks, n)),
                }),
                finished: Condvar::new(),
                cancelled: Default::default(),
            }),
        };
        if chunks == 0 {
            // Nothing to do: done at once.
            let notify = t.shared.state.lock().notify.take();
            if let Some(n) = notify {
                n();
            }
        }
        t
    }

    /// Blocks in the transfer.
    pub fn len(&self) -> usize {
        self.shared.state.lock().results.len()
    }

    /// True for a transfer of no blocks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True once every block has its result ([`wait`](Self::wait) will not
    /// block).
    pub fn is_done(&self) -> bool {
        self.shared.state.lock().chunks_left == 0
    }

    /// Blocks that have their result so far.
    pub fn finished_blocks(&self) -> usize {
        let st = self.shared.state.lock();
        st.results.iter().filter(|r| r.is_some()).count()
    }

    /// Waits until every block has its result and returns them, in the
    /// order of the keys. Can be called again.
    pub fn wait(&self) -> Vec<BlockResult> {
        let mut st = self.shared.state.lock();
        while st.chunks_left > 0 {
            self.shared.finished.wait(&mut st);
        }
        Self::collect(&st)
    }

    /// [`wait`](Self::wait) for at most `limit`; `None` if not done by then.
    pub fn wait_timeout(&self, limit: Duration) -> Option<Vec<BlockResult>> {
        let deadline = Instant::now() + limit;
        let mut st = self.shared.state.lock();
        while st.chunks_left > 0 {
            if self
                .shared
                .finished
                .wait_until(&mut st, deadline)
                .timed_out()
            {
                return (st.chunks_left == 0).then(|| Self::collect(&st));
            }
        }
        Some(Self::collect(&st))
    }

    /// Waits until layer `layer` of every block is in the caller's memory
    /// or will not come (the block's result is then not a hit), at most
    /// `limit` (`None`: no limit); true once so, false on timeout. For a
    /// load that is not layer-wise ([`TieredStore::load_layers`]), and for
    /// a layer past the last, that is once the whole transfer is done.
    pub fn wait_layer(&self, layer: u32, limit: Option<Duration>) -> bool {
        let ready =
            |st: &State| st.chunks_left == 0 || st.layers.as_ref().is_some_and(|p| p.ready(layer));
        let deadline = limit.map(|l| Instant::now() + l);
        let mut st = self.shared.state.lock();
        while !ready(&st) {
            match deadline {
                Some(d) => {
                    if self.shared.finished.wait_until(&mut st, d).timed_out() {
                        return ready(&st);
                    }
                }
                None => self.shared.finished.wait(&mut st),
            }
        }
        true
    }

    fn collect(st: &State) -> Vec<BlockResult> {
        st.results
            .iter()
            .map(|r| r.clone().unwrap_or(BlockResult::Cancelled))
            .collect()
    }

    /// Asks the transfer to stop: blocks not yet copied report
    /// [`BlockResult::Cancelled`] and their memory is left alone. Returns
    /// at once; [`wait`](Self::wait) tells which blocks were done.
    pub fn cancel(&self) {
        self.shared
            .cancelled
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // The caller's memory must not be written once the handle is gone.
        self.cancel();
        self.wait();
    }
}

impl TieredStore {
    /// Loads the blocks of `keys` into the caller's memory `dests` (one
    /// [`BlockRegions`] per key) on the store's reader threads; returns at
    /// once. Each block is read from the highest tier holding it, verified,
    /// copied whole, and reported ([`BlockResult`]). `notify` runs once
    /// every block has its result (from a store thread: keep it short).
    pub fn load(
        &self,
        keys: Vec<BlockKey>,
        dests: Vec<BlockRegions>,
        notify: Option<Box<dyn FnOnce() + Send>>,
    ) -> Result<Transfer, StoreError> {
        self.transfer(keys, dests, notify, Work::Load)
    }

    /// Saves the caller's memory `srcs` (one [`BlockRegions`] per key) as
    /// the blocks of `keys` on the store's saver threads; returns at once.
    /// Each block the store lacks is copied into a block buffer, sealed,
    /// kept in G2 and queued for G3 (and G4) like
    /// [`put_many`](Self::put_many), waiting on a store thread (never the
    /// caller's) when the write-back queue is full. Once the transfer is
    /// done the caller's memory may be reused.
    pub fn save(
        &self,
        keys: Vec<BlockKey>,
        srcs: Vec<BlockRegions>,
        notify: Option<Box<dyn FnOnce() + Send>>,
    ) -> Result<Transfer, StoreError> {
        self.transfer(keys, srcs, notify, Work::Save)
    }

    fn transfer(
        &self,
        keys: Vec<BlockKey>,
        mut regions: Vec<BlockRegions>,
        notify: Option<Box<dyn FnOnce() + Send>>,
        work: Work,
    ) -> Result<Transfer, StoreError> {
        if keys.len() != regions.len() {
            return Err(StoreError::Regions(format!(
                "{} keys but {} block buffers",
                keys.len(),
                regions.len()
            )));
        }
        let per = chunk_blocks(&self.layout());
        let chunks = keys.len().div_ceil(per);
        let layers = (work == Work::LoadLayers).then_some(self.layout().layers);
        let transfer = Transfer::start(keys.len(), chunks, layers, notify);
        for (c, chunk_keys) in keys.chunks(per).enumerate() {
            let first = c * per;
            let chunk_regions: Vec<BlockRegions> = regions
                .drain(..chunk_keys.len().min(regions.len()))
                .collect();
            // The block before the chunk: its first block's parent.
            let before = first.checked_sub(1).map(|i| keys[i]);
            let (store, shared, chunk_keys) =
                (self.clone(), transfer.shared.clone(), chunk_keys.to_vec());
            let job: Box<dyn FnOnce() + Send> = Box::new(move || {
                let results = if shared.is_cancelled() {
                    vec![BlockResult::Cancelled; chunk_keys.len()]
                } else {
                    match work {
                        Work::Save => {
                            store.save_chunk(before, &chunk_keys, &chunk_regions, &shared)
                        }
                        Work::Load | Work::LoadLayers => store.load_chunk(
                            first,
                            &chunk_keys,
                            &chunk_regions,
                            &shared,
                            work == Work::LoadLayers,
                        ),
                    }
                };
                // Let go of the store before the caller can be told: one
                // that then closes it (and reopens the directory) must find
                // it closed, not held a moment longer by this job.
                drop(store);
                shared.chunk_done(first, results);
            });
            let pool = if work == Work::Save {
                self.savers()
            } else {
                self.readers()
            };
            if let Err(job) = pool.submit(job) {
                // No thread to run it: run it here rather than lose it.
                job();
            }
        }
        Ok(transfer)
    }

    /// One chunk of a load: its blocks from `first` on in the transfer,
    /// `layerwise` handing each layer to the caller's memory as it lands
    /// (`layers.rs`); a hit is then decoded for the layers no hand-over
    /// brought (all of them for a plain load).
    fn load_chunk(
        &self,
        first: usize,
        keys: &[BlockKey],
        dests: &[BlockRegions],
        shared: &Shared,
        layerwise: bool,
    ) -> Vec<BlockResult> {
        let layout = self.layout();
        let sink = layerwise.then(|| layers::IntoRegions::new(layout, first, dests, shared));
        let sink = sink.as_ref().map(|s| s as &dyn crate::store::LayerSink);
        self.fetch_to(keys, false, sink, None)
            .into_iter()
            .zip(dests)
            .enumerate()
            .map(|(i, (found, dest))| {
                // Layers not written yet; `None`: all of them (a plain load).
                let missing = sink.and_then(|_| {
                    let st = shared.state.lock();
                    st.layers.as_ref().map(|p| p.missing(first + i))
                });
                let untouched = missing
                    .as_ref()
                    .is_none_or(|m| m.len() == layout.layers as usize);
                match found {
                    _ if shared.is_cancelled() && untouched => BlockResult::Cancelled,
                    BlockRead::Hit(block) => {
                        let filled = match &missing {
                            Some(m) => layers::fill_missing(&layout, dest, m, block.payload()),
                            None => dest.fill_from(&layout, block.payload()),
                        };
                        match filled {
                            Ok(()) => BlockResult::Hit(block.tier),
                            Err(e) => BlockResult::Error(BlockFailure::Block(e.into())),
                        }
                    }
                    BlockRead::Miss => BlockResult::Miss,
                    BlockRead::Corrupt(why) => BlockResult::Corrupt(why),
                    BlockRead::Failed(why) => BlockResult::Error(why),
                }
            })
            .collect()
    }

    /// Saves one chunk of a save's blocks; `before` is the block before
    /// the chunk in the caller's chain, its first block's parent.
    fn save_chunk(
        &self,
        before: Option<BlockKey>,
        keys: &[BlockKey],
        srcs: &[BlockRegions],
        shared: &Shared,
    ) -> Vec<BlockResult> {
        let held = self.holds_locally(keys);
        let layout = self.layout();
        let mut results = Vec::with_capacity(keys.len());
        let mut sealed = Vec::new();
        let mut parents = Vec::new();
        let chain = std::iter::once(before).chain(keys.iter().map(|k| Some(*k)));
        for (((key, src), held), parent) in keys.iter().zip(srcs).zip(held).zip(chain) {
            let r = if shared.is_cancelled() {
                BlockResult::Cancelled
            } else if held {
                BlockResult::Present
            } else {
                let filled = self.block_buf().and_then(|mut block| {
                    src.copy_to(&layout, block.payload_mut())?;
                    Ok(block)
                });
                match filled {
                    Ok(block) => {
                        sealed.push((*key, block));
                        parents.push(parent);
                        BlockResult::Stored
                    }
                    Err(e) => BlockResult::Error(BlockFailure::Block(e)),
                }
            };
            results.push(r);
        }
        if !sealed.is_empty() {
            self.store_filled(sealed, parents, true);
        }
        results
    }
}
