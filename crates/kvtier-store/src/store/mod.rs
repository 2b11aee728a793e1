//! [`TieredStore`]: G2 memory over G3 disk and G4 shared pool, with prefix
//! lookup, batched verified reads, asynchronous write-back and promotion.
//!
//! * `put_many` encodes blocks into G2 and `offer` takes blocks already
//!   encoded in place ([`BlockBuf`]). Blocks G2 evicts are **demoted** to G3
//!   by a background writer (write-back, `write_back`), never on a
//!   reader's path; they stay readable from the write-back queue
//!   (`pending`) until written. `put_many` waits (backpressure) while more
//!   than `writeback_max_bytes` are queued; `offer` never waits: blocks past
//!   the bound are dropped from the cache and counted
//!   (`kvtier_store_writeback_dropped`), so a decode loop never stalls on
//!   the disk.
//! * `lookup_prefix` counts the leading keys held in any tier, without
//!   reading them.
//! * `read_prefix` reads the leading blocks held in any tier in one pass
//!   (`tier_reads`): each key is looked up once, G3 reads and G4 GETs are in
//!   flight together, every block is verified, the walk stops at the first
//!   miss. `read_prefix_async` runs it on the store's reader threads and
//!   hands back a [`Handle`]. `get_many` reads any set of keys the same way.
//!   G3 and G4 hits are promoted into G2. `read_prefix_layered` also
//!   hands each block's layers to a [`LayerSink`] as they land, G3 read
//!   layer-major across the prefix (`layer_reads`), for an engine that
//!   computes layer by layer while the rest is read.
//! * With G4 ([`StoreConfig::remote`]), blocks put are also written through
//!   to the shared pool by a second background writer (`write_through`,
//!   subject to the admission filter), dropped and counted when its queue is
//!   full or the pool is down. A failing G4 is misses, never an error.
//! * Dropping the last handle (or [`TieredStore::close`]) writes every block
//!   not yet on disk to G3 and syncs it, so a clean stop keeps the cache.

mod g3_sync;
mod layer_reads;
mod pending;
mod shared_memory;
mod store_config;
mod store_error;
mod tier_reads;
mod warm_buffers;
mod write_back;
mod write_through;
mod writer_thread;

use std::sync::Arc;

use kvtier_io::recycle::RecyclingAllocator;
use kvtier_io::{AlignedBuf, HostAllocator, IoEngine};
use parking_lot::Mutex;

use crate::admission::SecondSighting;
use crate::block::{BlockBuf, BlockError, HEADER_BYTES, encode_block};
use crate::disk::DiskTier;
use crate::handle::Handle;
use crate::key::{BlockKey, ModelFingerprint};
use crate::kv_layout::KvLayout;
use crate::memory::{Evicted, MemoryTier, Owner};
use crate::metrics::{StoreMetrics, Tier};
use crate::remote::RemoteTier;
use crate::verify::BlockSpec;
use crate::workers::Workers;
pub use layer_reads::{LayerSink, MAX_PAUSE, MIN_PART_BYTES};
pub use shared_memory::SharedMemory;
pub use store_config::{DEFAULT_G3_SYNC, StoreConfig};
use store_config::{read_buffers_kept, read_buffers_warmed};
pub use store_error::StoreError;
pub use warm_buffers::WarmProgress;
use write_back::{LocalBlock, WriteBack};
use write_through::WriteThrough;

/// How far a prefix is cached, and where each block is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixLookup {
    /// The tier of each leading cached key; its length is the hit count.
    pub tiers: Vec<Tier>,
}

impl PrefixLookup {
    /// Leading keys found.
    pub fn hits(&self) -> usize {
        self.tiers.len()
    }

    /// Leading keys found in `tier`.
    pub fn hits_in(&self, tier: Tier) -> usize {
        self.tiers.iter().filter(|&&t| t == tier).count()
    }
}

/// A block read from the store.
#[derive(Debug, Clone)]
pub struct StoredBlock {
    /// Its key.
    pub key: BlockKey,
    /// Where it was found.
    pub tier: Tier,
    buf: Arc<AlignedBuf>,
    payload_len: usize,
    rows: u32,
}

