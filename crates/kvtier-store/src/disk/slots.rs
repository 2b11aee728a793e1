//! G3's slot table: which key lives in which slot, which slots are free,
//! pinned by readers or being written, and the CLOCK reference bits that
//! choose a slot to reclaim ([`crate::eviction::clock`]).
//!
//! Pure bookkeeping under the tier's lock; no I/O happens here.

use std::collections::{HashMap, HashSet};

use crate::eviction::{Visit, sweep};
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
    referenced: bool,
    pins: u32,
}

/// Every slot of a G3 tier and its index.
#[derive(Debug)]
pub(super) struct SlotTable {
    index: HashMap<BlockKey, u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    hand: usize,
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
    /// `total` free slots.
    pub(super) fn new(total: u32) -> Self {
        Self {
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

    /// Takes a free slot, or reclaims one with CLOCK; returns it with the
    /// key it held when one was evicted. `None` when every slot is pinned or
    /// being written.
    fn alloc(&mut self) -> Option<(u32, Option<BlockKey>)> {
        if let Some(s) = self.free.pop() {
            return Some((s, None));
        }
        let slots = &mut self.slots;
        let victim = sweep(&mut self.hand, slots.len(), |i| {
            let s = &mut slots[i];
            if s.state != SlotState::Valid || s.pins > 0 {
                Visit::Skip
            } else if s.referenced {
                s.referenced = false;
                Visit::SecondChance
            } else {
                Visit::Take
            }
        })?;
        let s = &mut self.slots[victim];
        let key = s.key;
        s.state = SlotState::Free;
        self.index.remove(&key);
        self.valid -= 1;
        Some((victim as u32, Some(key)))
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
        s.referenced = false;
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
        let s = &mut self.slots[slot as usize];
        s.pins += 1;
        s.referenced = true;
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
        let mut t = SlotTable::new(2);
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
    fn a_corrupt_block_is_dropped_once_and_wiped_after_its_last_reader() {
        let mut t = SlotTable::new(1);
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
