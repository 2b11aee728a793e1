//! G2: the host-memory tier.
//!
//! Holds encoded blocks (header + payload, the same bytes G3 writes) in
//! buffers from the store's allocation hook, up to a byte capacity, under an
//! eviction policy ([`EvictionKind`], kvtier's own by default). Blocks are shared as `Arc<AlignedBuf>`: a reader holds
//! its block alive even if the tier evicts it meanwhile, so eviction can never
//! pull memory from under a reader (the lease is the `Arc`).
//!
//! Eviction hands the evicted blocks back to the caller, which demotes the
//! ones not yet on disk to G3 asynchronously. Several stores (namespaces:
//! one per model or layout) may share one tier, and so one budget: each
//! block carries its [`Owner`], so what is evicted goes to its own store's
//! G3, whoever's insert made room.

use std::collections::HashMap;
use std::sync::Arc;

use kvtier_io::AlignedBuf;
use parking_lot::Mutex;

use crate::eviction::{Eviction, EvictionKind};
use crate::key::BlockKey;
use crate::metrics::TierMetrics;

/// Which store (namespace) a block belongs to; 0 for a store that does not
/// share its G2.
pub type Owner = u32;

/// A block that left G2.
#[derive(Debug)]
pub struct Evicted {
    /// The store it belongs to.
    pub owner: Owner,
    /// Its key.
    pub key: BlockKey,
    /// Its encoded bytes.
    pub buf: Arc<AlignedBuf>,
    /// True when G3 already holds it (it came from there, or was written).
    pub persisted: bool,
}

#[derive(Debug)]
struct Entry {
    owner: Owner,
    buf: Arc<AlignedBuf>,
    persisted: bool,
    /// When it was inserted (the tier's insert count then): blocks handed
    /// out in bulk go oldest first, not in the map's order, which differs
    /// from process to process.
    stamp: u64,
}

#[derive(Debug)]
struct Inner {
    map: HashMap<BlockKey, Entry>,
    policy: Box<dyn Eviction<BlockKey>>,
    /// Inserts so far (the last entry's stamp).
    stamp: u64,
}

/// The G2 tier. Thread-safe; every method takes `&self`.
#[derive(Debug)]
pub struct MemoryTier {
    inner: Mutex<Inner>,
    metrics: TierMetrics,
}