impl StoredBlock {
    /// The block `buf` holds (encoded here, or verified on its way in),
    /// read from `tier`; an error when its header does not decode or its
    /// payload overruns the buffer.
    pub(crate) fn of(
        key: BlockKey,
        tier: Tier,
        buf: Arc<AlignedBuf>,
    ) -> Result<Self, crate::block::BlockError> {
        let header = crate::block::BlockHeader::decode(&buf)?;
        let payload_len = usize::try_from(header.payload_len).unwrap_or(usize::MAX);
        let needed = HEADER_BYTES.saturating_add(payload_len);
        if needed > buf.len() {
            return Err(crate::block::BlockError::TooShort {
                needed,
                got: buf.len(),
            });
        }
        Ok(Self {
            key,
            tier,
            buf,
            payload_len,
            rows: header.layout.block_tokens,
        })
    }

    /// Token rows it holds: the layout's `block_tokens`, or fewer for a
    /// short block (a prompt's partial last block:
    /// [`TieredStore::new_short_block`]).
    pub fn rows(&self) -> u32 {
        self.rows
    }

    /// The KV bytes as stored: with a codec, coded
    /// ([`KvLayout::decode_into`] gives the engine's bytes back).
    pub fn payload(&self) -> &[u8] {
        &self.buf[HEADER_BYTES..HEADER_BYTES + self.payload_len]
    }

    /// The whole encoded block (header, payload, padding).
    pub fn encoded(&self) -> &Arc<AlignedBuf> {
        &self.buf
    }
}

/// What a `put_many` or `offer` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutReport {
    /// Blocks stored in G2 (or queued for G3).
    pub stored: usize,
    /// Blocks already in G2, left as they were.
    pub present: usize,
}

/// Counts of what each tier holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Blocks in G2.
    pub g2_blocks: usize,
    /// Bytes in G2.
    pub g2_bytes: u64,
    /// Blocks in G3.
    pub g3_blocks: usize,
    /// Slots in G3.
    pub g3_slots: usize,
    /// Blocks waiting for write-back.
    pub writeback_pending: usize,
}

/// Threads that run [`TieredStore::read_prefix_async`] and loads.
const READ_WORKERS: usize = 2;
/// Threads that run saves ([`TieredStore::save`]).
const SAVE_WORKERS: usize = 2;

struct Inner {
    /// This store's id in a shared G2 (0 when G2 is its own).
    owner: Owner,
    shared_memory: Option<SharedMemory>,
    layout: KvLayout,
    fingerprint: ModelFingerprint,
    memory: Arc<MemoryTier>,
    write_back: Option<WriteBack>,
    write_through: Option<WriteThrough>,
    admission: Option<Mutex<SecondSighting>>,
    persist_on_close: bool,
    metrics: Arc<StoreMetrics>,
    alloc: Arc<dyn HostAllocator>,
    /// The read-buffer warming thread's progress, when asked for.
    warming: Option<Arc<warm_buffers::Warming>>,
    readers: Workers,
    savers: Workers,
}

/// The tiered KV block store. Cheap to clone (shared handle); thread-safe.
#[derive(Clone)]
pub struct TieredStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TieredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredStore")
            .field("layout", &self.inner.layout)
            .field("stats", &self.stats())
            .finish()
    }
}

impl TieredStore {
    /// Opens a store with the shared I/O engine and a recycling allocator,
    /// so reads from G3 land in memory that is already faulted in: freed
    /// block buffers are kept for reuse up to the G2 budget (at least 256
    /// MiB) plus the reads the reader threads have in flight, at most 4,096
    /// buffers. Fresh memory faults in slower than the disk reads on some
    /// VMs (docs/decisions.md), and a G2 that was emptied and refills (a
    /// restart, `evict_memory`) would otherwise fault in every block that
    /// G2 is short of; the G2 budget is memory the store may use anyway.
    pub fn open(config: StoreConfig) -> Result<Self, StoreError> {
        let alloc = Self::recycling_allocator(&config);
        Self::open_with(config, IoEngine::shared().clone(), alloc)
    }

