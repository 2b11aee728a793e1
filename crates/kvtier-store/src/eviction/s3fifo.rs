//! Byte-weighted S3-FIFO eviction policy (Yang et al., SOSP '23, "FIFO
//! queues are all you need for cache eviction").
//!
//! [`S3Fifo`] tracks keys and their weights (bytes) only; the caller owns
//! the values and drops whatever keys the policy hands back as evicted.
//!
//! # Why S3-FIFO for prefix KV blocks, rather than LRU
//!
//! The traffic a KV block store sees is dominated by two populations:
//!
//! * **Reused blocks**: system prompts, shared documents, few-shot
//!   examples and earlier conversation turns, whose prefix-hashed blocks are
//!   hit again and again by many sessions.
//! * **One-hit wonders**: the tail blocks of each request (the unique
//!   question suffix, the freshly generated answer) which are written once
//!   and, most of the time, never read again.
//!
//! LRU puts every new block at the most-recently-used end, so a burst of
//! one-hit blocks (a batch of long unique prompts, a bulk prefill, a
//! scan) marches through the whole cache and pushes out the shared
//! document blocks that every session is about to reuse.
//!
//! S3-FIFO admits new blocks into a **small probationary FIFO** (10% of the
//! bytes). A block that is not hit before it reaches the head of that queue
//! is evicted from there, having cost only 10% of the cache; a block that
//! *was* hit is promoted into the **main FIFO** (the other 90%), which
//! one-hit traffic never reaches while the small queue is doing its job.
//! That gives scan resistance: a scan of never-reused blocks only cycles
//! the small queue. A **ghost FIFO** remembers the keys recently evicted
//! from the small queue, so a block that comes back soon after eviction (a
//! reuse distance a bit longer than the small queue) is admitted straight
//! into main.
//!
//! FIFO queues also matter for the lock: an LRU hit must splice the node
//! to the list head, a write to shared list pointers on every read. Here a
//! hit is one saturating counter bump on the entry ([`S3Fifo::touch`]);
//! all the queue work happens on insert and eviction, and main behaves
//! like CLOCK (a hit block is reinserted at the tail with its counter
//! decremented instead of being evicted).
//!
//! # Implementation
//!
//! A `HashMap<K, Entry>` holds the resident keys; the queues are
//! `VecDeque`s of `(key, seq)` slots. Every push of a key takes a fresh
//! sequence number, stored in its entry, so a slot whose sequence number
//! no longer matches its key's entry (the key was removed, or moved to the
//! other queue) is stale and is skipped when popped. A queue is compacted
//! when its stale slots outnumber its live ones, so memory stays at most
//! twice the live count and every operation is O(1) amortised. The ghost
//! queue uses the same scheme with its own membership map.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use super::ghost::Ghost;

/// The frequency counter saturates here (the paper's 2-bit counter).
const MAX_FREQ: u8 = 3;

/// Share of the capacity, in percent, that the small queue aims for.
const SMALL_PERCENT: u64 = 10;

/// Which FIFO a resident key sits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

/// Per-key bookkeeping of a resident key.
#[derive(Debug, Clone, Copy)]
struct Entry {
    weight: u64,
    freq: u8,
    queue: Queue,
    /// Sequence number of this key's one live slot in `queue`.
    seq: u64,
}

/// True when `slot_seq` is the live slot of `key` (not a stale one).
fn is_live<K: Hash + Eq>(entries: &HashMap<K, Entry>, key: &K, slot_seq: u64) -> bool {
    entries.get(key).is_some_and(|e| e.seq == slot_seq)
}

/// A FIFO of resident keys with lazy deletion.
#[derive(Debug)]
struct Fifo<K> {
    slots: VecDeque<(K, u64)>,
    /// Number of live slots (resident keys in this queue).
    live: usize,
    /// Sum of the weights of the resident keys in this queue.
    bytes: u64,
}

impl<K: Hash + Eq> Fifo<K> {
    fn new() -> Self {
        Self {
            slots: VecDeque::new(),
            live: 0,
            bytes: 0,
        }
    }

    fn push(&mut self, key: K, seq: u64, weight: u64) {
        self.slots.push_back((key, seq));
        self.live += 1;
        self.bytes += weight;
    }

    /// Pops the oldest live slot, dropping stale ones on the way, and
    /// returns its key with a copy of its entry. The entry is still in
    /// `entries`; the caller removes or re-queues it.
    fn pop_live(&mut self, entries: &HashMap<K, Entry>) -> Option<(K, Entry)> {
        while let Some((key, seq)) = self.slots.pop_front() {
            let Some(entry) = entries.get(&key).filter(|e| e.seq == seq).copied() else {
                continue;
            };
            self.live -= 1;
            self.bytes -= entry.weight;
            self.maybe_compact(entries);
            return Some((key, entry));
        }
        None
    }

