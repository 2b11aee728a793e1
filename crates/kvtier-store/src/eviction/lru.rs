//! LRU over the leaves of the prefix forest.
//!
//! A hit stamps a key with the next tick of a clock; eviction takes the leaf
//! with the oldest stamp. Only leaves are taken (see [`super::leaves`]), so
//! a shared head block outlives every chain hanging from it: this is the
//! "LRU" of the published KV-cache curves (a trie of blocks, leaf-only
//! eviction), and the baseline kvtier's own policy is measured against.

use std::fmt;
use std::hash::Hash;

use super::{Eviction, LeafQueue};

/// Least recently used, leaves only.
#[derive(Debug)]
pub struct Lru<K> {
    queue: LeafQueue<K>,
    capacity: u64,
    clock: u64,
}

impl<K: Hash + Eq + Clone> Lru<K> {
    /// An empty policy holding at most `capacity` weight.
    pub fn new(capacity: u64) -> Self {
        Self {
            queue: LeafQueue::new(),
            capacity,
            clock: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }
}

impl<K: Hash + Eq + Clone + Send + fmt::Debug> Eviction<K> for Lru<K> {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn used(&self) -> u64 {
        self.queue.used()
    }

    fn len(&self) -> usize {
        self.queue.len()
    }

    fn contains(&self, key: &K) -> bool {
        self.queue.contains(key)
    }

    fn touch(&mut self, key: &K) -> bool {
        let stamp = self.tick();
        self.queue.set_priority(key, stamp)
    }

    /// The new key is queued before room is made, so its parent (no
    /// longer a leaf) cannot be taken for it; when no other leaf is left
    /// to take, the new key is refused.
    fn insert(&mut self, key: K, weight: u64, parent: Option<&K>) -> Vec<K> {
        if weight > self.capacity {
            self.queue.remove(&key);
            return vec![key];
        }
        let stamp = self.tick();
        if self.queue.contains(&key) {
            self.queue.set_weight(&key, weight);
            self.queue.set_priority(&key, stamp);
        } else {
            self.queue
                .insert(key.clone(), parent.cloned(), weight, stamp);
        }
        let mut evicted = Vec::new();
        while self.queue.used() > self.capacity {
            match self.queue.pop_leaf(0, |k, _| *k != key) {
                Some((k, _, _)) => evicted.push(k),
                None => {
                    self.queue.remove(&key);
                    evicted.push(key);
                    break;
                }
            }
        }
        evicted
    }

    fn remove(&mut self, key: &K) -> Option<u64> {
        self.queue.remove(key)
    }

    fn evict_one(&mut self) -> Option<K> {
        self.queue.pop_leaf(0, |_, _| true).map(|(k, _, _)| k)
    }

    fn evict_where(&mut self, may_take: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        self.queue
            .pop_leaf(0, |k, _| may_take(k))
            .map(|(k, _, _)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recent_leaf_and_keeps_shared_heads() {
        let mut lru = Lru::new(3);
        // A chain h -> a; then b under h; h is shared.
        assert!(lru.insert('h', 1, None).is_empty());
        assert!(lru.insert('a', 1, Some(&'h')).is_empty());
        assert!(lru.insert('b', 1, Some(&'h')).is_empty());
        // h is the oldest, but not a leaf: a goes.
        assert_eq!(lru.insert('c', 1, None), vec!['a']);
        lru.touch(&'b');
        // Leaves now: b (touched), c; c is older.
        assert_eq!(lru.insert('d', 1, None), vec!['c']);
        assert!(lru.contains(&'h') && lru.contains(&'b') && lru.contains(&'d'));
    }

    #[test]
    fn a_key_with_no_room_is_refused() {
        let mut lru = Lru::new(2);
        assert_eq!(lru.insert(1, 3, None), vec![1]);
        lru.insert(1, 1, None);
        lru.insert(2, 1, Some(&1));
        // 1 and 2 form a chain; a child of 2 needs room and only the
        // leaf 2 could go, but it is the new key's parent.
        assert_eq!(lru.insert(3, 1, Some(&2)), vec![3]);
        assert_eq!(lru.len(), 2);
    }
}