    /// The recycling allocator [`open`](Self::open) gives a store of
    /// `config`. Stores that share one G2 ([`StoreConfig::shared_memory`])
    /// may share one allocator too (through [`open_shared`](Self::open_shared)):
    /// the read buffers one of them warms then serve the reads of all, so
    /// a restore spread over several namespaces (a model's KV heads, say)
    /// reads into resident memory in each.
    pub fn recycling_allocator(config: &StoreConfig) -> Arc<dyn HostAllocator> {
        Arc::new(RecyclingAllocator::new(read_buffers_kept(config)))
    }

    /// [`open`](Self::open) with the shared I/O engine and `alloc` (from
    /// [`recycling_allocator`](Self::recycling_allocator)) instead of an
    /// allocator of its own.
    pub fn open_shared(
        config: StoreConfig,
        alloc: Arc<dyn HostAllocator>,
    ) -> Result<Self, StoreError> {
        Self::open_with(config, IoEngine::shared().clone(), alloc)
    }

    /// Opens a store with an explicit I/O engine and allocation hook (the
    /// hook is where pinned host memory plugs in).
    pub fn open_with(
        config: StoreConfig,
        engine: IoEngine,
        alloc: Arc<dyn HostAllocator>,
    ) -> Result<Self, StoreError> {
        config.layout.validate().map_err(BlockError::from)?;
        let spec = BlockSpec {
            layout: config.layout,
            fingerprint: Some(config.fingerprint),
        };
        let (metrics, memory, owner) = match &config.shared_memory {
            Some(shared) => (
                Arc::new(StoreMetrics::with_g2(shared.metrics())),
                shared.tier(),
                shared.next_owner(),
            ),
            None => {
                let metrics = Arc::new(StoreMetrics::new());
                let memory = Arc::new(MemoryTier::new(
                    config.memory_bytes,
                    config.eviction,
                    metrics.g2.clone(),
                ));
                (metrics, memory, 0)
            }
        };
        let warm = config
            .warm_read_buffers
            .then(|| read_buffers_warmed(&config));
        let write_back = match config.disk {
            Some(mut dc) => {
                dc.layout = spec.layout;
                dc.fingerprint = spec.fingerprint;
                dc.eviction = config.eviction;
                let disk = Arc::new(DiskTier::open(
                    dc,
                    engine.clone(),
                    alloc.clone(),
                    metrics.g3.clone(),
                )?);
                metrics.set_io_mode(Tier::G3, engine.backend().name(), disk.direct());
                Some(WriteBack::open(
                    disk,
                    memory.clone(),
                    owner,
                    config.writeback_max_bytes,
                    config.g3_sync,
                    metrics.clone(),
                )?)
            }
            None => None,
        };
        // G3 and G4 reads land in buffers of one size (a block's encoded
        // bytes, G3's slot), kept by G2 after the read.
        let warming = warm
            .filter(|_| write_back.is_some() || config.remote.is_some())
            .map(|count| {
                let slot = usize::try_from(spec.layout.encoded_bytes()).unwrap_or(usize::MAX);
                warm_buffers::warm_in_background(alloc.clone(), slot, count)
            });
        let admission = config
            .admit_on_second_sighting
            .then(|| Mutex::new(SecondSighting::new(config.admission_window)));
        let write_through = match &config.remote {
            Some(rc) => Some(WriteThrough::open(rc, spec, alloc.clone(), &metrics)?),
            None => None,
        };
        let readers = Workers::spawn("kvtier-read", READ_WORKERS)
            .map_err(|e| StoreError::Task(format!("cannot start the reader threads: {e}")))?;
        let savers = Workers::spawn("kvtier-save", SAVE_WORKERS)
            .map_err(|e| StoreError::Task(format!("cannot start the saver threads: {e}")))?;
        let inner = Arc::new(Inner {
            owner,
            shared_memory: config.shared_memory.clone(),
            layout: config.layout,
            fingerprint: config.fingerprint,
            memory,
            write_back,
            write_through,
            admission,
            persist_on_close: config.persist_on_close,
            metrics,
            alloc,
            warming,
            readers,
            savers,
        });
        if let Some(shared) = &config.shared_memory {
            shared.register(owner, &inner);
        }
        Ok(Self { inner })
    }

    /// The block layout.
    pub fn layout(&self) -> KvLayout {
        self.inner.layout
    }