    /// Accounts for a key that left this queue without being popped (its
    /// entry is already gone from `entries`, so its slot is now stale).
    fn detach(&mut self, weight: u64, entries: &HashMap<K, Entry>) {
        self.live -= 1;
        self.bytes -= weight;
        self.maybe_compact(entries);
    }

    /// Drops the stale slots once they outnumber the live ones. The cost is
    /// at most twice the stale slots created since the last compaction, so
    /// it is O(1) amortised per operation that created one.
    fn maybe_compact(&mut self, entries: &HashMap<K, Entry>) {
        if self.slots.len() - self.live > self.live {
            self.slots.retain(|(key, seq)| is_live(entries, key, *seq));
            debug_assert_eq!(self.slots.len(), self.live);
        }
    }
}

/// Byte-weighted S3-FIFO: a small probationary FIFO (10% of capacity), a main FIFO, and a ghost FIFO of recently evicted keys.
///
/// Tracks keys and weights only; the caller holds the values and must
/// drop every key this policy returns as evicted. All operations are O(1)
/// amortised. See the [module documentation](self) for the rationale.
#[derive(Debug)]
pub struct S3Fifo<K> {
    capacity: u64,
    /// Bytes the small queue aims for: 10% of `capacity`.
    small_target: u64,
    /// Sum of the weights of all resident keys.
    used: u64,
    entries: HashMap<K, Entry>,
    small: Fifo<K>,
    main: Fifo<K>,
    ghost: Ghost<K>,
    next_seq: u64,
}

impl<K: Hash + Eq + Clone> S3Fifo<K> {
    /// Creates an empty policy holding at most `capacity_bytes` bytes of
    /// weight. Capacities above `u64::MAX / 2` are clamped to it, so that
    /// byte sums cannot overflow.
    pub fn new(capacity_bytes: u64) -> Self {
        let capacity = capacity_bytes.min(u64::MAX / 2);
        Self {
            capacity,
            small_target: capacity / 100 * SMALL_PERCENT + capacity % 100 * SMALL_PERCENT / 100,
            used: 0,
            entries: HashMap::new(),
            small: Fifo::new(),
            main: Fifo::new(),
            ghost: Ghost::new(),
            next_seq: 0,
        }
    }

    /// The capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    /// Sum of the weights of the resident keys; never above the capacity.
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// Number of resident keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no key is resident.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True when `key` is resident (ghosts do not count).
    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// The weight of a resident key, or `None` if absent.
    pub fn weight(&self, key: &K) -> Option<u64> {
        self.entries.get(key).map(|e| e.weight)
    }

    /// Records a hit: frequency += 1, saturating at 3. Returns false if absent.
    ///
    /// This is the whole cost of a hit: no queue is touched.
    pub fn touch(&mut self, key: &K) -> bool {
        match self.entries.get_mut(key) {
            Some(entry) => {
                entry.freq = (entry.freq + 1).min(MAX_FREQ);
                true
            }
            None => false,
        }
    }

    /// Inserts (or re-weights an existing key, keeping its queue). New keys go to the small queue, or straight to main if the key is in the ghost queue. Evicts until used <= capacity and returns the evicted keys in eviction order. A key heavier than the whole capacity is not admitted: it is returned as the only "evicted" key and nothing else is disturbed.
    ///
    /// Details:
    /// * An insert is not a hit: a new key starts with frequency 0, and
    ///   re-weighting keeps the key's frequency and queue position.
    /// * For a new key, room is made *before* it is queued (as in the
    ///   paper), so a new key is never in its own eviction list. When
    ///   re-weighting makes a key heavier, the key itself may be evicted
    ///   and is then in the returned list.
    /// * Re-weighting a resident key above the capacity removes it (not
    ///   as a ghost) and returns it as the only evicted key.
    pub fn insert(&mut self, key: K, weight: u64) -> Vec<K> {
        if weight > self.capacity {
            if let Some(entry) = self.entries.remove(&key) {
                self.detach(&entry);
                self.trim_ghost();
            }
            return vec![key];
        }

        let mut evicted = Vec::new();
        if let Some(entry) = self.entries.get_mut(&key) {
            let old = entry.weight;
            entry.weight = weight;
            let fifo = match entry.queue {
                Queue::Small => &mut self.small,
                Queue::Main => &mut self.main,
            };
            fifo.bytes = fifo.bytes - old + weight;
            self.used = self.used - old + weight;
            self.evict_while(|used, capacity| used > capacity, &mut evicted);
            return evicted;
        }

        // Check the ghost before making room: the evictions below push and
        // trim ghosts and could otherwise drop this key's ghost.
        let from_ghost = self.ghost.take(&key);
        self.evict_while(|used, capacity| used + weight > capacity, &mut evicted);
        let seq = self.bump_seq();
        let queue = if from_ghost {
            self.main.push(key.clone(), seq, weight);
            Queue::Main
        } else {
            self.small.push(key.clone(), seq, weight);
            Queue::Small
        };
        self.entries.insert(
            key,
            Entry {
                weight,
                freq: 0,
                queue,
                seq,
            },
        );
        self.used += weight;
        self.trim_ghost();
        evicted
    }

