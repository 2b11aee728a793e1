//! The resident blocks of a prefix cache as a forest, with its leaves in
//! priority order.
//!
//! A prefix block is useless without its parents: a lookup stops at the
//! first missing block, so evicting a head block strands the whole chain
//! behind it. A chain-aware policy therefore evicts only leaves (resident
//! blocks no resident block names as its parent), and among them the one
//! with the lowest priority; what the priority means (a recency stamp, a
//! frequency score, the distance to the next use) is the policy's.
//!
//! A key sits in one of a few classes (a segmented policy's probation and
//! main, say); leaf-ness is across classes, and each class has its own
//! order, so a policy asks for the lowest leaf of a class.
//!
//! [`LeafQueue`] keeps the resident keys, each key's parent and count of
//! resident children, and per class a binary heap of leaves with lazy deletion: an
//! entry whose key has since changed priority, gained a child or left is
//! stale and skipped when popped, and the heap is rebuilt when its stale
//! entries outnumber the resident keys. Every operation is O(log n)
//! amortised.
//!
//! Child counts are exact whatever the order keys arrive in: a key whose
//! parent is not resident (saved by another thread first, or the parent was
//! removed) is counted against the absent parent, and the parent takes the
//! count when it comes (back).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;

/// One resident key.
#[derive(Debug, Clone)]
struct Node<K> {
    key: K,
    parent: Option<K>,
    weight: u64,
    children: u32,
    priority: u64,
    /// Bumped on every priority or class change, so older heap entries
    /// turn stale.
    version: u32,
    /// The class (an index into the heaps).
    class: usize,
    /// Order of first insertion; ties of priority go to the newest key
    /// (the deepest block of the most recent chain).
    born: u64,
}

/// A heap entry: lowest priority first, then the newest key.
type HeapEntry = Reverse<(u64, Reverse<u64>, usize, u32)>;

/// Resident keys with parent links; pops the lowest-priority leaf.
#[derive(Debug)]
pub struct LeafQueue<K> {
    index: HashMap<K, usize>,
    nodes: Vec<Option<Node<K>>>,
    free: Vec<usize>,
    heaps: Vec<BinaryHeap<HeapEntry>>,
    /// Resident keys per absent parent they name.
    waiting: HashMap<K, u32>,
    /// Weight per class.
    used: Vec<u64>,
    born: u64,
}

/// The number of classes a queue keeps.
pub const CLASSES: usize = 2;

impl<K: Hash + Eq + Clone> Default for LeafQueue<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Hash + Eq + Clone> LeafQueue<K> {
    /// An empty queue.
    pub fn new() -> Self {
        Self {
            index: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            heaps: (0..CLASSES).map(|_| BinaryHeap::new()).collect(),
            waiting: HashMap::new(),
            used: vec![0; CLASSES],
            born: 0,
        }
    }

    /// Number of resident keys.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no key is resident.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Sum of the resident keys' weights.
    pub fn used(&self) -> u64 {
        self.used.iter().sum()
    }

    /// Sum of the weights of the resident keys of `class`.
    pub fn used_in(&self, class: usize) -> u64 {
        self.used.get(class).copied().unwrap_or(0)
    }

    /// The class of a resident key.
    pub fn class(&self, key: &K) -> Option<usize> {
        self.node(key).map(|n| n.class)
    }

    /// True when `key` is resident.
    pub fn contains(&self, key: &K) -> bool {
        self.index.contains_key(key)
    }

    /// The weight of a resident key.
    pub fn weight(&self, key: &K) -> Option<u64> {
        self.node(key).map(|n| n.weight)
    }

    /// The priority of a resident key.
    pub fn priority(&self, key: &K) -> Option<u64> {
        self.node(key).map(|n| n.priority)
    }

    /// True when `key` is resident and no resident key names it as parent.
    pub fn is_leaf(&self, key: &K) -> bool {
        self.node(key).is_some_and(|n| n.children == 0)
    }

    /// Adds `key` in class 0 under `parent` (when known and resident, it
    /// gains a child and stops being a leaf). False, and nothing changes,
    /// when the key is already resident.
    pub fn insert(&mut self, key: K, parent: Option<K>, weight: u64, priority: u64) -> bool {
        self.insert_in(0, key, parent, weight, priority)
    }