    /// The model fingerprint.
    pub fn fingerprint(&self) -> ModelFingerprint {
        self.inner.fingerprint
    }

    /// The metrics (render with [`StoreMetrics::render`]).
    pub fn metrics(&self) -> &Arc<StoreMetrics> {
        &self.inner.metrics
    }

    /// How far the warming of read buffers got
    /// ([`StoreConfig::warm_read_buffers`]); `None` when none was asked for
    /// (or the store has neither G3 nor G4 to read from).
    pub fn read_buffers_warm(&self) -> Option<WarmProgress> {
        self.inner.warming.as_ref().map(|w| w.progress())
    }

    /// Waits until the warming of read buffers has ended, at most `limit`
    /// (`None`: no limit); its progress then, `None` as for
    /// [`read_buffers_warm`](Self::read_buffers_warm). An engine that takes
    /// requests as soon as it starts waits here first, or its first restores
    /// fault fresh memory in beside the warming thread.
    pub fn wait_read_buffers_warm(
        &self,
        limit: Option<std::time::Duration>,
    ) -> Option<WarmProgress> {
        self.inner.warming.as_ref().map(|w| w.wait(limit))
    }

    /// Block buffers the store's allocator has served with fresh memory
    /// from the system (faulted in on first use, the warmed ones included),
    /// if it counts them (the recycling allocator of [`open`](Self::open)
    /// does).
    pub fn fresh_buffers(&self) -> Option<u64> {
        self.inner.alloc.fresh_allocations()
    }

    /// The G3 tier, if configured.
    pub fn disk(&self) -> Option<&DiskTier> {
        self.inner.write_back.as_ref().map(|w| &*w.disk)
    }

    /// The G2 tier.
    pub fn memory(&self) -> &MemoryTier {
        &self.inner.memory
    }

    /// The G4 tier, if configured.
    pub fn remote(&self) -> Option<&RemoteTier> {
        self.inner.write_through.as_ref().map(|r| &*r.tier)
    }

    /// What each tier holds now.
    pub fn stats(&self) -> StoreStats {
        let inner = &self.inner;
        let disk = self.disk();
        StoreStats {
            g2_blocks: inner.memory.len(),
            g2_bytes: inner.memory.used_bytes(),
            g3_blocks: disk.map_or(0, DiskTier::len),
            g3_slots: disk.map_or(0, DiskTier::capacity_slots),
            writeback_pending: inner.write_back.as_ref().map_or(0, |w| w.pending.len()),
        }
    }

    /// The local tier holding each key (G2 includes the write-back queue),
    /// each tier's lock taken once.
    fn local_tiers(&self, keys: &[BlockKey]) -> Vec<Option<Tier>> {
        let inner = &self.inner;
        let in_g2 = inner.memory.contains_many(keys);
        let queued = match &inner.write_back {
            Some(w) => w.pending.get_many(keys),
            None => vec![None; keys.len()],
        };
        let in_g3 = self
            .disk()
            .map_or_else(|| vec![false; keys.len()], |d| d.contains_many(keys));
        (0..keys.len())
            .map(|i| {
                if in_g2[i] || queued[i].is_some() {
                    Some(Tier::G2)
                } else if in_g3[i] {
                    Some(Tier::G3)
                } else {
                    None
                }
            })
            .collect()
    }

    /// True for each of `keys` that G2, the write-back queue or G3 holds.
    pub(crate) fn holds_locally(&self, keys: &[BlockKey]) -> Vec<bool> {
        self.local_tiers(keys).iter().map(Option::is_some).collect()
    }

    /// The threads that run background reads and loads.
    pub(crate) fn readers(&self) -> &Workers {
        &self.inner.readers
    }

    /// The threads that run saves.
    pub(crate) fn savers(&self) -> &Workers {
        &self.inner.savers
    }

