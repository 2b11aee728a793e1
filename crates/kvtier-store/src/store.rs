//! [`TieredStore`]: G2 memory over G3 disk, with prefix lookup, batched
//! reads, asynchronous write-back and promotion.
//!
//! * `put_many` encodes blocks into G2. Blocks G2 evicts are **demoted** to
//!   G3 by a background writer (write-back), never on a reader's path.
//!   Evicted blocks stay readable from the write-back queue until written.
//!   Puts wait (backpressure) when more than `writeback_max_bytes` are queued;
//!   nothing is ever dropped silently.
//! * `lookup_prefix` counts the leading keys held in any tier.
//! * `get_many` serves G2 hits from memory and reads every G3 hit at once
//!   (up to the disk tier's in-flight depth), verifying each block; G3 hits
//!   are promoted into G2.
//! * With G4 ([`StoreConfig::remote`]), blocks put are also written through
//!   to the shared pool by a second background writer (subject to the
//!   admission filter), dropped, and counted, when its queue is full or the
//!   pool is down. `lookup_prefix` consults G4 after G3, in one batch for
//!   the keys past the local prefix; `get_many` reads G4 after G3, verifies
//!   every block as G3 does and promotes hits into G2 (so they reach G3 when
//!   evicted). A failing G4 is misses, never an error.
//! * Dropping the last handle (or [`TieredStore::close`]) writes every block
//!   not yet on disk to G3 and syncs it, so a clean stop keeps the cache.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use kvtier_io::recycle::RecyclingAllocator;
use kvtier_io::{AlignedBuf, HostAllocator, IoEngine};
use parking_lot::{Condvar, Mutex};

use crate::admission::SecondSighting;
use crate::block::{BlockError, HEADER_BYTES, decode_block, encode_block};
use crate::disk::{DiskConfig, DiskError, DiskTier, PutOutcome};
use crate::key::{BlockKey, ModelFingerprint};
use crate::layout::KvLayout;
use crate::memory::{Evicted, MemoryTier};
use crate::metrics::{StoreMetrics, Tier};
use crate::remote::{BlockCheck, RemoteBlock, RemoteConfig, RemoteError, RemoteTier};

/// Configuration of a [`TieredStore`].
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Layout of every block (fixes the block and slot size).
    pub layout: KvLayout,
    /// Model the blocks belong to (written into every header).
    pub fingerprint: ModelFingerprint,
    /// G2 capacity in bytes (0: no G2; puts go straight to write-back).
    pub memory_bytes: u64,
    /// G3, if any. Its `layout` is set from this config's.
    pub disk: Option<DiskConfig>,
    /// Write a block to G3 only once it was seen twice (put or hit).
    pub admit_on_second_sighting: bool,
    /// Distinct keys the admission filter remembers.
    pub admission_window: usize,
    /// Bytes of evicted blocks that may wait for write-back before puts wait.
    pub writeback_max_bytes: u64,
    /// Write dirty G2 blocks to G3 when the store closes.
    pub persist_on_close: bool,
    /// G4, a pool shared with other nodes, if any.
    pub remote: Option<RemoteConfig>,
}