    /// [`LeafQueue::insert`] into `class` (below [`CLASSES`]; higher ones
    /// are taken as the last).
    pub fn insert_in(
        &mut self,
        class: usize,
        key: K,
        parent: Option<K>,
        weight: u64,
        priority: u64,
    ) -> bool {
        let class = class.min(CLASSES - 1);
        if self.index.contains_key(&key) {
            return false;
        }
        let parent = parent.filter(|p| *p != key);
        if let Some(p) = &parent {
            match self.index.get(p).copied() {
                Some(slot) => {
                    if let Some(node) = self.nodes[slot].as_mut() {
                        node.children += 1;
                    }
                }
                None => *self.waiting.entry(p.clone()).or_insert(0) += 1,
            }
        }
        let children = self.waiting.remove(&key).unwrap_or(0);
        let node = Node {
            key: key.clone(),
            parent,
            weight,
            children,
            priority,
            version: 0,
            class,
            born: self.born,
        };
        self.born += 1;
        let slot = match self.free.pop() {
            Some(s) => {
                self.nodes[s] = Some(node);
                s
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        self.index.insert(key, slot);
        self.used[class] += weight;
        self.push(slot);
        true
    }

    /// Moves a resident key to `class` with a new priority; false when
    /// absent.
    pub fn set_class(&mut self, key: &K, class: usize, priority: u64) -> bool {
        let class = class.min(CLASSES - 1);
        let Some(&slot) = self.index.get(key) else {
            return false;
        };
        if let Some(node) = self.nodes[slot].as_mut() {
            self.used[node.class] -= node.weight;
            self.used[class] += node.weight;
            node.class = class;
        }
        self.set_priority(key, priority)
    }

    /// Sets a resident key's priority; false when absent.
    pub fn set_priority(&mut self, key: &K, priority: u64) -> bool {
        let Some(&slot) = self.index.get(key) else {
            return false;
        };
        if let Some(node) = self.nodes[slot].as_mut() {
            node.priority = priority;
            node.version = node.version.wrapping_add(1);
        }
        self.push(slot);
        self.maybe_rebuild();
        true
    }

    /// Changes a resident key's weight; returns the old one.
    pub fn set_weight(&mut self, key: &K, weight: u64) -> Option<u64> {
        let slot = *self.index.get(key)?;
        let node = self.nodes[slot].as_mut()?;
        let old = node.weight;
        node.weight = weight;
        self.used[node.class] = self.used[node.class] - old + weight;
        Some(old)
    }

    /// Removes a key (leaf or not); returns its weight.
    pub fn remove(&mut self, key: &K) -> Option<u64> {
        let slot = self.index.remove(key)?;
        let node = self.nodes[slot].take()?;
        self.free.push(slot);
        self.used[node.class] -= node.weight;
        if node.children > 0 {
            self.waiting.insert(node.key.clone(), node.children);
        }
        self.release_parent(node.parent.as_ref());
        self.maybe_rebuild();
        Some(node.weight)
    }

    /// Removes and returns the lowest-priority leaf of `class` that
    /// `may_take` accepts, with its weight and priority. Leaves it refuses
    /// stay.
    pub fn pop_leaf(
        &mut self,
        class: usize,
        may_take: impl FnMut(&K, u64) -> bool,
    ) -> Option<(K, u64, u64)> {
        let Reverse((_, _, slot, _)) = self.seek(class, may_take)?;
        let node = self.nodes[slot].take()?;
        self.free.push(slot);
        self.index.remove(&node.key);
        self.used[node.class] -= node.weight;
        self.release_parent(node.parent.as_ref());
        self.maybe_rebuild();
        Some((node.key, node.weight, node.priority))
    }

    /// The lowest-priority leaf of `class` that `may_take` accepts, left
    /// in place, with its priority.
    pub fn peek_leaf(
        &mut self,
        class: usize,
        may_take: impl FnMut(&K, u64) -> bool,
    ) -> Option<(K, u64)> {
        let class = class.min(CLASSES - 1);
        let entry = self.seek(class, may_take)?;
        let Reverse((priority, _, slot, _)) = entry;
        let key = self.nodes[slot].as_ref()?.key.clone();
        self.heaps[class].push(entry);
        Some((key, priority))
    }

    /// Takes off `class`'s heap the entry of the lowest-priority leaf
    /// `may_take` accepts (stale entries are dropped on the way, refused
    /// ones put back).
    fn seek(
        &mut self,
        class: usize,
        mut may_take: impl FnMut(&K, u64) -> bool,
    ) -> Option<HeapEntry> {
        let class = class.min(CLASSES - 1);
        let mut refused = Vec::new();
        let mut found = None;
        while let Some(entry) = self.heaps[class].pop() {
            let Reverse((priority, _, slot, version)) = entry;
            if !self.live(slot, version, priority) {
                continue;
            }
            let Some(node) = self.nodes[slot].as_ref() else {
                continue;
            };
            if may_take(&node.key, priority) {
                found = Some(entry);
                break;
            }
            refused.push(entry);
        }
        self.heaps[class].extend(refused);
        found
    }

    /// True when a heap entry still describes a resident leaf.
    fn live(&self, slot: usize, version: u32, priority: u64) -> bool {
        self.nodes
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|n| n.version == version && n.priority == priority && n.children == 0)
    }

    /// The resident keys, any order.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.index.keys()
    }

    fn node(&self, key: &K) -> Option<&Node<K>> {
        self.index.get(key).and_then(|&s| self.nodes[s].as_ref())
    }