    /// How many leading `keys` are cached, and in which tier each is,
    /// without reading them (no side effects). The keys past the local
    /// prefix are looked up in G4 in one batch.
    pub fn lookup_prefix(&self, keys: &[BlockKey]) -> PrefixLookup {
        let local = self.local_tiers(keys);
        let mut tiers: Vec<Tier> = local.iter().map_while(|t| *t).collect();
        if let Some(remote) = self.remote()
            && tiers.len() < keys.len()
        {
            let rest = tiers.len();
            let in_g4 = remote.contains_many(&keys[rest..]);
            for (tier, found) in local[rest..].iter().zip(in_g4) {
                match tier {
                    Some(t) => tiers.push(*t),
                    None if found => tiers.push(Tier::G4),
                    None => break,
                }
            }
        }
        PrefixLookup { tiers }
    }

    /// Stores `(key, payload)` blocks in G2; blocks G2 evicts are written
    /// back to G3 in the background. Waits only when the write-back queue is
    /// over its byte limit. A payload of the wrong length is an error and
    /// stores nothing from the call.
    pub fn put_many(&self, blocks: &[(BlockKey, &[u8])]) -> Result<PutReport, StoreError> {
        let inner = &self.inner;
        let mut encoded = Vec::with_capacity(blocks.len());
        let mut parents = Vec::with_capacity(blocks.len());
        let mut present = 0;
        for (i, (key, payload)) in blocks.iter().enumerate() {
            if inner.memory.contains(key) {
                present += 1;
                continue;
            }
            let buf = encode_block(
                *key,
                inner.fingerprint,
                inner.layout,
                0,
                payload,
                &inner.alloc,
            )?;
            encoded.push((*key, Arc::new(buf)));
            parents.push(i.checked_sub(1).map(|p| blocks[p].0));
        }
        self.record_sightings(blocks.iter().map(|(k, _)| k));
        let mut report = self.insert(encoded, &parents, true);
        report.present += present;
        Ok(report)
    }

    /// A buffer for one block of this store's layout, to be filled in place
    /// and handed to [`offer`](Self::offer).
    pub fn new_block(&self) -> Result<BlockBuf, StoreError> {
        Ok(self.block_buf()?)
    }

    /// [`new_block`](Self::new_block), its error the block's own.
    pub(crate) fn block_buf(&self) -> Result<BlockBuf, BlockError> {
        BlockBuf::new(self.inner.layout, &self.inner.alloc)
    }

    /// [`new_block`](Self::new_block) for a short block of `rows` token
    /// rows (1 up to the layout's `block_tokens`): the partial block at the
    /// end of a prompt, stored with only the rows it holds, so restoring it
    /// reads and checks those rows, not a whole block's. Read it back by
    /// naming its rows ([`read_prefix_layered`](Self::read_prefix_layered)'s
    /// `tail_rows`); every other read takes it for a corrupt block.
    pub fn new_short_block(&self, rows: u32) -> Result<BlockBuf, StoreError> {
        Ok(BlockBuf::new_short(
            self.inner.layout,
            rows,
            &self.inner.alloc,
        )?)
    }

    /// Stores blocks filled in place (sealed here with this store's model)
    /// like [`put_many`](Self::put_many), but never waits: when the
    /// write-back queue is over its bound, the blocks G2 evicts past it are
    /// dropped from the cache and counted instead. For callers on a
    /// latency-critical thread (an engine's decode loop).
    pub fn offer(&self, blocks: Vec<(BlockKey, BlockBuf)>) -> PutReport {
        let parents = std::iter::once(None)
            .chain(blocks.iter().map(|(k, _)| Some(*k)))
            .collect();
        self.store_filled(blocks, parents, false)
    }

    /// Seals and stores blocks filled in place, each under its parent (the
    /// block before it in the caller's chain, when known); `wait` for room
    /// in the write-back queue, or drop past its bound
    /// ([`offer`](Self::offer)).
    pub(crate) fn store_filled(
        &self,
        blocks: Vec<(BlockKey, BlockBuf)>,
        parents: Vec<Option<BlockKey>>,
        wait: bool,
    ) -> PutReport {
        let inner = &self.inner;
        self.record_sightings(blocks.iter().map(|(k, _)| k));
        let mut present = 0;
        let mut encoded = Vec::with_capacity(blocks.len());
        let mut kept_parents = Vec::with_capacity(blocks.len());
        for ((key, block), parent) in blocks
            .into_iter()
            .zip(parents.into_iter().chain(std::iter::repeat(None)))
        {
            if inner.memory.contains(&key) {
                present += 1;
                continue;
            }
            encoded.push((key, Arc::new(block.seal(key, inner.fingerprint, 0))));
            kept_parents.push(parent);
        }
        let mut report = self.insert(encoded, &kept_parents, wait);
        report.present += present;
        report
    }