impl MemoryTier {
    /// A tier holding at most `capacity_bytes` of block buffers under the
    /// `eviction` policy.
    pub fn new(capacity_bytes: u64, eviction: EvictionKind, metrics: TierMetrics) -> Self {
        metrics.capacity_bytes.set(capacity_bytes as i64);
        Self {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                policy: eviction.build(capacity_bytes),
                stamp: 0,
            }),
            metrics,
        }
    }

    /// The block under `key`, recording a hit (or a miss).
    pub fn get(&self, key: &BlockKey) -> Option<Arc<AlignedBuf>> {
        let mut inner = self.inner.lock();
        let found = inner.map.get(key).map(|e| e.buf.clone());
        match &found {
            Some(buf) => {
                inner.policy.touch(key);
                self.metrics.hits.inc();
                self.metrics.read_bytes.inc_by(buf.len() as u64);
            }
            None => {
                self.metrics.misses.inc();
            }
        }
        found
    }

    /// For every `found[i]` still `None`, the block under `keys[i]`,
    /// recording a hit or a miss for each, under one lock.
    pub fn get_many(&self, keys: &[BlockKey], found: &mut [Option<Arc<AlignedBuf>>]) {
        let mut inner = self.inner.lock();
        let (mut hits, mut misses, mut bytes) = (0, 0, 0);
        for (key, slot) in keys.iter().zip(found.iter_mut()) {
            if slot.is_some() {
                continue;
            }
            match inner.map.get(key).map(|e| e.buf.clone()) {
                Some(buf) => {
                    inner.policy.touch(key);
                    hits += 1;
                    bytes += buf.len() as u64;
                    *slot = Some(buf);
                }
                None => misses += 1,
            }
        }
        self.metrics.hits.inc_by(hits);
        self.metrics.misses.inc_by(misses);
        self.metrics.read_bytes.inc_by(bytes);
    }

    /// True when `key` is resident (no hit is recorded).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.inner.lock().map.contains_key(key)
    }

    /// [`contains`](Self::contains) for each of `keys`, under one lock.
    pub fn contains_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        let inner = self.inner.lock();
        keys.iter().map(|k| inner.map.contains_key(k)).collect()
    }

    /// Inserts a block (replacing one under the same key) and returns the
    /// blocks evicted to make room. A block larger than the whole tier is
    /// returned as evicted at once. `parent` is the block before it in its
    /// prefix chain, when known: the chain-aware policies keep it while
    /// this block is resident.
    pub fn insert(
        &self,
        owner: Owner,
        key: BlockKey,
        buf: Arc<AlignedBuf>,
        persisted: bool,
        parent: Option<&BlockKey>,
    ) -> Vec<Evicted> {
        let weight = buf.capacity() as u64;
        let bytes = buf.len() as u64;
        let mut inner = self.inner.lock();
        let persisted = persisted || inner.map.get(&key).is_some_and(|e| e.persisted);
        inner.stamp += 1;
        let stamp = inner.stamp;
        inner.map.insert(
            key,
            Entry {
                owner,
                buf,
                persisted,
                stamp,
            },
        );
        let evicted_keys = inner.policy.insert(key, weight, parent);
        let mut out = Vec::with_capacity(evicted_keys.len());
        for k in evicted_keys {
            if let Some(e) = inner.map.remove(&k) {
                if k != key {
                    self.metrics.evictions.inc();
                }
                out.push(Evicted {
                    owner: e.owner,
                    key: k,
                    buf: e.buf,
                    persisted: e.persisted,
                });
            }
        }
        self.metrics.written_bytes.inc_by(bytes);
        self.metrics.written_blocks.inc();
        self.metrics.occupancy_bytes.set(inner.policy.used() as i64);
        out
    }

    /// Marks a resident block as present in G3, so evicting it needs no write.
    pub fn mark_persisted(&self, key: &BlockKey) {
        if let Some(e) = self.inner.lock().map.get_mut(key) {
            e.persisted = true;
        }
    }

    /// Removes a block.
    pub fn remove(&self, key: &BlockKey) -> Option<Evicted> {
        let mut inner = self.inner.lock();
        inner.policy.remove(key);
        let e = inner.map.remove(key)?;
        self.metrics.occupancy_bytes.set(inner.policy.used() as i64);
        Some(Evicted {
            owner: e.owner,
            key: *key,
            buf: e.buf,
            persisted: e.persisted,
        })
    }

    /// Evicts every block (in policy order) and returns them.
    pub fn drain(&self) -> Vec<Evicted> {
        let mut inner = self.inner.lock();
        let mut out = Vec::with_capacity(inner.map.len());
        while let Some(k) = inner.policy.evict_one() {
            if let Some(e) = inner.map.remove(&k) {
                out.push(Evicted {
                    owner: e.owner,
                    key: k,
                    buf: e.buf,
                    persisted: e.persisted,
                });
            }
        }
        // Anything the policy did not know (cannot happen) goes too.
        out.extend(inner.map.drain().map(|(key, e)| Evicted {
            owner: e.owner,
            key,
            buf: e.buf,
            persisted: e.persisted,
        }));
        self.metrics.evictions.inc_by(out.len() as u64);
        self.metrics.occupancy_bytes.set(0);
        out
    }

    /// Evicts every block of `owner` and returns them, oldest first; the
    /// others stay.
    pub fn drain_owner(&self, owner: Owner) -> Vec<Evicted> {
        let mut inner = self.inner.lock();
        let mut keys: Vec<(u64, BlockKey)> = inner
            .map
            .iter()
            .filter(|(_, e)| e.owner == owner)
            .map(|(k, e)| (e.stamp, *k))
            .collect();
        keys.sort_unstable();
        let keys: Vec<BlockKey> = keys.into_iter().map(|(_, k)| k).collect();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            inner.policy.remove(&key);
            if let Some(e) = inner.map.remove(&key) {
                out.push(Evicted {
                    owner,
                    key,
                    buf: e.buf,
                    persisted: e.persisted,
                });
            }
        }
        self.metrics.evictions.inc_by(out.len() as u64);
        self.metrics.occupancy_bytes.set(inner.policy.used() as i64);
        out
    }

    /// Resident blocks of `owner` not yet in G3, oldest first.
    ///
    /// In a fixed order because the order decides which G3 slot each gets
    /// when they are written (at a clean stop, every G3 sync), and G3's
    /// index is rebuilt in slot order at the next open: in the map's own
    /// order, which changes from process to process, the same traffic
    /// would leave G3 evicting in another order after each restart.
    pub fn dirty(&self, owner: Owner) -> Vec<(BlockKey, Arc<AlignedBuf>)> {
        let inner = self.inner.lock();
        let mut dirty: Vec<(u64, BlockKey, Arc<AlignedBuf>)> = inner
            .map
            .iter()
            .filter(|(_, e)| !e.persisted && e.owner == owner)
            .map(|(k, e)| (e.stamp, *k, e.buf.clone()))
            .collect();
        drop(inner);
        dirty.sort_unstable_by_key(|(stamp, _, _)| *stamp);
        dirty.into_iter().map(|(_, k, b)| (k, b)).collect()
    }

    /// Bytes it may hold.
    pub fn capacity_bytes(&self) -> u64 {
        self.inner.lock().policy.capacity()
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> u64 {
        self.inner.lock().policy.used()
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(fill: u8) -> Arc<AlignedBuf> {
        let mut b = AlignedBuf::zeroed(4096, 4096).unwrap();
        b.fill(fill);
        Arc::new(b)
    }

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn capacity_is_kept_and_evictions_returned() {
        let tier = MemoryTier::new(4 * 4096, EvictionKind::default(), TierMetrics::default());
        let mut evicted = Vec::new();
        for i in 0..10 {
            evicted.extend(tier.insert(0, key(i), block(i), false, None));
            assert!(tier.used_bytes() <= 4 * 4096);
        }
        assert_eq!(tier.len() + evicted.len(), 10);
        for e in &evicted {
            assert!(!tier.contains(&e.key));
            assert!(
                e.buf.iter().all(|&b| b == e.key.0[0]),
                "evicted block keeps its bytes"
            );
        }
    }

    #[test]
    fn reader_keeps_block_alive_across_eviction() {
        let tier = MemoryTier::new(4096, EvictionKind::default(), TierMetrics::default());
        tier.insert(0, key(1), block(1), false, None);
        let held = tier.get(&key(1)).unwrap();
        let out = tier.insert(0, key(2), block(2), false, None);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].key, key(1));
        assert!(held.iter().all(|&b| b == 1));
    }

    #[test]
    fn persisted_flag_survives_reinsert_and_dirty_lists_the_rest() {
        let tier = MemoryTier::new(1 << 20, EvictionKind::default(), TierMetrics::default());
        tier.insert(0, key(1), block(1), true, None);
        tier.insert(0, key(2), block(2), false, None);
        tier.insert(0, key(1), block(1), false, None);
        let dirty: Vec<_> = tier.dirty(0).into_iter().map(|(k, _)| k).collect();
        assert_eq!(dirty, vec![key(2)]);
        tier.mark_persisted(&key(2));
        assert!(tier.dirty(0).is_empty());
        let drained = tier.drain();
        assert_eq!(drained.len(), 2);
        assert!(drained.iter().all(|e| e.persisted));
        assert!(tier.is_empty());
        assert_eq!(tier.used_bytes(), 0);
    }

    #[test]
    fn dirty_and_drained_blocks_come_oldest_first() {
        // The map's order differs between processes; these lists must not.
        let tier = MemoryTier::new(1 << 20, EvictionKind::default(), TierMetrics::default());
        for i in [9u8, 3, 7, 1, 5, 8, 2] {
            tier.insert(0, key(i), block(i), false, None);
        }
        // Inserted again: the newest now.
        tier.insert(0, key(3), block(3), false, None);
        let want = [9u8, 7, 1, 5, 8, 2, 3];
        let dirty: Vec<u8> = tier.dirty(0).iter().map(|(k, _)| k.0[0]).collect();
        assert_eq!(dirty, want);
        let drained: Vec<u8> = tier.drain_owner(0).iter().map(|e| e.key.0[0]).collect();
        assert_eq!(drained, want);
    }

    #[test]
    fn owners_share_the_budget_and_drain_apart() {
        let tier = MemoryTier::new(4 * 4096, EvictionKind::default(), TierMetrics::default());
        tier.insert(1, key(1), block(1), false, None);
        tier.insert(2, key(2), block(2), false, None);
        tier.insert(1, key(3), block(3), true, None);
        assert_eq!(tier.dirty(1).len(), 1);
        assert_eq!(tier.dirty(2).len(), 1);
        // Owner 2 filling the budget evicts owner 1's blocks, labelled as 1's.
        let mut evicted = Vec::new();
        for i in 10..14 {
            evicted.extend(tier.insert(2, key(i), block(i), false, None));
        }
        assert!(evicted.iter().any(|e| e.owner == 1 && e.key == key(1)));
        for e in &evicted {
            assert_eq!(e.owner, if [1, 3].contains(&e.key.0[0]) { 1 } else { 2 });
        }
        let two = tier.drain_owner(2);
        assert!(two.iter().all(|e| e.owner == 2));
        assert!(tier.is_empty(), "only owner 2 was left");
        tier.insert(1, key(1), block(1), false, None);
        tier.insert(2, key(2), block(2), false, None);
        assert_eq!(tier.drain_owner(1).len(), 1);
        assert!(tier.contains(&key(2)) && !tier.contains(&key(1)));
        assert_eq!(tier.used_bytes(), 4096);
    }
}
