//! [`StoreConfig`]: what a [`TieredStore`](super::TieredStore) is opened
//! with, and how many read buffers it keeps and warms for it.

use super::READ_WORKERS;
use super::SharedMemory;
use crate::disk::DiskConfig;
use crate::eviction::EvictionKind;
use crate::key::ModelFingerprint;
use crate::kv_layout::KvLayout;
use crate::remote::RemoteConfig;

/// How often blocks that live only in G2 are written to G3 by default
/// ([`StoreConfig::g3_sync`]): a crash (kill -9, OOM) loses at most about
/// a second of computed KV, and a second's worth of blocks is one batched
/// write, not a write per block.
pub const DEFAULT_G3_SYNC: std::time::Duration = std::time::Duration::from_millis(1000);

/// Configuration of a [`TieredStore`](super::TieredStore).
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Layout of every block (fixes the block and slot size).
    pub layout: KvLayout,
    /// Model the blocks belong to (written into every header).
    pub fingerprint: ModelFingerprint,
    /// G2 capacity in bytes (0: no G2; puts go straight to write-back).
    pub memory_bytes: u64,
    /// G3, if any. Its `layout` and `fingerprint` are set from this config's.
    pub disk: Option<DiskConfig>,
    /// Write a block to G3 only once it was seen twice (put or hit).
    pub admit_on_second_sighting: bool,
    /// Distinct keys the admission filter remembers.
    pub admission_window: usize,
    /// The eviction policy of G2 and G3 (default kvtier's own,
    /// [`EvictionKind::Kvtier`]); G2 takes it from `shared_memory` instead
    /// when one is set.
    pub eviction: EvictionKind,
    /// Bytes of evicted blocks that may wait for write-back before puts wait.
    pub writeback_max_bytes: u64,
    /// Write dirty G2 blocks to G3 when the store closes.
    pub persist_on_close: bool,
    /// Bounded write-back: blocks that live only in G2 are written to G3
    /// about this often (off every read's path), so a crash loses at most
    /// about this much of what was computed. `None` (or zero): G3 gets a
    /// block only when G2 evicts it, at a flush, or at close.
    pub g3_sync: Option<std::time::Duration>,
    /// G4, a pool shared with other nodes, if any.
    pub remote: Option<RemoteConfig>,
    /// A G2 budget shared with other stores (one per model or layout); when
    /// set, `memory_bytes` is ignored and G2 counters are the shared ones.
    pub shared_memory: Option<SharedMemory>,
    /// Fault in, on a background thread right after the store opens, the
    /// buffers G3 and G4 reads will take (as many as the G2 budget holds,
    /// plus the reads in flight), so a restore reads into resident memory
    /// instead of faulting fresh pages in on the cores others compute on
    /// (`warm_buffers.rs`); each buffer is usable as soon as it is warm,
    /// and [`TieredStore::wait_read_buffers_warm`](super::TieredStore::wait_read_buffers_warm) waits for the last.
    /// Commits the G2 budget's memory at open (a shared G2's whole budget
    /// for each store that asks: turn it on for one). Default false; the
    /// engine turns it on.
    pub warm_read_buffers: bool,
}

impl StoreConfig {
    /// Defaults: 1 GiB G2, no G3, admission filter off, 256 MiB write-back
    /// queue, persist on close, G3 sync every [`DEFAULT_G3_SYNC`].
    pub fn new(layout: KvLayout, fingerprint: ModelFingerprint) -> Self {
        Self {
            layout,
            fingerprint,
            memory_bytes: 1 << 30,
            disk: None,
            admit_on_second_sighting: false,
            admission_window: 1 << 20,
            eviction: EvictionKind::default(),
            writeback_max_bytes: 256 << 20,
            persist_on_close: true,
            g3_sync: Some(DEFAULT_G3_SYNC),
            remote: None,
            shared_memory: None,
            warm_read_buffers: false,
        }
    }
}

/// Read buffers the store's allocator keeps for reuse: what the G2 budget
/// (at least 256 MiB) holds in blocks, plus the reads in flight.
pub(super) fn read_buffers_kept(config: &StoreConfig) -> usize {
    read_buffers(config, 256 << 20)
}

/// Read buffers worth warming at open: what the G2 budget holds in blocks
/// (G2 keeps the buffers of G3 hits), plus the reads in flight (never more
/// than [`read_buffers_kept`], whose G2 floor is higher).
pub(super) fn read_buffers_warmed(config: &StoreConfig) -> usize {
    read_buffers(config, 0)
}

/// Blocks of the G2 budget (at least `min_g2` bytes) plus the reads in
/// flight, between 8 and 4,096.
fn read_buffers(config: &StoreConfig, min_g2: u64) -> usize {
    let slot = config.layout.encoded_bytes().max(1);
    let g2 = match &config.shared_memory {
        Some(shared) => shared.memory().capacity_bytes(),
        None => config.memory_bytes,
    };
    let in_flight = READ_WORKERS as u64 * crate::transfer::chunk_blocks(&config.layout) as u64;
    (min_g2.max(g2) / slot + in_flight).clamp(8, 4096) as usize
}
