//! FIFO, flat over keys: the oldest insertion goes first, whatever its
//! place in a chain and however often it was hit. The simplest baseline of
//! the published KV-cache curves.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::Hash;

use super::Eviction;

/// First in, first out.
#[derive(Debug)]
pub struct Fifo<K> {
    resident: HashMap<K, (u64, u64)>,
    order: VecDeque<(K, u64)>,
    capacity: u64,
    used: u64,
    seq: u64,
}

impl<K: Hash + Eq + Clone> Fifo<K> {
    /// An empty policy holding at most `capacity` weight.
    pub fn new(capacity: u64) -> Self {
        Self {
            resident: HashMap::new(),
            order: VecDeque::new(),
            capacity,
            used: 0,
            seq: 0,
        }
    }

    /// Drops stale queue slots once they outnumber the resident keys.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.resident.len() + 64 {
            let resident = &self.resident;
            self.order
                .retain(|(k, s)| resident.get(k).is_some_and(|(_, seq)| seq == s));
        }
    }
}

impl<K: Hash + Eq + Clone + Send + fmt::Debug> Eviction<K> for Fifo<K> {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn used(&self) -> u64 {
        self.used
    }

    fn len(&self) -> usize {
        self.resident.len()
    }

    fn contains(&self, key: &K) -> bool {
        self.resident.contains_key(key)
    }

    fn touch(&mut self, key: &K) -> bool {
        self.resident.contains_key(key)
    }

    fn insert(&mut self, key: K, weight: u64, _parent: Option<&K>) -> Vec<K> {
        if weight > self.capacity {
            self.remove(&key);
            return vec![key];
        }
        let mut evicted = Vec::new();
        if let Some((w, _)) = self.resident.get_mut(&key) {
            self.used = self.used - *w + weight;
            *w = weight;
        } else {
            while self.used + weight > self.capacity {
                match self.evict_one() {
                    Some(k) => evicted.push(k),
                    None => break,
                }
            }
            self.seq += 1;
            self.resident.insert(key.clone(), (weight, self.seq));
            self.order.push_back((key, self.seq));
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
        let (w, _) = self.resident.remove(key)?;
        self.used -= w;
        self.compact();
        Some(w)
    }

    fn evict_one(&mut self) -> Option<K> {
        self.evict_where(&mut |_| true)
    }

    fn evict_where(&mut self, may_take: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        let mut refused = Vec::new();
        let mut found = None;
        while let Some((k, s)) = self.order.pop_front() {
            let Some(&(w, seq)) = self.resident.get(&k) else {
                continue;
            };
            if seq != s {
                continue;
            }
            if !may_take(&k) {
                refused.push((k, s));
                continue;
            }
            self.resident.remove(&k);
            self.used -= w;
            found = Some(k);
            break;
        }
        // Refused keys keep their place at the head, in order.
        for slot in refused.into_iter().rev() {
            self.order.push_front(slot);
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_insertion_first_hits_change_nothing() {
        let mut f = Fifo::new(2);
        f.insert('a', 1, None);
        f.insert('b', 1, Some(&'a'));
        f.touch(&'a');
        assert_eq!(f.insert('c', 1, None), vec!['a']);
        assert_eq!(f.insert('d', 2, None), vec!['b', 'c']);
        assert_eq!(f.used(), 2);
        assert_eq!(f.remove(&'d'), Some(2));
        assert_eq!(f.evict_one(), None);
    }
}