    /// Removes a key without recording it as a ghost. Returns its weight if present.
    pub fn remove(&mut self, key: &K) -> Option<u64> {
        let entry = self.entries.remove(key)?;
        self.detach(&entry);
        self.trim_ghost();
        Some(entry.weight)
    }

    /// Evicts one key by the S3-FIFO rule (used to make room or shed memory); None when empty.
    ///
    /// While the small queue holds at least 10% of the capacity (or main is
    /// empty), its head is examined: a key hit while in small moves to the
    /// main tail with its frequency reset, otherwise it is evicted and
    /// remembered as a ghost. Otherwise main's head is examined: a key with
    /// frequency > 0 is reinserted at the main tail with its frequency
    /// decremented (CLOCK-like), otherwise it is evicted. This repeats until
    /// one key is evicted; each key can be re-queued at most a bounded
    /// number of times per hit, so the cost is O(1) amortised.
    pub fn evict_one(&mut self) -> Option<K> {
        self.evict_one_weighed().map(|(k, _)| k)
    }

    /// [`S3Fifo::evict_one`] with the evicted key's weight.
    fn evict_one_weighed(&mut self) -> Option<(K, u64)> {
        loop {
            let from_small = self.small.live > 0
                && (self.small.bytes >= self.small_target || self.main.live == 0);
            if from_small {
                let (key, entry) = self.small.pop_live(&self.entries)?;
                // Promotion threshold: freq >= 1. The paper's pseudo-code
                // promotes on `freq > 1`, but there the insert itself may be
                // counted as an access; here insert never bumps the counter,
                // so freq >= 1 means "requested again while on probation",
                // which is the paper's stated criterion (accessed at least
                // once after insertion). For KV blocks a second request for
                // the same prefix block is exactly the sign of a shared
                // prefix; requiring a third would send shared-document
                // blocks through the ghost queue first for no benefit.
                if entry.freq > 0 {
                    let seq = self.bump_seq();
                    self.requeue(&key, Queue::Main, 0, seq);
                    self.main.push(key, seq, entry.weight);
                } else {
                    self.entries.remove(&key);
                    self.used -= entry.weight;
                    let seq = self.bump_seq();
                    self.ghost.push(key.clone(), seq);
                    self.trim_ghost();
                    return Some((key, entry.weight));
                }
            } else {
                let (key, entry) = self.main.pop_live(&self.entries)?;
                if entry.freq > 0 {
                    let seq = self.bump_seq();
                    self.requeue(&key, Queue::Main, entry.freq - 1, seq);
                    self.main.push(key, seq, entry.weight);
                } else {
                    self.entries.remove(&key);
                    self.used -= entry.weight;
                    self.trim_ghost();
                    return Some((key, entry.weight));
                }
            }
        }
    }

