//! G3's slot table: which key lives in which slot, which slots are free,
//! pinned by readers or being written, and the eviction policy that
//! chooses a block to reclaim (the store's, [`EvictionKind`]; a pinned
//! slot is never chosen).
//!
//! Pure bookkeeping under the tier's lock; no I/O happens here.

use std::collections::{HashMap, HashSet};

use crate::eviction::{Eviction, EvictionKind};
use crate::key::BlockKey;

/// The life of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotState {
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
    pins: u32,
}

/// Every slot of a G3 tier and its index.
#[derive(Debug)]
pub(super) struct SlotTable {
    index: HashMap<BlockKey, u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Orders the valid blocks for reclaiming (a block weighs 1).
    policy: Box<dyn Eviction<BlockKey>>,
    writing: HashSet<BlockKey>,
    valid: u64,
}

/// What [`SlotTable::reserve`] decided for one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reserve {
    /// Write it to `slot`; `evicted` when a block was reclaimed for it.
    Slot {
        /// The slot.
        slot: u32,
        /// A stored block was evicted to free it.
        evicted: bool,
    },
    /// Stored already, or being stored by another caller.
    Present,
    /// Every slot is pinned or being written.
    Full,
}

impl SlotTable {
    /// `total` free slots, reclaimed by `eviction`'s rule.
    pub(super) fn new(total: u32, eviction: EvictionKind) -> Self {
        Self {
            index: HashMap::new(),
            slots: vec![
                Slot {
                    key: BlockKey([0; 16]),
                    state: SlotState::Free,
                    pins: 0,
                };
                total as usize
            ],
            free: Vec::new(),
            policy: eviction.build(u64::from(total)),
            writing: HashSet::new(),
            valid: 0,
        }
    }

    /// Slots in all.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Blocks indexed.
    pub(super) fn blocks(&self) -> usize {
        self.index.len()
    }

    /// Valid slots (for the occupancy gauge).
    pub(super) fn valid(&self) -> u64 {
        self.valid
    }

    /// The slot holding `key`.
    pub(super) fn slot_of(&self, key: &BlockKey) -> Option<u32> {
        self.index.get(key).copied()
    }

    /// Every indexed key.
    pub(super) fn keys(&self) -> Vec<BlockKey> {
        self.index.keys().copied().collect()
    }

