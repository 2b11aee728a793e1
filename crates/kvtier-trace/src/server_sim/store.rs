//! The store below G1 as kvtier-store runs it: G2's blocks and policy, G3's
//! slots, the admission filter, the write-back and a clean restart.

use std::collections::{HashMap, HashSet};

use kvtier_store::admission::SecondSighting;
use kvtier_store::eviction::{Eviction, EvictionKind};

use super::g1::Key;
use super::{ServerShape, SimStats};

/// Blocks the store's G3 writer hands the disk at once (its
/// `WRITE_BATCH`): the blocks of one batch cannot evict each other.
pub(super) const WRITE_BATCH: usize = 64;

/// A block in G2.
#[derive(Debug, Clone, Copy)]
pub(super) struct G2Entry {
    /// G3 holds it (it came from there, or was written there).
    pub(super) persisted: bool,
    /// Its insert's number: a clean stop writes G2's blocks oldest first.
    pub(super) stamp: u64,
}

/// Where a restored block came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tier {
    G2,
    G3,
}

/// G3's slots as kvtier-store's `SlotTable` keeps them.
#[derive(Debug)]
pub(super) struct G3 {
    pub(super) index: HashMap<Key, u32>,
    pub(super) held: Vec<Option<Key>>,
    /// Free slots, the next one last.
    pub(super) free: Vec<u32>,
    pub(super) policy: Box<dyn Eviction<Key>>,
    pub(super) eviction: EvictionKind,
}

impl G3 {
    /// A tier of `slots` free slots, as a fresh directory opens (lowest
    /// slot first).
    pub(super) fn new(slots: u32, eviction: EvictionKind) -> Self {
        Self {
            index: HashMap::new(),
            held: vec![None; slots as usize],
            free: (0..slots).rev().collect(),
            policy: eviction.build(u64::from(slots)),
            eviction,
        }
    }

    /// The tier opened again from its saved index: its blocks as they
    /// were, its policy refilled in slot order (no history), its free
    /// slots lowest first.
    pub(super) fn reopen(&mut self) {
        self.policy = self.eviction.build(self.held.len() as u64);
        self.free.clear();
        for (slot, key) in self.held.iter().enumerate() {
            match key {
                Some(k) => {
                    self.policy.insert(*k, 1, None);
                }
                None => self.free.push(slot as u32),
            }
        }
        self.free.reverse();
    }

    /// A free slot, or one the policy gives up.
    pub(super) fn alloc(&mut self, stats: &mut SimStats) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let index = &self.index;
        let key = self.policy.evict_where(&mut |k| index.contains_key(k))?;
        let slot = self.index.remove(&key)?;
        if let Some(h) = self.held.get_mut(slot as usize) {
            *h = None;
        }
        stats.g3_evicted += 1;
        Some(slot)
    }

    /// One batch of writes (`DiskTier::put_many`): every slot reserved
    /// first, then every block indexed. Returns the blocks G3 holds after
    /// it (written now or before).
    pub(super) fn put_many(&mut self, blocks: &[Key], stats: &mut SimStats) -> Vec<Key> {
        let mut held = Vec::with_capacity(blocks.len());
        let mut writing = HashSet::new();
        let mut planned = Vec::with_capacity(blocks.len());
        for &k in blocks {
            if self.index.contains_key(&k) || writing.contains(&k) {
                held.push(k);
                continue;
            }
            // No slot: every one is being written by this batch; the block
            // is lost, as the store's is.
            if let Some(slot) = self.alloc(stats) {
                writing.insert(k);
                planned.push((k, slot));
            }
        }
        for (k, slot) in planned {
            self.index.insert(k, slot);
            if let Some(h) = self.held.get_mut(slot as usize) {
                *h = Some(k);
            }
            self.policy.insert(k, 1, None);
            stats.g3_written += 1;
            held.push(k);
        }
        held
    }
}

/// The store below G1: G2, G3, the admission filter, the write-back.
#[derive(Debug)]
pub(super) struct Store {
    pub(super) g2: HashMap<Key, G2Entry>,
    pub(super) g2_policy: Box<dyn Eviction<Key>>,
    pub(super) g2_bytes: u64,
    pub(super) stamp: u64,
    pub(super) eviction: EvictionKind,
    pub(super) block_bytes: u64,
    pub(super) g3: Option<G3>,
    pub(super) admission: Option<SecondSighting<Key>>,
    pub(super) admission_window: Option<usize>,
    pub(super) writeback_max_bytes: u64,
}

impl Store {
    pub(super) fn new(shape: &ServerShape) -> Result<Self, String> {
        let slots = u32::try_from(shape.g3_slots)
            .map_err(|_| format!("{} G3 slots are more than a store has", shape.g3_slots))?;
        Ok(Self {
            g2: HashMap::new(),
            g2_policy: shape.eviction.build(shape.g2_bytes),
            g2_bytes: shape.g2_bytes,
            stamp: 0,
            eviction: shape.eviction,
            block_bytes: shape.block_bytes,
            g3: (slots > 0).then(|| G3::new(slots, shape.eviction)),
            admission: shape.admission_window.map(SecondSighting::new),
            admission_window: shape.admission_window,
            writeback_max_bytes: shape.writeback_max_bytes.max(1),
        })
    }

    pub(super) fn in_g3(&self, key: &Key) -> bool {
        self.g3.as_ref().is_some_and(|g| g.index.contains_key(key))
    }

    pub(super) fn record(&mut self, key: &Key) {
        if let Some(a) = &mut self.admission {
            a.record(key);
        }
    }