    /// Iterates over resident keys (any order).
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.keys()
    }

    /// Total slots held by the small, main and ghost queues, stale ones
    /// included. Lazy deletion keeps this at most about twice the number of
    /// resident plus ghost keys; exposed for tests of that bound.
    #[doc(hidden)]
    pub fn queue_slots(&self) -> usize {
        self.small.slots.len() + self.main.slots.len() + self.ghost.slots.len()
    }

    /// Number of keys in the ghost queue.
    #[doc(hidden)]
    pub fn ghost_len(&self) -> usize {
        self.ghost.len()
    }

    fn bump_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Evicts (collecting into `out`) while `over(used, capacity)` holds.
    fn evict_while(&mut self, over: impl Fn(u64, u64) -> bool, out: &mut Vec<K>) {
        while over(self.used, self.capacity) {
            match self.evict_one() {
                Some(key) => out.push(key),
                None => break,
            }
        }
    }

    /// Points a resident key's entry at a new slot.
    fn requeue(&mut self, key: &K, queue: Queue, freq: u8, seq: u64) {
        if let Some(entry) = self.entries.get_mut(key) {
            entry.queue = queue;
            entry.freq = freq;
            entry.seq = seq;
        }
    }

    /// Accounts for an entry already removed from `entries`.
    fn detach(&mut self, entry: &Entry) {
        self.used -= entry.weight;
        match entry.queue {
            Queue::Small => self.small.detach(entry.weight, &self.entries),
            Queue::Main => self.main.detach(entry.weight, &self.entries),
        }
    }

    /// Bounds the ghost queue. The paper sizes the ghost like main; we
    /// allow as many ghost keys as the larger of the main and small queues
    /// hold. In steady state main holds ~90% of the bytes and this is the
    /// main key count; while warming up, main is still empty and the small
    /// queue's count keeps the ghost useful (otherwise nothing evicted from
    /// a cold cache could ever be re-admitted straight to main). Either
    /// way the ghost never holds more keys than are resident.
    fn trim_ghost(&mut self) {
        let cap = self.main.live.max(self.small.live);
        self.ghost.trim(cap);
    }

    #[cfg(test)]
    fn queue_of(&self, key: &K) -> Option<Queue> {
        self.entries.get(key).map(|e| e.queue)
    }

    #[cfg(test)]
    fn freq_of(&self, key: &K) -> Option<u8> {
        self.entries.get(key).map(|e| e.freq)
    }

    #[cfg(test)]
    fn in_ghost(&self, key: &K) -> bool {
        self.ghost.members.contains_key(key)
    }

    /// Checks every internal invariant; panics on a violation.
    #[cfg(test)]
    fn check_invariants(&self) {
        let sum: u64 = self.entries.values().map(|e| e.weight).sum();
        assert_eq!(self.used, sum, "used_bytes != sum of weights");
        assert!(self.used <= self.capacity, "over capacity");
        let (mut small_n, mut small_b, mut main_n, mut main_b) = (0, 0, 0, 0);
        for e in self.entries.values() {
            match e.queue {
                Queue::Small => (small_n, small_b) = (small_n + 1, small_b + e.weight),
                Queue::Main => (main_n, main_b) = (main_n + 1, main_b + e.weight),
            }
        }
        assert_eq!((self.small.live, self.small.bytes), (small_n, small_b));
        assert_eq!((self.main.live, self.main.bytes), (main_n, main_b));
        let live_small = self
            .small
            .slots
            .iter()
            .filter(|(k, s)| is_live(&self.entries, k, *s))
            .count();
        let live_main = self
            .main
            .slots
            .iter()
            .filter(|(k, s)| is_live(&self.entries, k, *s))
            .count();
        assert_eq!(live_small, small_n, "small queue lost a live slot");
        assert_eq!(live_main, main_n, "main queue lost a live slot");
        assert!(self.small.slots.len() <= 2 * self.small.live + 1);
        assert!(self.main.slots.len() <= 2 * self.main.live + 1);
        assert!(self.ghost.slots.len() <= 2 * self.ghost.len() + 1);
        assert!(self.ghost.len() <= self.main.live.max(self.small.live));
        for k in self.ghost.members.keys() {
            assert!(!self.entries.contains_key(k), "resident key is a ghost");
        }
    }
}

impl<K: Hash + Eq + Clone + Send + std::fmt::Debug> super::Eviction<K> for S3Fifo<K> {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn used(&self) -> u64 {
        self.used
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    fn contains(&self, key: &K) -> bool {
        S3Fifo::contains(self, key)
    }

    fn touch(&mut self, key: &K) -> bool {
        S3Fifo::touch(self, key)
    }

    /// Flat over keys: the parent is not used.
    fn insert(&mut self, key: K, weight: u64, _parent: Option<&K>) -> Vec<K> {
        S3Fifo::insert(self, key, weight)
    }

    fn remove(&mut self, key: &K) -> Option<u64> {
        S3Fifo::remove(self, key)
    }

    fn evict_one(&mut self) -> Option<K> {
        S3Fifo::evict_one(self)
    }

    /// S3-FIFO's queues have no "pass over this one": a refused key is
    /// evicted and inserted again, which is rare where this is used (slots
    /// pinned by a reader).
    fn evict_where(&mut self, may_take: &mut dyn FnMut(&K) -> bool) -> Option<K> {
        let mut refused = Vec::new();
        let mut found = None;
        for _ in 0..self.entries.len() {
            let Some((k, w)) = self.evict_one_weighed() else {
                break;
            };
            if may_take(&k) {
                found = Some(k);
                break;
            }
            refused.push((k, w));
        }
        for (k, w) in refused {
            S3Fifo::insert(self, k, w);
        }
        found
    }
}

#[cfg(test)]
mod tests;