    /// At open: `slot` holds `key` (the first slot seen for a key wins).
    /// Returns false when the key is indexed already.
    pub(super) fn recover(&mut self, slot: u32, key: BlockKey) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key, slot);
        let s = &mut self.slots[slot as usize];
        s.key = key;
        s.state = SlotState::Valid;
        self.valid += 1;
        self.policy.insert(key, 1, None);
        true
    }

    /// At open: `slot` holds nothing usable.
    pub(super) fn recover_free(&mut self, slot: u32) {
        self.free.push(slot);
    }

    /// At open, from a saved index: `entries` are the indexed blocks
    /// (each slot and key once, every slot in range); every other slot is
    /// free.
    pub(super) fn load(&mut self, entries: &[(u32, BlockKey)]) {
        for &(slot, key) in entries {
            self.recover(slot, key);
        }
        for slot in 0..self.slots.len() as u32 {
            if self.slots[slot as usize].state != SlotState::Valid {
                self.free.push(slot);
            }
        }
        self.recovered();
    }

    /// (slot, key) of every indexed block, for a checkpoint.
    pub(super) fn entries(&self) -> Vec<(u32, BlockKey)> {
        self.index.iter().map(|(k, &s)| (s, *k)).collect()
    }

    /// At open, once every slot was seen: hand out low slots first.
    pub(super) fn recovered(&mut self) {
        self.free.reverse();
    }

    /// Takes a free slot, or reclaims the block the policy gives up among
    /// those no reader pins; returns the slot with the key it held when one
    /// was evicted. `None` when every slot is pinned or being written.
    fn alloc(&mut self) -> Option<(u32, Option<BlockKey>)> {
        if let Some(s) = self.free.pop() {
            return Some((s, None));
        }
        let (index, slots) = (&self.index, &self.slots);
        let key = self.policy.evict_where(&mut |k| {
            index.get(k).is_some_and(|&i| {
                slots[i as usize].state == SlotState::Valid && slots[i as usize].pins == 0
            })
        })?;
        let victim = self.index.remove(&key)?;
        self.slots[victim as usize].state = SlotState::Free;
        self.valid -= 1;
        Some((victim, Some(key)))
    }

    /// Reserves a slot for writing `key`.
    pub(super) fn reserve(&mut self, key: BlockKey) -> Reserve {
        if self.index.contains_key(&key) || self.writing.contains(&key) {
            return Reserve::Present;
        }
        let Some((slot, old)) = self.alloc() else {
            return Reserve::Full;
        };
        let s = &mut self.slots[slot as usize];
        s.state = SlotState::Writing;
        s.key = key;
        self.writing.insert(key);
        Reserve::Slot {
            slot,
            evicted: old.is_some(),
        }
    }

    /// The write of `key` to `slot` completed: index it.
    pub(super) fn written(&mut self, slot: u32, key: BlockKey) {
        self.writing.remove(&key);
        self.slots[slot as usize].state = SlotState::Valid;
        self.index.insert(key, slot);
        self.valid += 1;
        // A block weighs one slot and the policy's capacity is the slot
        // count, so this never evicts: the slot was freed or reclaimed by
        // `alloc` before the write.
        let evicted = self.policy.insert(key, 1, None);
        debug_assert!(evicted.is_empty(), "G3's policy evicted on a written block");
    }

    /// The write of `key` failed: the slot stays reserved until its header
    /// is wiped (a partly written header must not index it after a restart).
    pub(super) fn write_failed(&mut self, key: &BlockKey) {
        self.writing.remove(key);
    }

    /// Pins the slot holding `key` for a read (it cannot be reclaimed or
    /// overwritten until [`unpin`](Self::unpin)) and records the hit.
    pub(super) fn pin(&mut self, key: &BlockKey) -> Option<u32> {
        let slot = self.slot_of(key)?;
        self.slots[slot as usize].pins += 1;
        self.policy.touch(key);
        Some(slot)
    }

    /// Ends a read of `slot`. When `corrupt` and `key` still lives there,
    /// the block is dropped from the index (returns true the first time, so
    /// it is counted once however many readers saw it). A dead slot whose
    /// last pin this was is reserved for its wipe and pushed to `wipe`.
    pub(super) fn unpin(
        &mut self,
        slot: u32,
        key: &BlockKey,
        corrupt: bool,
        wipe: &mut Vec<u32>,
    ) -> bool {
        let mut dropped = false;
        if corrupt && self.index.get(key) == Some(&slot) {
            self.index.remove(key);
            self.policy.remove(key);
            self.valid -= 1;
            self.slots[slot as usize].state = SlotState::Dead;
            dropped = true;
        }
        let s = &mut self.slots[slot as usize];
        s.pins -= 1;
        if s.state == SlotState::Dead && s.pins == 0 {
            s.state = SlotState::Writing;
            wipe.push(slot);
        }
        dropped
    }

    /// Drops `key` from the index; its slot is wiped once unpinned: now
    /// (pushed to `wipe`, reserved for it) if no read holds it, else by the
    /// last [`unpin`](Self::unpin).
    pub(super) fn remove(&mut self, key: &BlockKey, wipe: &mut Vec<u32>) -> bool {
        let Some(slot) = self.index.remove(key) else {
            return false;
        };
        self.policy.remove(key);
        self.valid -= 1;
        let s = &mut self.slots[slot as usize];
        if s.pins == 0 {
            s.state = SlotState::Writing;
            wipe.push(slot);
        } else {
            s.state = SlotState::Dead;
        }
        true
    }

    /// Wiped slots are free again.
    pub(super) fn wiped(&mut self, slots: &[u32]) {
        for &slot in slots {
            self.slots[slot as usize].state = SlotState::Free;
            self.free.push(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn reserve_reclaims_with_clock_and_never_a_pinned_slot() {
        let mut t = SlotTable::new(2, EvictionKind::Clock);
        t.recover_free(0);
        t.recover_free(1);
        t.recovered();
        let fresh = |slot| Reserve::Slot {
            slot,
            evicted: false,
        };
        assert_eq!(t.reserve(k(1)), fresh(0));
        assert_eq!(t.reserve(k(1)), Reserve::Present);
        t.written(0, k(1));
        assert_eq!(t.reserve(k(2)), fresh(1));
        t.written(1, k(2));
        // Slot 0 is read (pinned): the only victim is slot 1.
        assert_eq!(t.pin(&k(1)), Some(0));
        assert_eq!(
            t.reserve(k(3)),
            Reserve::Slot {
                slot: 1,
                evicted: true
            }
        );
        assert_eq!(t.slot_of(&k(2)), None);
        // Everything pinned or being written: full.
        assert_eq!(t.reserve(k(4)), Reserve::Full);
        let mut wipe = Vec::new();
        assert!(!t.unpin(0, &k(1), false, &mut wipe));
        assert!(wipe.is_empty());
    }

    #[test]
    fn by_default_a_read_block_outlives_unread_ones_and_pinned_slots_are_never_taken() {
        let mut t = SlotTable::new(3, EvictionKind::Kvtier);
        for slot in 0..3 {
            t.recover_free(slot);
        }
        t.recovered();
        for i in 1..=3 {
            let Reserve::Slot { slot, .. } = t.reserve(k(i)) else {
                panic!("a free slot for {i}");
            };
            t.written(slot, k(i));
        }
        // k(1) is read: it outlives the unread blocks; the oldest unread
        // one goes.
        let s1 = t.pin(&k(1)).expect("k(1) is stored");
        t.unpin(s1, &k(1), false, &mut Vec::new());
        assert!(matches!(
            t.reserve(k(4)),
            Reserve::Slot { evicted: true, .. }
        ));
        assert_eq!(t.slot_of(&k(2)), None);
        assert!(t.slot_of(&k(1)).is_some() && t.slot_of(&k(3)).is_some());
        // k(4) is being written and the others are read: nothing to take.
        t.pin(&k(1));
        t.pin(&k(3));
        assert_eq!(t.reserve(k(5)), Reserve::Full);
    }

    #[test]
    fn a_corrupt_block_is_dropped_once_and_wiped_after_its_last_reader() {
        let mut t = SlotTable::new(1, EvictionKind::Clock);
        assert!(t.recover(0, k(1)));
        assert!(!t.recover(0, k(1)), "first slot seen wins");
        t.pin(&k(1));
        t.pin(&k(1));
        let mut wipe = Vec::new();
        assert!(t.unpin(0, &k(1), true, &mut wipe));
        assert!(wipe.is_empty(), "still pinned by the other reader");
        assert!(!t.unpin(0, &k(1), true, &mut wipe), "counted once");
        assert_eq!(wipe, [0]);
        assert_eq!(t.blocks(), 0);
        t.wiped(&wipe);
        assert_eq!(
            t.reserve(k(2)),
            Reserve::Slot {
                slot: 0,
                evicted: false
            }
        );
    }
}