    /// `MemoryTier::insert`: the blocks it evicted (the key itself when it
    /// cannot be admitted), each with whether G3 holds it.
    pub(super) fn g2_insert(
        &mut self,
        key: Key,
        persisted: bool,
        parent: Option<Key>,
        stats: &mut SimStats,
    ) -> Vec<(Key, bool)> {
        let persisted = persisted || self.g2.get(&key).is_some_and(|e| e.persisted);
        self.stamp += 1;
        self.g2.insert(
            key,
            G2Entry {
                persisted,
                stamp: self.stamp,
            },
        );
        let evicted = self
            .g2_policy
            .insert(key, self.block_bytes, parent.as_ref());
        let mut out = Vec::with_capacity(evicted.len());
        for k in evicted {
            if let Some(e) = self.g2.remove(&k) {
                if k != key {
                    stats.g2_evicted += 1;
                }
                out.push((k, e.persisted));
            }
        }
        out
    }

    /// `TieredStore::offer` of one scheduler step's blocks.
    pub(super) fn offer(&mut self, blocks: &[Key], stats: &mut SimStats) {
        for k in blocks {
            self.record(k);
        }
        let mut kept = Vec::with_capacity(blocks.len());
        for (i, &k) in blocks.iter().enumerate() {
            // Each block's parent is the one before it in the batch,
            // whether or not that one is stored again.
            let parent = i.checked_sub(1).and_then(|p| blocks.get(p).copied());
            if !self.g2.contains_key(&k) {
                kept.push((k, parent));
            }
        }
        let persisted: Vec<bool> = kept.iter().map(|(k, _)| self.in_g3(k)).collect();
        let mut evicted = Vec::new();
        for ((k, parent), p) in kept.into_iter().zip(persisted) {
            evicted.extend(self.g2_insert(k, p, parent, stats));
        }
        self.demote(evicted, true, stats);
    }

    /// One prefix read (`fetch_to`, leading run, no G4): the tier of each
    /// leading key found.
    pub(super) fn fetch(&mut self, keys: &[Key], stats: &mut SimStats) -> Vec<Tier> {
        // G2 first: every hit is touched, past a gap too.
        let mut in_g2 = Vec::with_capacity(keys.len());
        for k in keys {
            let hit = self.g2.contains_key(k);
            if hit {
                self.g2_policy.touch(k);
            }
            in_g2.push(hit);
        }
        for (k, hit) in keys.iter().zip(&in_g2) {
            if *hit {
                self.record(k);
            }
        }
        // G3 up to the first block no tier holds.
        let mut from_g3 = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if in_g2[i] {
                continue;
            }
            if !self.in_g3(k) {
                break;
            }
            from_g3.push(i);
        }
        if let Some(g3) = &mut self.g3 {
            for &i in &from_g3 {
                g3.policy.touch(&keys[i]);
            }
        }
        // G3 hits into G2, each under the key before it in the read.
        let mut evicted = Vec::new();
        for &i in &from_g3 {
            let parent = i.checked_sub(1).and_then(|p| keys.get(p).copied());
            evicted.extend(self.g2_insert(keys[i], true, parent, stats));
        }
        self.demote(evicted, false, stats);
        (0..keys.len())
            .map_while(|i| {
                if in_g2[i] {
                    Some(Tier::G2)
                } else if from_g3.contains(&i) {
                    Some(Tier::G3)
                } else {
                    None
                }
            })
            .collect()
    }

    /// Blocks G2 evicted that G3 lacks, through the admission filter and
    /// the write-back queue (empty when they come: the writer kept up;
    /// `drop_over`, an offer's, drops what passes its bound) to G3.
    pub(super) fn demote(
        &mut self,
        evicted: Vec<(Key, bool)>,
        drop_over: bool,
        stats: &mut SimStats,
    ) {
        if self.g3.is_none() {
            return;
        }
        let mut queued = HashSet::new();
        let mut bytes = 0u64;
        let mut batch = Vec::with_capacity(evicted.len());
        for (k, persisted) in evicted {
            if persisted {
                continue;
            }
            if self.admission.as_ref().is_some_and(|a| !a.admits(&k)) {
                stats.admission_rejected += 1;
                continue;
            }
            if drop_over && bytes + self.block_bytes > self.writeback_max_bytes {
                stats.writeback_dropped += 1;
                continue;
            }
            if queued.insert(k) {
                bytes += self.block_bytes;
            }
            batch.push(k);
        }
        self.write_g3(&batch, stats);
    }

    /// The G3 writer's work on `blocks`: batches of [`WRITE_BATCH`], each
    /// block G3 then holds marked so in G2.
    pub(super) fn write_g3(&mut self, blocks: &[Key], stats: &mut SimStats) {
        for chunk in blocks.chunks(WRITE_BATCH) {
            let Some(g3) = &mut self.g3 else { return };
            for k in g3.put_many(chunk, stats) {
                if let Some(e) = self.g2.get_mut(&k) {
                    e.persisted = true;
                }
            }
        }
    }

    /// A clean stop (G2's blocks G3 lacks written to it, oldest first, in
    /// one flush) and a start on the same directory.
    pub(super) fn restart(&mut self, stats: &mut SimStats) {
        let mut dirty: Vec<(u64, Key)> = self
            .g2
            .iter()
            .filter(|(_, e)| !e.persisted)
            .map(|(k, e)| (e.stamp, *k))
            .collect();
        dirty.sort_unstable_by_key(|&(stamp, _)| stamp);
        let dirty: Vec<Key> = dirty.into_iter().map(|(_, k)| k).collect();
        let before = stats.g3_evicted;
        self.write_g3(&dirty, stats);
        stats.g3_evicted_at_restart += stats.g3_evicted - before;
        self.g2.clear();
        self.g2_policy = self.eviction.build(self.g2_bytes);
        self.admission = self.admission_window.map(SecondSighting::new);
        if let Some(g3) = &mut self.g3 {
            g3.reopen();
        }
    }
}
