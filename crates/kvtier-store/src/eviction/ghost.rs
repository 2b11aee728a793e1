//! The ghost list of a policy: keys it evicted recently, kept without
//! their values, so a key that comes back soon can be told apart from a new
//! one (S3-FIFO's ghost queue, kvtier's two ghosts).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Keys recently evicted, oldest first, with lazy deletion of the ones
/// taken back.
#[derive(Debug)]
pub(super) struct Ghost<K> {
    pub(super) members: HashMap<K, u64>,
    pub(super) slots: VecDeque<(K, u64)>,
}

impl<K: Hash + Eq + Clone> Ghost<K> {
    pub(super) fn new() -> Self {
        Self {
            members: HashMap::new(),
            slots: VecDeque::new(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.members.len()
    }

    pub(super) fn push(&mut self, key: K, seq: u64) {
        // A previous slot of the same key, if any, turns stale here.
        self.members.insert(key.clone(), seq);
        self.slots.push_back((key, seq));
        self.maybe_compact();
    }

    /// Removes `key` from the ghost; true if it was there (a ghost hit).
    pub(super) fn take(&mut self, key: &K) -> bool {
        let hit = self.members.remove(key).is_some();
        if hit {
            self.maybe_compact();
        }
        hit
    }

    /// Drops the oldest ghosts until at most `cap` remain.
    pub(super) fn trim(&mut self, cap: usize) {
        while self.members.len() > cap {
            let Some((key, seq)) = self.slots.pop_front() else {
                break;
            };
            if self.members.get(&key) == Some(&seq) {
                self.members.remove(&key);
            }
        }
        self.maybe_compact();
    }

    fn maybe_compact(&mut self) {
        let live = self.members.len();
        if self.slots.len() - live > live {
            let members = &self.members;
            self.slots
                .retain(|(key, seq)| members.get(key) == Some(seq));
            debug_assert_eq!(self.slots.len(), live);
        }
    }
}