    /// Writes encoded blocks through to G4, inserts them into G2 (each
    /// under its parent, the block before it in the caller's chain) and
    /// demotes what G2 evicts; `wait` for room in the write-back queue
    /// first, or drop past its bound.
    fn insert(
        &self,
        encoded: Vec<LocalBlock>,
        parents: &[Option<BlockKey>],
        wait: bool,
    ) -> PutReport {
        let inner = &self.inner;
        self.write_through(&encoded);
        if wait && let Some(w) = &inner.write_back {
            w.pending.wait_for_room();
        }
        let persisted = match self.disk() {
            Some(d) => d.contains_many(&encoded.iter().map(|(k, _)| *k).collect::<Vec<_>>()),
            None => vec![false; encoded.len()],
        };
        let stored = encoded.len();
        let mut evicted = Vec::new();
        for (((key, buf), persisted), parent) in encoded.into_iter().zip(persisted).zip(parents) {
            // A block G3 already holds needs no write-back when evicted.
            evicted.extend(
                inner
                    .memory
                    .insert(inner.owner, key, buf, persisted, parent.as_ref()),
            );
        }
        self.demote(evicted, !wait);
        PutReport { stored, present: 0 }
    }

    /// Queues newly stored blocks for G4 (subject to the admission filter).
    fn write_through(&self, blocks: &[LocalBlock]) {
        let inner = &self.inner;
        let Some(w) = &inner.write_through else {
            return;
        };
        let full_len = HEADER_BYTES + inner.layout.stored_payload_bytes() as usize;
        // A short block (a prompt's tail) is sent with only its rows.
        let sent_len = |b: &AlignedBuf| {
            crate::block::BlockHeader::decode(b)
                .ok()
                .and_then(|h| usize::try_from(h.payload_len).ok())
                .map_or(full_len, |n| (HEADER_BYTES + n).min(full_len))
        };
        let batch = blocks
            .iter()
            .filter(|(k, _)| self.admits(k))
            .map(|(k, b)| (*k, b.clone(), sent_len(b)))
            .collect();
        w.queue(batch, &inner.metrics);
    }

    fn admits(&self, key: &BlockKey) -> bool {
        self.inner
            .admission
            .as_ref()
            .is_none_or(|a| a.lock().admits(key))
    }