impl StoreConfig {
    /// Defaults: 1 GiB G2, no G3, admission filter off, 256 MiB write-back
    /// queue, persist on close.
    pub fn new(layout: KvLayout, fingerprint: ModelFingerprint) -> Self {
        Self {
            layout,
            fingerprint,
            memory_bytes: 1 << 30,
            disk: None,
            admit_on_second_sighting: false,
            admission_window: 1 << 20,
            writeback_max_bytes: 256 << 20,
            persist_on_close: true,
            remote: None,
        }
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The configuration cannot work.
    #[error("bad store configuration: {0}")]
    Config(String),
    /// The disk tier failed to open or write.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// A block could not be encoded (wrong payload length, allocation).
    #[error(transparent)]
    Block(#[from] BlockError),
    /// A background task failed.
    #[error("store task failed: {0}")]
    Task(String),
    /// The G4 configuration cannot work (a pool that is down is not an
    /// error: it is misses).
    #[error(transparent)]
    Remote(#[from] RemoteError),
}

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
}

impl StoredBlock {
    /// The KV bytes.
    pub fn payload(&self) -> &[u8] {
        &self.buf[HEADER_BYTES..HEADER_BYTES + self.payload_len]
    }

    /// The whole encoded block (header, payload, padding).
    pub fn encoded(&self) -> &Arc<AlignedBuf> {
        &self.buf
    }
}

/// What a `put_many` did.
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

/// A block to write back to G3: its key and encoded bytes.
type LocalBlock = (BlockKey, Arc<AlignedBuf>);

/// Work for a background writer (G3 write-back, G4 write-through).
enum Job<T> {
    /// Blocks to write.
    Write(Vec<T>),
    /// Answer once every write queued before it is done.
    Flush(mpsc::Sender<()>),
}

/// A writer thread's loop: coalesces queued writes into batches of up to
/// `max_batch` blocks for `write`, keeping each flush marker in order
/// behind the writes queued before it. Ends when every sender is gone.
fn run_jobs<T>(rx: &mpsc::Receiver<Job<T>>, max_batch: usize, mut write: impl FnMut(Vec<T>)) {
    let mut next: Option<Job<T>> = None;
    loop {
        let job = match next.take() {
            Some(j) => j,
            None => match rx.recv() {
                Ok(j) => j,
                Err(_) => break,
            },
        };
        match job {
            Job::Flush(done) => {
                let _ = done.send(());
            }
            Job::Write(mut batch) => {
                while batch.len() < max_batch {
                    match rx.try_recv() {
                        Ok(Job::Write(more)) => batch.extend(more),
                        Ok(flush) => {
                            next = Some(flush);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                write(batch);
            }
        }
    }
}

/// G4 and its write-through thread.
struct Remote {
    tier: Arc<RemoteTier>,
    tx: Mutex<Option<mpsc::Sender<Job<RemoteBlock>>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    queued: Arc<AtomicU64>,
    max_queued: u64,
}

impl Remote {
    fn stop(&self) {
        drop(self.tx.lock().take());
        if let Some(h) = self.writer.lock().take()
            && h.join().is_err()
        {
            tracing::error!("G4 write-through thread panicked");
        }
    }
}

#[derive(Debug, Default)]
struct PendingSet {
    blocks: HashMap<BlockKey, Arc<AlignedBuf>>,
    bytes: u64,
}

#[derive(Debug, Default)]
struct Pending {
    set: Mutex<PendingSet>,
    drained: Condvar,
}

struct Inner {
    layout: KvLayout,
    fingerprint: ModelFingerprint,
    memory: Arc<MemoryTier>,
    disk: Option<Arc<DiskTier>>,
    pending: Arc<Pending>,
    admission: Option<Mutex<SecondSighting>>,
    writeback_max_bytes: u64,
    persist_on_close: bool,
    tx: Mutex<Option<mpsc::Sender<Job<LocalBlock>>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    metrics: Arc<StoreMetrics>,
    alloc: Arc<dyn HostAllocator>,
    remote: Option<Remote>,
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
    /// Opens a store with the shared I/O engine and a recycling allocator
    /// (up to 256 MiB of freed block buffers are kept for reuse, so reads
    /// from G3 land in memory that is already faulted in).
    pub fn open(config: StoreConfig) -> Result<Self, StoreError> {
        let slot = config.layout.encoded_bytes().max(1);
        let keep = ((256u64 << 20) / slot).clamp(8, 4096) as usize;
        let alloc: Arc<dyn HostAllocator> = Arc::new(RecyclingAllocator::new(keep));
        Self::open_with(config, IoEngine::shared().clone(), alloc)
    }

    /// Opens a store with an explicit I/O engine and allocation hook (the
    /// hook is where pinned host memory plugs in).
    pub fn open_with(
        config: StoreConfig,
        engine: IoEngine,
        alloc: Arc<dyn HostAllocator>,
    ) -> Result<Self, StoreError> {
        config.layout.validate()?;
        let metrics = Arc::new(StoreMetrics::new());
        let memory = Arc::new(MemoryTier::new(config.memory_bytes, metrics.g2.clone()));
        let pending = Arc::new(Pending::default());
        let (disk, tx, writer) = match config.disk {
            Some(mut dc) => {
                dc.layout = config.layout;
                let disk = Arc::new(DiskTier::open(
                    dc,
                    engine.clone(),
                    alloc.clone(),
                    metrics.g3.clone(),
                )?);
                metrics.set_io_mode(Tier::G3, engine.backend().name(), disk.direct());
                let (tx, rx) = mpsc::channel();
                let writer = spawn_writer(
                    rx,
                    disk.clone(),
                    memory.clone(),
                    pending.clone(),
                    metrics.clone(),
                )?;
                (Some(disk), Some(tx), Some(writer))
            }
            None => (None, None, None),
        };
        let admission = config
            .admit_on_second_sighting
            .then(|| Mutex::new(SecondSighting::new(config.admission_window)));
        let remote = match &config.remote {
            Some(rc) => Some(open_remote(
                rc,
                config.layout,
                config.fingerprint,
                alloc.clone(),
                &metrics,
            )?),
            None => None,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                layout: config.layout,
                fingerprint: config.fingerprint,
                memory,
                disk,
                pending,
                admission,
                writeback_max_bytes: config.writeback_max_bytes.max(1),
                persist_on_close: config.persist_on_close,
                tx: Mutex::new(tx),
                writer: Mutex::new(writer),
                metrics,
                alloc,
                remote,
            }),
        })
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

    /// The G3 tier, if configured.
    pub fn disk(&self) -> Option<&DiskTier> {
        self.inner.disk.as_deref()
    }

    /// The G2 tier.
    pub fn memory(&self) -> &MemoryTier {
        &self.inner.memory
    }

    /// The G4 tier, if configured.
    pub fn remote(&self) -> Option<&RemoteTier> {
        self.inner.remote.as_ref().map(|r| &*r.tier)
    }

    /// What each tier holds now.
    pub fn stats(&self) -> StoreStats {
        let inner = &self.inner;
        StoreStats {
            g2_blocks: inner.memory.len(),
            g2_bytes: inner.memory.used_bytes(),
            g3_blocks: inner.disk.as_ref().map_or(0, |d| d.len()),
            g3_slots: inner.disk.as_ref().map_or(0, |d| d.capacity_slots()),
            writeback_pending: inner.pending.set.lock().blocks.len(),
        }
    }

    /// The local tier holding `key`, if any.
    fn local_tier(&self, key: &BlockKey) -> Option<Tier> {
        let inner = &self.inner;
        if inner.memory.contains(key) || inner.pending.set.lock().blocks.contains_key(key) {
            Some(Tier::G2)
        } else if inner.disk.as_ref().is_some_and(|d| d.contains(key)) {
            Some(Tier::G3)
        } else {
            None
        }
    }

    /// How many leading `keys` are cached, and in which tier each is. The
    /// keys past the local prefix are looked up in G4 in one batch.
    pub fn lookup_prefix(&self, keys: &[BlockKey]) -> PrefixLookup {
        let mut tiers: Vec<Tier> = keys.iter().map_while(|k| self.local_tier(k)).collect();
        if let Some(remote) = &self.inner.remote
            && tiers.len() < keys.len()
        {
            let rest = &keys[tiers.len()..];
            let in_g4 = remote.tier.contains_many(rest);
            for (key, found) in rest.iter().zip(in_g4) {
                match self.local_tier(key) {
                    Some(t) => tiers.push(t),
                    None if found => tiers.push(Tier::G4),
                    None => break,
                }
            }
        }
        PrefixLookup { tiers }
    }

    /// Reads `keys`: G2 hits from memory, every G3 hit in one batch with all
    /// reads in flight, each verified. `None` for a miss. G3 hits are
    /// promoted into G2.
    pub fn get_many(&self, keys: &[BlockKey]) -> Vec<Option<StoredBlock>> {
        let inner = &self.inner;
        let payload_len = inner.layout.payload_bytes() as usize;
        let mut out: Vec<Option<StoredBlock>> = Vec::with_capacity(keys.len());
        let mut from_disk: Vec<usize> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            // Evicted blocks waiting for write-back are still G2 hits.
            let queued = inner.pending.set.lock().blocks.get(key).cloned();
            let buf = match queued {
                Some(buf) => {
                    inner.metrics.g2.hits.inc();
                    inner.metrics.g2.read_bytes.inc_by(buf.len() as u64);
                    Some(buf)
                }
                None => inner.memory.get(key),
            };
            match buf {
                Some(buf) => out.push(Some(StoredBlock {
                    key: *key,
                    tier: Tier::G2,
                    buf,
                    payload_len,
                })),
                None => {
                    out.push(None);
                    from_disk.push(i);
                }
            }
        }
        self.record_sightings(
            keys.iter()
                .zip(&out)
                .filter(|(_, b)| b.is_some())
                .map(|(k, _)| k),
        );
        let mut evicted = Vec::new();
        if let Some(disk) = &inner.disk
            && !from_disk.is_empty()
        {
            let disk_keys: Vec<BlockKey> = from_disk.iter().map(|&i| keys[i]).collect();
            for (&i, buf) in from_disk.iter().zip(disk.get_many(&disk_keys)) {
                let Some(buf) = buf else { continue };
                let buf = Arc::new(buf);
                evicted.extend(inner.memory.insert(keys[i], buf.clone(), true));
                out[i] = Some(StoredBlock {
                    key: keys[i],
                    tier: Tier::G3,
                    buf,
                    payload_len,
                });
            }
        }
        if let Some(remote) = &inner.remote {
            let from_g4: Vec<usize> = from_disk
                .into_iter()
                .filter(|&i| out[i].is_none())
                .collect();
            if !from_g4.is_empty() {
                let g4_keys: Vec<BlockKey> = from_g4.iter().map(|&i| keys[i]).collect();
                let g4 = &inner.metrics.g4;
                for (&i, got) in from_g4.iter().zip(remote.tier.get_many(&g4_keys)) {
                    let buf = match got {
                        Some(Ok(buf)) => buf,
                        Some(Err(why)) => {
                            // Refused by the check: a miss, and gone from
                            // the pool so no node reads it again.
                            tracing::warn!(
                                "G4 block {} failed verification ({why}); deleting it",
                                keys[i]
                            );
                            g4.corrupt_blocks.inc();
                            g4.misses.inc();
                            remote.tier.delete(&keys[i]);
                            continue;
                        }
                        None => {
                            g4.misses.inc();
                            continue;
                        }
                    };
                    g4.hits.inc();
                    let buf = Arc::new(buf);
                    // Not persisted locally: G3 gets it when G2 evicts it.
                    evicted.extend(inner.memory.insert(keys[i], buf.clone(), false));
                    out[i] = Some(StoredBlock {
                        key: keys[i],
                        tier: Tier::G4,
                        buf,
                        payload_len,
                    });
                }
            }
        }
        self.demote(evicted);
        out
    }

    /// Stores `(key, payload)` blocks in G2; blocks G2 evicts are written
    /// back to G3 in the background. Waits only when the write-back queue is
    /// over its byte limit. A payload of the wrong length is an error and
    /// stores nothing from the call.
    pub fn put_many(&self, blocks: &[(BlockKey, &[u8])]) -> Result<PutReport, StoreError> {
        let inner = &self.inner;
        let mut encoded = Vec::with_capacity(blocks.len());
        let mut report = PutReport::default();
        for (key, payload) in blocks {
            if inner.memory.contains(key) {
                report.present += 1;
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
        }
        self.record_sightings(blocks.iter().map(|(k, _)| k));
        self.write_through(&encoded);
        self.wait_for_writeback_room();
        let mut evicted = Vec::new();
        for (key, buf) in encoded {
            // A block G3 already holds needs no write-back when evicted.
            let persisted = inner.disk.as_ref().is_some_and(|d| d.contains(&key));
            evicted.extend(inner.memory.insert(key, buf, persisted));
            report.stored += 1;
        }
        self.demote(evicted);
        Ok(report)
    }

    /// Queues newly stored blocks for G4 (subject to the admission filter).
    /// Never waits: with the queue full or the breaker open they are
    /// dropped and counted.
    fn write_through(&self, blocks: &[(BlockKey, Arc<AlignedBuf>)]) {
        let inner = &self.inner;
        let Some(remote) = &inner.remote else { return };
        let sent_len = HEADER_BYTES + inner.layout.payload_bytes() as usize;
        let batch: Vec<RemoteBlock> = blocks
            .iter()
            .filter(|(k, _)| inner.admission.as_ref().is_none_or(|a| a.lock().admits(k)))
            .map(|(k, b)| (*k, b.clone(), sent_len))
            .collect();
        if batch.is_empty() {
            return;
        }
        let n = batch.len() as u64;
        let bytes = n * sent_len as u64;
        // With the breaker open the writer drops batches at once (and lets
        // one through as a probe when due), so the queue stays short.
        let queued = remote.queued.load(Ordering::Acquire);
        if queued + bytes > remote.max_queued {
            inner.metrics.remote.dropped_puts.inc_by(n);
            return;
        }
        remote.queued.fetch_add(bytes, Ordering::AcqRel);
        inner.metrics.remote.queue_bytes.inc_by(bytes as i64);
        let sent = remote
            .tx
            .lock()
            .as_ref()
            .is_some_and(|tx| tx.send(Job::Write(batch)).is_ok());
        if !sent {
            remote.queued.fetch_sub(bytes, Ordering::AcqRel);
            inner.metrics.remote.queue_bytes.dec_by(bytes as i64);
            inner.metrics.remote.dropped_puts.inc_by(n);
        }
    }

    fn record_sightings<'a>(&self, keys: impl Iterator<Item = &'a BlockKey>) {
        if let Some(adm) = &self.inner.admission {
            let mut adm = adm.lock();
            for k in keys {
                adm.record(k);
            }
        }
    }

    fn wait_for_writeback_room(&self) {
        let inner = &self.inner;
        if inner.disk.is_none() {
            return;
        }
        let mut set = inner.pending.set.lock();
        while set.bytes > inner.writeback_max_bytes {
            inner.pending.drained.wait(&mut set);
        }
    }

    /// Queues evicted blocks that G3 lacks for write-back (subject to the
    /// admission filter). Without G3 they are simply dropped: G2 is a cache.
    fn demote(&self, evicted: Vec<Evicted>) {
        let inner = &self.inner;
        if inner.disk.is_none() || evicted.is_empty() {
            return;
        }
        let mut batch = Vec::new();
        for e in evicted {
            if e.persisted {
                continue;
            }
            let admitted = inner
                .admission
                .as_ref()
                .is_none_or(|a| a.lock().admits(&e.key));
            if !admitted {
                inner.metrics.admission_rejected.inc();
                continue;
            }
            batch.push((e.key, e.buf));
        }
        if batch.is_empty() {
            return;
        }
        {
            let mut set = inner.pending.set.lock();
            for (k, b) in &batch {
                if let Some(old) = set.blocks.insert(*k, b.clone()) {
                    set.bytes -= old.len() as u64;
                }
                set.bytes += b.len() as u64;
            }
            inner.metrics.writeback_pending.set(set.blocks.len() as i64);
        }
        let keys: Vec<BlockKey> = batch.iter().map(|(k, _)| *k).collect();
        if !self.send(Job::Write(batch)) {
            // Closed: nothing will write these; do not leave them queued.
            tracing::warn!(
                "store closed; {} evicted blocks not written to G3",
                keys.len()
            );
            let mut set = inner.pending.set.lock();
            for k in keys {
                if let Some(b) = set.blocks.remove(&k) {
                    set.bytes -= b.len() as u64;
                }
            }
            inner.metrics.writeback_pending.set(set.blocks.len() as i64);
        }
    }

    fn send(&self, job: Job<LocalBlock>) -> bool {
        match self.inner.tx.lock().as_ref() {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        }
    }

    /// Writes every block not yet in G3 (evicted or still in G2) and syncs
    /// G3, and waits until every block queued for G4 was written (or
    /// dropped, if G4 is failing). Returns once G3 is durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.flush_remote();
        self.flush_disk()
    }

    /// Waits for the G4 write-through queue to drain.
    fn flush_remote(&self) {
        let Some(remote) = &self.inner.remote else {
            return;
        };
        let (tx, rx) = mpsc::channel();
        let sent = remote
            .tx
            .lock()
            .as_ref()
            .is_some_and(|q| q.send(Job::Flush(tx)).is_ok());
        if sent {
            let _ = rx.recv();
        }
    }

    fn flush_disk(&self) -> Result<(), StoreError> {
        let inner = &self.inner;
        let Some(disk) = &inner.disk else {
            return Ok(());
        };
        let dirty = inner.memory.dirty();
        if !dirty.is_empty() {
            self.send(Job::Write(dirty));
        }
        let (tx, rx) = mpsc::channel();
        if !self.send(Job::Flush(tx)) {
            return Err(StoreError::Task("write-back thread is gone".into()));
        }
        rx.recv()
            .map_err(|_| StoreError::Task("write-back thread stopped before the flush".into()))?;
        disk.sync()
            .map_err(|e| StoreError::Disk(DiskError::Io(e)))?;
        Ok(())
    }

    /// Empties G2 (demoting every block G3 lacks) and flushes, so the next
    /// reads come from G3. Used to measure restores from disk.
    pub fn evict_memory(&self) -> Result<(), StoreError> {
        let drained = self.inner.memory.drain();
        self.demote(drained);
        self.flush()
    }

    /// Flushes (when configured to persist on close) and stops the writer.
    /// Dropping the last handle does the same.
    pub fn close(self) -> Result<(), StoreError> {
        let r = if self.inner.persist_on_close {
            self.flush()
        } else {
            Ok(())
        };
        self.inner.stop_writer();
        if let Some(remote) = &self.inner.remote {
            remote.stop();
        }
        r
    }
}

impl Inner {
    fn stop_writer(&self) {
        drop(self.tx.lock().take());
        if let Some(h) = self.writer.lock().take()
            && h.join().is_err()
        {
            tracing::error!("G3 write-back thread panicked");
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(r) = &self.remote {
            r.stop();
        }
        if self.persist_on_close
            && let Some(tx) = self.tx.lock().as_ref()
        {
            let dirty = self.memory.dirty();
            if !dirty.is_empty() {
                let _ = tx.send(Job::Write(dirty));
            }
        }
        self.stop_writer();
        if let Some(disk) = &self.disk
            && let Err(e) = disk.sync()
        {
            tracing::warn!("G3 sync at close failed: {e}");
        }
    }
}

/// The check of every block read from G4 (run where it lands): both
/// checksums and the key ([`decode_block`]), this store's layout and model,
/// and room for a whole local block; then the block is extended to one
/// (zero padding).
fn check_remote_block(
    layout: KvLayout,
    fingerprint: ModelFingerprint,
    key: &BlockKey,
    mut buf: AlignedBuf,
) -> Result<AlignedBuf, String> {
    let slot = layout.encoded_bytes() as usize;
    let len = buf.len();
    match decode_block(&buf, Some(key)) {
        Ok((h, _)) if h.layout != layout => {
            return Err(format!("layout {} instead of {layout}", h.layout));
        }
        Ok((h, _)) if h.fingerprint != fingerprint => {
            return Err("another model's fingerprint".to_string());
        }
        Ok(_) if buf.capacity() < slot => {
            return Err(format!(
                "{len} bytes in a buffer of {}, less than a block's {slot}",
                buf.capacity()
            ));
        }
        Ok(_) => {}
        Err(e) => return Err(e.to_string()),
    }
    buf.set_len(slot);
    buf[len..].fill(0);
    Ok(buf)
}

fn open_remote(
    config: &RemoteConfig,
    layout: KvLayout,
    fingerprint: ModelFingerprint,
    alloc: Arc<dyn HostAllocator>,
    metrics: &Arc<StoreMetrics>,
) -> Result<Remote, StoreError> {
    let check: BlockCheck =
        Arc::new(move |key, buf| check_remote_block(layout, fingerprint, key, buf));
    let tier = Arc::new(RemoteTier::open(
        config,
        layout.encoded_bytes(),
        alloc,
        check,
        metrics.g4.clone(),
        metrics.remote.clone(),
    )?);
    let queued = Arc::new(AtomicU64::new(0));
    let (tx, rx) = mpsc::channel();
    let writer = {
        let (tier, queued, metrics) = (tier.clone(), queued.clone(), metrics.clone());
        std::thread::Builder::new()
            .name("kvtier-g4-write".into())
            .spawn(move || write_through_loop(&rx, &tier, &queued, &metrics))
            .map_err(|e| StoreError::Task(format!("cannot start the G4 writer: {e}")))?
    };
    tracing::info!("G4 pool {} (write-through, breaker)", tier.shown());
    Ok(Remote {
        tier,
        tx: Mutex::new(Some(tx)),
        writer: Mutex::new(Some(writer)),
        queued,
        max_queued: config.write_queue_bytes,
    })
}

fn write_through_loop(
    rx: &mpsc::Receiver<Job<RemoteBlock>>,
    tier: &RemoteTier,
    queued: &AtomicU64,
    metrics: &StoreMetrics,
) {
    run_jobs(rx, WRITEBACK_BATCH, |batch| {
        let n = batch.len() as u64;
        let bytes: u64 = batch.iter().map(|(_, _, len)| *len as u64).sum();
        let written = tier.put_many(batch) as u64;
        metrics.remote.dropped_puts.inc_by(n - written);
        queued.fetch_sub(bytes, Ordering::AcqRel);
        metrics.remote.queue_bytes.dec_by(bytes as i64);
    });
}

/// Largest number of blocks the writer puts in one batch.
const WRITEBACK_BATCH: usize = 64;

fn spawn_writer(
    rx: mpsc::Receiver<Job<LocalBlock>>,
    disk: Arc<DiskTier>,
    memory: Arc<MemoryTier>,
    pending: Arc<Pending>,
    metrics: Arc<StoreMetrics>,
) -> Result<JoinHandle<()>, StoreError> {
    std::thread::Builder::new()
        .name("kvtier-writeback".into())
        .spawn(move || {
            run_jobs(&rx, WRITEBACK_BATCH, |batch| {
                write_back(&disk, &memory, &pending, &metrics, batch);
            });
        })
        .map_err(|e| StoreError::Task(format!("cannot start the write-back thread: {e}")))
}

fn write_back(
    disk: &DiskTier,
    memory: &MemoryTier,
    pending: &Pending,
    metrics: &StoreMetrics,
    batch: Vec<(BlockKey, Arc<AlignedBuf>)>,
) {
    for chunk in batch.chunks(WRITEBACK_BATCH) {
        let results = disk.put_many(chunk);
        let mut set = pending.set.lock();
        for ((key, buf), r) in chunk.iter().zip(results) {
            match r {
                Ok(PutOutcome::Written) | Ok(PutOutcome::Present) => memory.mark_persisted(key),
                Err(e) => tracing::warn!("write-back of {key} to G3 failed: {e}"),
            }
            if set.blocks.get(key).is_some_and(|b| Arc::ptr_eq(b, buf)) {
                set.blocks.remove(key);
                set.bytes -= buf.len() as u64;
            }
        }
        metrics.writeback_pending.set(set.blocks.len() as i64);
        drop(set);
        pending.drained.notify_all();
    }
}

impl TieredStore {
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
}
