//! G3 admission filter: write a block to disk only on its second sighting.
//!
//! Most blocks of a one-off prompt are never read again; writing each of them
//! to an SSD costs wear and write bandwidth for nothing. With the filter on,
//! a block evicted from G2 reaches G3 only if it was seen (put or hit) at
//! least twice within a window of recent keys. The window is a FIFO of
//! distinct keys, so memory stays bounded (about 40 bytes per key).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use crate::key::BlockKey;

/// Counts sightings of recent keys within a bounded window (block keys in
/// the store; any key in the trace simulator).
#[derive(Debug)]
pub struct SecondSighting<K = BlockKey> {
    counts: HashMap<K, u8>,
    order: VecDeque<K>,
    window: usize,
}

impl<K: Hash + Eq + Clone> SecondSighting<K> {
    /// A filter remembering at most `window` distinct keys (at least 1).
    pub fn new(window: usize) -> Self {
        Self {
            counts: HashMap::new(),
            order: VecDeque::new(),
            window: window.max(1),
        }
    }

    /// Records one sighting of `key`.
    pub fn record(&mut self, key: &K) {
        if let Some(c) = self.counts.get_mut(key) {
            *c = c.saturating_add(1);
            return;
        }
        self.counts.insert(key.clone(), 1);
        self.order.push_back(key.clone());
        while self.order.len() > self.window {
            if let Some(old) = self.order.pop_front() {
                self.counts.remove(&old);
            }
        }
    }

    /// True once `key` has been seen at least twice within the window.
    pub fn admits(&self, key: &K) -> bool {
        self.counts.get(key).is_some_and(|&c| c >= 2)
    }

    /// Distinct keys remembered now.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// True when no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn admits_on_second_sighting_only() {
        let mut f = SecondSighting::new(10);
        assert!(!f.admits(&k(1)));
        f.record(&k(1));
        assert!(!f.admits(&k(1)));
        f.record(&k(1));
        assert!(f.admits(&k(1)));
        assert!(!f.admits(&k(2)));
    }

    #[test]
    fn window_forgets_old_keys_and_stays_bounded() {
        let mut f = SecondSighting::new(3);
        f.record(&k(1));
        for i in 2..=4 {
            f.record(&k(i));
        }
        assert_eq!(f.len(), 3);
        f.record(&k(1)); // k(1) aged out: this is a first sighting again
        assert!(!f.admits(&k(1)));
        assert_eq!(f.len(), 3);
    }
}
