//! kvtier's eviction policy for prefix KV: adaptive replacement (ARC's
//! idea) over the leaves of the prefix forest.
//!
//! # What the traffic asks for
//!
//! Measured on public traces (Mooncake's Kimi conversations and its
//! synthetic multi-turn trace, RAGPulse, Claude Code sessions; figures and
//! commands in docs/results.md), a policy for prefix blocks has to get four
//! things right at once:
//!
//! * **A block is useless without its parents.** Evicting a head block
//!   strands the chain behind it, so only leaves are evicted
//!   ([`LeafQueue`]). Flat policies (FIFO, S3-FIFO) lose a large share of
//!   LRU's hits at mid capacities for this alone (docs/results.md).
//! * **Most new blocks are never read again** (a prompt's unique tail, a
//!   one-off request): they must not push out reused ones. New blocks
//!   enter on probation; a hit promotes them to main. This is what S3-FIFO
//!   gets right at small capacities.
//! * **How long probation should last depends on the traffic.** A
//!   conversation comes back after a think time: a short probation loses
//!   the next turn at mid capacities (where plain LRU wins), a long one
//!   lets one-off prompts flush the cache at small ones (where S3-FIFO
//!   wins). So the split adapts as ARC's does: each class has a ghost list
//!   of the keys it evicted; a key coming back from probation's ghost says
//!   probation was too short and grows its target, one from main's ghost
//!   says main was too small and shrinks it.
//! * **Reuse predicts reuse.** In main, a block hit since it came in ranks
//!   half a cache's worth of accesses ahead of one that was not, so a hot
//!   shared prefix outlives a session that was promoted once.
//!
//! Within each class the order is recency (an access clock); eviction
//! takes the oldest leaf of probation while probation holds more than its
//! target, else of main, else whichever has a leaf. Keys coming back from
//! either ghost go straight to main.
//!
//! Weights (bytes in G2, 1 per block in the simulator) count against the
//! capacity and move the target; the ghosts and the hit bonus are counted
//! in keys, so the policy behaves the same whatever a block weighs.

use std::fmt;
use std::hash::Hash;

use super::ghost::Ghost;
use super::{Eviction, LeafQueue};

/// The class of blocks not hit since they came in.
const PROBATION: usize = 0;
/// The class of blocks hit since, or back from a ghost.
const MAIN: usize = 1;

/// Probation's first target, in percent of the capacity: the middle, so
/// that adaptation has as far to go either way.
const FIRST_TARGET_PERCENT: u64 = 50;

/// How many blocks' weight one ghost hit moves the target (times ARC's
/// ratio of the ghost sizes). ARC moves it by one; over hundreds of
/// thousands of blocks that adapts slower than traffic changes. The
/// simulator's curves on the public traces hardly move for small steps
/// around this one (docs/decisions.md).
const STEP_BLOCKS: u64 = 4;

/// Each ghost remembers this many times the resident key count.
const GHOST_PER_RESIDENT: usize = 2;

/// The fewest keys a ghost may remember (a nearly empty cache still
/// learns).
const GHOST_MIN: usize = 64;

/// Adaptive replacement over the leaves of the prefix forest.
#[derive(Debug)]
pub struct PrefixArc<K> {
    queue: LeafQueue<K>,
    /// The keys evicted from each class, oldest first.
    ghosts: [Ghost<K>; 2],
    /// Numbers the ghosts' entries.
    ghost_seq: u64,
    capacity: u64,
    /// Weight probation may hold before it is evicted from first.
    target: u64,
    /// Ticks on every access.
    clock: u64,
}

impl<K: Hash + Eq + Clone> PrefixArc<K> {
    /// An empty policy holding at most `capacity` weight.
    pub fn new(capacity: u64) -> Self {
        Self {
            queue: LeafQueue::new(),
            ghosts: [Ghost::new(), Ghost::new()],
            ghost_seq: 0,
            capacity,
            target: capacity / 100 * FIRST_TARGET_PERCENT
                + capacity % 100 * FIRST_TARGET_PERCENT / 100,
            clock: 0,
        }
    }

    /// Probation's target weight now.
    pub fn probation_target(&self) -> u64 {
        self.target
    }