    /// Queues `slot` if it is a leaf.
    fn push(&mut self, slot: usize) {
        if let Some(n) = self.nodes[slot].as_ref()
            && n.children == 0
        {
            self.heaps[n.class].push(Reverse((n.priority, Reverse(n.born), slot, n.version)));
        }
    }

    /// A child of `parent` left: the parent may have become a leaf.
    fn release_parent(&mut self, parent: Option<&K>) {
        let Some(parent) = parent else {
            return;
        };
        let Some(&p) = self.index.get(parent) else {
            if let Some(n) = self.waiting.get_mut(parent) {
                *n -= 1;
                if *n == 0 {
                    self.waiting.remove(parent);
                }
            }
            return;
        };
        if let Some(node) = self.nodes[p].as_mut() {
            node.children = node.children.saturating_sub(1);
        }
        self.push(p);
    }

    /// Rebuilds the heap from the resident leaves once stale entries
    /// outnumber the resident keys.
    fn maybe_rebuild(&mut self) {
        let entries: usize = self.heaps.iter().map(BinaryHeap::len).sum();
        if entries <= 2 * self.index.len() + 64 {
            return;
        }
        for heap in &mut self.heaps {
            heap.clear();
        }
        for (slot, n) in self.nodes.iter().enumerate() {
            if let Some(n) = n.as_ref().filter(|n| n.children == 0) {
                self.heaps[n.class].push(Reverse((n.priority, Reverse(n.born), slot, n.version)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_leaves_are_popped_lowest_priority_first() {
        let mut q = LeafQueue::new();
        // Chain 1 -> 2 -> 3 and a branch 1 -> 4.
        q.insert(1u32, None, 1, 10);
        q.insert(2, Some(1), 1, 5);
        q.insert(3, Some(2), 1, 20);
        q.insert(4, Some(1), 1, 7);
        assert!(!q.is_leaf(&1) && !q.is_leaf(&2));
        // 2 has the lowest priority but is not a leaf: 4 goes first.
        assert_eq!(q.pop_leaf(0, |_, _| true), Some((4, 1, 7)));
        assert_eq!(q.pop_leaf(0, |_, _| true), Some((3, 1, 20)));
        // 2 became a leaf when 3 left, and 1 when 2 and 4 left.
        assert_eq!(q.pop_leaf(0, |_, _| true), Some((2, 1, 5)));
        assert_eq!(q.pop_leaf(0, |_, _| true), Some((1, 1, 10)));
        assert_eq!(q.pop_leaf(0, |_, _| true), None);
        assert_eq!(q.used(), 0);
    }

    #[test]
    fn refused_leaves_stay_and_priorities_update() {
        let mut q = LeafQueue::new();
        q.insert('a', None, 2, 1);
        q.insert('b', None, 3, 2);
        assert_eq!(q.pop_leaf(0, |k, _| *k != 'a'), Some(('b', 3, 2)));
        assert!(q.contains(&'a'));
        q.insert('c', None, 1, 0);
        q.set_priority(&'c', 9);
        assert_eq!(q.pop_leaf(0, |_, _| true), Some(('a', 2, 1)));
        assert_eq!(q.priority(&'c'), Some(9));
    }

    #[test]
    fn a_parent_arriving_after_its_child_counts_it_and_ties_go_to_the_newest() {
        let mut q = LeafQueue::new();
        // The child first (another thread saved it), then its parent.
        q.insert(2u8, Some(1), 1, 0);
        q.insert(1, None, 1, 0);
        q.insert(3, None, 1, 0);
        assert!(!q.is_leaf(&1));
        // Equal priorities: the newest leaf first; 1 only after its child.
        assert_eq!(q.pop_leaf(0, |_, _| true).map(|e| e.0), Some(3));
        assert_eq!(q.pop_leaf(0, |_, _| true).map(|e| e.0), Some(2));
        assert_eq!(q.pop_leaf(0, |_, _| true).map(|e| e.0), Some(1));
        // A removed parent that comes back counts its resident children.
        q.insert(1, None, 1, 0);
        q.insert(2, Some(1), 1, 0);
        assert_eq!(q.remove(&1), Some(1));
        q.insert(1, None, 1, 0);
        assert!(!q.is_leaf(&1) && q.is_leaf(&2));
        q.remove(&2);
        assert!(q.is_leaf(&1));
        assert!(q.waiting.is_empty());
    }

    #[test]
    fn stale_entries_are_bounded() {
        let mut q = LeafQueue::new();
        q.insert(0u32, None, 1, 0);
        for p in 0..10_000 {
            q.set_priority(&0, p);
            q.insert(1, None, 1, 0);
            q.remove(&1);
        }
        let entries: usize = q.heaps.iter().map(BinaryHeap::len).sum();
        assert!(entries <= 2 * q.len() + 65, "{entries}");
    }
}
