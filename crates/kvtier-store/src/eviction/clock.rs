//! CLOCK (second chance) over a fixed array of slots.
//!
//! A hit sets a slot's reference bit; the hand walks the slots in a circle,
//! clears set bits as it passes and stops at the first unreferenced slot it
//! may take. Slots it may not take (empty, pinned by a reader, being
//! written) are passed over. Two turns of the hand visit every slot with its
//! bit cleared once, so a victim is found whenever one exists.
//!
//! [`sweep`] is the hand's walk, over any array whose owner says what it
//! sees at each place; [`Clock`] is CLOCK over keys behind the
//! [`Eviction`] trait (G3's rule over its slots before kvtier's own, and a
//! policy the trace simulator can run).

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;

use super::Eviction;

/// What the hand finds at one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    /// Not a candidate (free, pinned, being written): pass over it.
    Skip,
    /// Referenced since the last pass: the visitor cleared its bit; pass
    /// over it this time.
    SecondChance,
    /// Unreferenced and unpinned: take it.
    Take,
}

/// Moves `hand` round `n` slots, at most two turns, calling `visit` at each,
/// and returns the first slot `visit` takes (the hand is left just past
/// it). `None` when no slot can be taken.
pub fn sweep(hand: &mut usize, n: usize, mut visit: impl FnMut(usize) -> Visit) -> Option<usize> {
    if n == 0 {
        return None;
    }
    for _ in 0..2 * n {
        let i = *hand % n;
        *hand = (i + 1) % n;
        if visit(i) == Visit::Take {
            return Some(i);
        }
    }
    None
}

/// CLOCK over keys: a ring of resident keys with reference bits.
#[derive(Debug)]
pub struct Clock<K> {
    /// (key, weight, referenced); `None` is a free place in the ring.
    ring: Vec<Option<(K, u64, bool)>>,
    index: HashMap<K, usize>,
    free: Vec<usize>,
    hand: usize,
    capacity: u64,
    used: u64,
}

impl<K: Hash + Eq + Clone> Clock<K> {
    /// An empty policy holding at most `capacity` weight.
    pub fn new(capacity: u64) -> Self {
        Self {
            ring: Vec::new(),
            index: HashMap::new(),
            free: Vec::new(),
            hand: 0,
            capacity,
            used: 0,
        }
    }

    fn take(&mut self, i: usize) -> Option<(K, u64)> {
        let (key, weight, _) = self.ring.get_mut(i)?.take()?;
        self.index.remove(&key);
        self.free.push(i);
        self.used -= weight;
        Some((key, weight))
    }
}

impl<K: Hash + Eq + Clone + Send + fmt::Debug> Eviction<K> for Clock<K> {
    fn name(&self) -> &'static str {
        "clock"
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn used(&self) -> u64 {
        self.used
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn contains(&self, key: &K) -> bool {
        self.index.contains_key(key)
    }

    fn touch(&mut self, key: &K) -> bool {
        match self.index.get(key).and_then(|&i| self.ring[i].as_mut()) {
            Some(entry) => {
                entry.2 = true;
                true
            }
            None => false,
        }
    }

    /// Flat over keys: the parent is not used.
    fn insert(&mut self, key: K, weight: u64, _parent: Option<&K>) -> Vec<K> {
        if weight > self.capacity {
            self.remove(&key);
            return vec![key];
        }
        let mut evicted = Vec::new();
        if let Some(&i) = self.index.get(&key) {
            if let Some(entry) = self.ring[i].as_mut() {
                self.used = self.used - entry.1 + weight;
                entry.1 = weight;
            }
        } else {
            while self.used + weight > self.capacity {
                match self.evict_one() {
                    Some(k) => evicted.push(k),
                    None => break,
                }
            }
            let i = self.free.pop().unwrap_or_else(|| {
                self.ring.push(None);
                self.ring.len() - 1
            });
            self.ring[i] = Some((key.clone(), weight, false));
            self.index.insert(key.clone(), i);
            self.used += weight;
        }
        while self.used > self.capacity {
            match self.evict_one() {
                Some(k) => evicted.push(k),
                None => break,
            }
        }
        evicted
    }

    fn remove(&mut self, key: &K) -> Option<u64> {
        let i = *self.index.get(key)?;
        self.take(i).map(|(_, w)| w)
    }

    fn evict_one(&mut self) -> Option<K> {
        self.evict_where(&mut |_| true)
    }

    fn evict_where(&mut self, may_take: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        let ring = &mut self.ring;
        let victim = sweep(&mut self.hand, ring.len(), |i| match ring[i].as_mut() {
            None => Visit::Skip,
            Some(entry) if !may_take(&entry.0) => Visit::Skip,
            Some(entry) if entry.2 => {
                entry.2 = false;
                Visit::SecondChance
            }
            Some(_) => Visit::Take,
        })?;
        self.take(victim).map(|(k, _)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A referenced / pinned slot array driven the way G3 drives it.
    fn pick(referenced: &mut [bool], pinned: &[bool], hand: &mut usize) -> Option<usize> {
        sweep(hand, referenced.len(), |i| {
            if pinned[i] {
                Visit::Skip
            } else if referenced[i] {
                referenced[i] = false;
                Visit::SecondChance
            } else {
                Visit::Take
            }
        })
    }

    #[test]
    fn second_chance_then_take_and_pinned_never() {
        let mut referenced = [true, false, true, false];
        let pinned = [false, true, false, false];
        let mut hand = 0;
        // 0 referenced (cleared), 1 pinned, 2 referenced (cleared), 3 taken.
        assert_eq!(pick(&mut referenced, &pinned, &mut hand), Some(3));
        assert_eq!(hand, 0);
        // Next: 0 has lost its bit.
        assert_eq!(pick(&mut referenced, &pinned, &mut hand), Some(0));
        assert_eq!(pick(&mut referenced, &pinned, &mut hand), Some(2));
        assert_eq!(referenced, [false; 4]);
    }

    #[test]
    fn keyed_clock_gives_a_hit_key_a_second_chance() {
        let mut c = Clock::new(3);
        for k in ['a', 'b', 'c'] {
            assert!(c.insert(k, 1, None).is_empty());
        }
        c.touch(&'a');
        // The hand passes a (clearing its bit) and takes b.
        assert_eq!(c.insert('d', 1, None), vec!['b']);
        // Next: c (unreferenced) before a.
        assert_eq!(c.insert('e', 1, None), vec!['c']);
        assert_eq!(c.insert('f', 2, None), vec!['a', 'd']);
        assert_eq!(c.used(), 3);
        assert_eq!(c.remove(&'f'), Some(2));
        assert_eq!(c.insert('g', 4, None), vec!['g']);
    }

    #[test]
    fn all_referenced_takes_after_one_turn_and_all_pinned_takes_none() {
        let mut referenced = [true; 3];
        let mut hand = 1;
        assert_eq!(pick(&mut referenced, &[false; 3], &mut hand), Some(1));
        assert_eq!(pick(&mut [false; 3], &[true; 3], &mut hand), None);
        assert_eq!(sweep(&mut hand, 0, |_| Visit::Take), None);
    }
}