    /// The weight on probation now.
    pub fn probation_used(&self) -> u64 {
        self.queue.used_in(PROBATION)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The priority of a key accessed now: its recency, and half a
    /// cache's worth of accesses more when it was hit since it came in.
    fn priority(&mut self, was_hit: bool) -> u64 {
        let now = self.tick();
        if was_hit {
            now + (self.queue.len() as u64) / 2
        } else {
            now
        }
    }

    /// The class a new key enters, moving the target when it comes back
    /// from a ghost.
    fn admit(&mut self, key: &K, weight: u64) -> usize {
        let [probation, main] = &mut self.ghosts;
        if probation.take(key) {
            let ratio = (main.len() / probation.len().max(1)).max(1) as u64;
            self.target = (self.target + ratio * STEP_BLOCKS * weight).min(self.capacity);
            MAIN
        } else if main.take(key) {
            let ratio = (probation.len() / main.len().max(1)).max(1) as u64;
            self.target = self.target.saturating_sub(ratio * STEP_BLOCKS * weight);
            MAIN
        } else {
            PROBATION
        }
    }

    /// Evicts one leaf `may_take` accepts: from probation while it is over
    /// its target, else from main; from the other when the first has no
    /// such leaf.
    fn evict(&mut self, may_take: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        let order = if self.queue.used_in(PROBATION) > self.target {
            [PROBATION, MAIN]
        } else {
            [MAIN, PROBATION]
        };
        for class in order {
            if let Some((k, _, _)) = self.queue.pop_leaf(class, |k, _| may_take(k)) {
                let cap = (GHOST_PER_RESIDENT * self.queue.len()).max(GHOST_MIN);
                self.ghost_seq += 1;
                self.ghosts[class].push(k.clone(), self.ghost_seq);
                self.ghosts[class].trim(cap);
                return Some(k);
            }
        }
        None
    }
}

impl<K: Hash + Eq + Clone + Send + fmt::Debug> Eviction<K> for PrefixArc<K> {
    fn name(&self) -> &'static str {
        "kvtier"
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
        if !self.queue.contains(key) {
            return false;
        }
        let p = self.priority(true);
        self.queue.set_class(key, MAIN, p)
    }

    fn insert(&mut self, key: K, weight: u64, parent: Option<&K>) -> Vec<K> {
        if weight > self.capacity {
            self.remove(&key);
            return vec![key];
        }
        if self.queue.contains(&key) {
            self.queue.set_weight(&key, weight);
        } else {
            let class = self.admit(&key, weight);
            let p = self.priority(false);
            self.queue
                .insert_in(class, key.clone(), parent.cloned(), weight, p);
        }
        let mut evicted = Vec::new();
        while self.queue.used() > self.capacity {
            match self.evict(&mut |k| *k != key) {
                Some(k) => evicted.push(k),
                None => {
                    self.remove(&key);
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
        self.evict(&mut |_| true)
    }

    fn evict_where(&mut self, may_take: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        self.evict(may_take)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_off_blocks_leave_before_reused_ones() {
        let mut p = PrefixArc::new(4);
        // A shared head and its child, both hit: main.
        p.insert(1u32, 1, None);
        p.insert(2, 1, Some(&1));
        p.touch(&1);
        p.touch(&2);
        // One-off blocks on probation (target 2).
        p.insert(10, 1, None);
        p.insert(11, 1, None);
        // 12 makes probation 3, over its target: its oldest leaf goes,
        // though main's blocks are older.
        assert_eq!(p.insert(12, 1, None), vec![10]);
        // 11 is hit: main. With probation at its target, room for 13 comes
        // from main: its oldest leaf, 2, never its parent 1.
        p.touch(&11);
        assert_eq!(p.insert(13, 1, None), vec![2]);
        assert!(p.contains(&1) && p.contains(&11) && p.contains(&12));
    }

    #[test]
    fn ghost_hits_move_the_target_and_readmit_to_main() {
        let mut p = PrefixArc::new(100);
        let first = p.probation_target();
        for k in 0..101u32 {
            p.insert(k, 1, None);
        }
        // 0 was evicted from probation; it comes back to main, and
        // probation's target grows.
        assert!(!p.contains(&0));
        p.insert(0, 1, None);
        assert!(p.probation_target() > first);
        assert_eq!(p.queue.class(&0), Some(MAIN));
    }

    #[test]
    fn a_key_with_no_room_is_refused_and_weights_count() {
        let mut p = PrefixArc::new(10);
        assert_eq!(p.insert(1u8, 11, None), vec![1]);
        p.insert(1, 6, None);
        p.insert(2, 4, Some(&1));
        // 3 under 2 needs 2 of weight, but the only leaf would be 2, which
        // is 3's parent and so no leaf once 3 is queued: 3 is refused.
        assert_eq!(p.insert(3, 2, Some(&2)), vec![3]);
        assert_eq!(p.used(), 10);
    }
}