    fn record_sightings<'a>(&self, keys: impl Iterator<Item = &'a BlockKey>) {
        if let Some(adm) = &self.inner.admission {
            let mut adm = adm.lock();
            for k in keys {
                adm.record(k);
            }
        }
    }

    /// Queues evicted blocks that G3 lacks for write-back (subject to the
    /// admission filter); with `drop_over`, never past the queue's bound.
    /// Without G3 they are simply dropped: G2 is a cache.
    /// Blocks of other stores sharing this G2 go to their own stores.
    fn demote(&self, evicted: Vec<Evicted>, drop_over: bool) {
        let inner = &self.inner;
        let (evicted, others): (Vec<Evicted>, Vec<Evicted>) =
            evicted.into_iter().partition(|e| e.owner == inner.owner);
        if let Some(shared) = &inner.shared_memory
            && !others.is_empty()
        {
            shared.demote_others(others, drop_over);
        }
        let Some(w) = &inner.write_back else {
            return;
        };
        let mut batch = Vec::new();
        for e in evicted {
            if e.persisted {
                continue;
            }
            if !self.admits(&e.key) {
                inner.metrics.admission_rejected.inc();
                continue;
            }
            batch.push((e.key, e.buf));
        }
        if !batch.is_empty() {
            w.demote(batch, drop_over, &inner.metrics);
        }
    }

    /// Writes every block not yet in G3 (evicted or still in G2) and syncs
    /// G3, and waits until every block queued for G4 was written (or
    /// dropped, if G4 is failing). Returns once G3 is durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        let inner = &self.inner;
        if let Some(w) = &inner.write_through {
            w.flush();
        }
        match &inner.write_back {
            Some(w) => w.flush(inner.memory.dirty(inner.owner)),
            None => Ok(()),
        }
    }

    /// Empties G2 of this store's blocks (demoting every block G3 lacks)
    /// and flushes, so the next reads come from G3. Used to measure restores from disk.
    pub fn evict_memory(&self) -> Result<(), StoreError> {
        let drained = self.inner.memory.drain_owner(self.inner.owner);
        self.demote(drained, false);
        self.flush()
    }

    /// Flushes (when configured to persist on close) and stops the writers.
    /// Dropping the last handle does the same.
    pub fn close(self) -> Result<(), StoreError> {
        let r = if self.inner.persist_on_close {
            self.flush()
        } else {
            Ok(())
        };
        self.inner.stop_writers();
        r
    }

    /// [`get_many`](Self::get_many) on tokio's blocking pool.
    pub async fn get_many_async(
        &self,
        keys: Vec<BlockKey>,
    ) -> Result<Vec<Option<StoredBlock>>, StoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.get_many(&keys))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))
    }

    /// [`put_many`](Self::put_many) on tokio's blocking pool.
    pub async fn put_many_async(
        &self,
        blocks: Vec<(BlockKey, Vec<u8>)>,
    ) -> Result<PutReport, StoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || {
            let refs: Vec<(BlockKey, &[u8])> =
                blocks.iter().map(|(k, p)| (*k, p.as_slice())).collect();
            store.put_many(&refs)
        })
        .await
        .map_err(|e| StoreError::Task(e.to_string()))?
    }

    /// [`read_prefix`](Self::read_prefix) on the store's reader threads:
    /// returns at once; `notify` runs when the handle is done (from a
    /// reader thread: keep it short, e.g. wake an event loop). With
    /// `tail_rows`, the last key is a short block of that many token rows
    /// ([`new_short_block`](Self::new_short_block)); every other block is
    /// whole.
    pub fn read_prefix_async(
        &self,
        keys: Vec<BlockKey>,
        tail_rows: Option<u32>,
        notify: impl FnOnce() + Send + 'static,
    ) -> Handle<Vec<StoredBlock>> {
        self.read_prefix_on_readers(keys, tail_rows, None, notify)
    }

    /// The leading run of `keys` (the last of them a short block of
    /// `tail_rows` when given) read on the store's reader threads, handing
    /// each block's layers to `sink` when given (`layer_reads`).
    pub(super) fn read_prefix_on_readers(
        &self,
        keys: Vec<BlockKey>,
        tail_rows: Option<u32>,
        sink: Option<Arc<dyn LayerSink>>,
        notify: impl FnOnce() + Send + 'static,
    ) -> Handle<Vec<StoredBlock>> {
        let (handle, completer) = crate::handle::pair(Box::new(notify));
        let store = self.clone();
        let job = Box::new(move || {
            if !completer.is_cancelled() {
                let blocks = store
                    .fetch_to(&keys, true, sink.as_deref(), tail_rows)
                    .into_iter()
                    .map_while(crate::outcome::BlockRead::hit)
                    .collect();
                // Let go of the store before the caller is told: one that
                // then closes its store (and reopens the directory) must
                // find it closed, not held a moment longer by this job.
                drop(store);
                completer.complete(blocks);
            }
        });
        if let Err(job) = self.inner.readers.submit(job) {
            // No reader thread: run it here rather than lose it.
            job();
        }
        handle
    }
}

impl Inner {
    fn stop_writers(&self) {
        if let Some(w) = &self.write_through {
            w.stop();
        }
        if let Some(w) = &self.write_back {
            w.stop();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(w) = &self.write_through {
            w.stop();
        }
        if let Some(w) = &self.write_back
            && !w.is_stopped()
        {
            let dirty = if self.persist_on_close {
                self.memory.dirty(self.owner)
            } else {
                Vec::new()
            };
            if let Err(e) = w.flush(dirty) {
                tracing::warn!("G3 write-back at close failed: {e}");
            }
            w.stop();
        }
        if let Some(shared) = &self.shared_memory {
            // Its blocks are written back: out of the shared budget.
            shared.unregister(self.owner);
            self.memory.drain_owner(self.owner);
        }
    }
}
