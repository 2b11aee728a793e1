//! Tests of `s3fifo.rs`.

use super::*;
use proptest::prelude::*;
use std::collections::HashSet;

/// Tiny deterministic xorshift generator for the churn tests.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn capacity_never_exceeded_and_evicted_keys_gone() {
    let mut p = S3Fifo::new(1000);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for i in 0..5000u64 {
        let key = rng.below(400);
        let weight = 1 + rng.below(120);
        if i % 3 == 0 {
            p.touch(&rng.below(400));
        }
        let was_resident = p.contains(&key);
        let evicted = p.insert(key, weight);
        assert!(p.used_bytes() <= p.capacity_bytes());
        for k in &evicted {
            assert!(!p.contains(k), "evicted key {k} still resident");
        }
        if !was_resident {
            assert!(p.contains(&key), "a fitting new key must be admitted");
        }
        p.check_invariants();
    }
}

#[test]
fn used_bytes_is_sum_of_resident_weights() {
    let mut p = S3Fifo::new(100);
    let mut weights = HashMap::new();
    for k in 0..30u32 {
        let w = u64::from(k % 7) + 1;
        weights.insert(k, w);
        for e in p.insert(k, w) {
            weights.remove(&e);
        }
        let sum: u64 = p.keys().map(|k| weights[k]).sum();
        assert_eq!(p.used_bytes(), sum);
        assert_eq!(p.len(), weights.len());
    }
    assert!(!p.is_empty());
}

#[test]
fn touched_key_survives_one_hit_scan_that_evicts_it_under_lru() {
    const CAP: u64 = 100;
    let hot = u32::MAX;
    let mut p = S3Fifo::new(CAP);
    // A minimal LRU over the same trace, for contrast.
    let mut lru: VecDeque<u32> = VecDeque::new();
    let lru_access = |lru: &mut VecDeque<u32>, k: u32| {
        if let Some(pos) = lru.iter().position(|&x| x == k) {
            lru.remove(pos);
        }
        lru.push_back(k);
        if lru.len() as u64 > CAP {
            lru.pop_front();
        }
    };

    p.insert(hot, 1);
    lru_access(&mut lru, hot);
    assert!(p.touch(&hot));
    lru_access(&mut lru, hot);
    // A scan of 3x the capacity in one-hit keys.
    for k in 0..300u32 {
        let evicted = p.insert(k, 1);
        assert!(!evicted.contains(&hot));
        lru_access(&mut lru, k);
    }
    assert!(!lru.contains(&hot), "LRU keeps the hot key: scan too short");
    assert!(p.contains(&hot), "S3-FIFO lost the hot key to a scan");
    assert_eq!(p.queue_of(&hot), Some(Queue::Main));
    assert_eq!(p.used_bytes(), CAP);
}

#[test]
fn untouched_small_keys_are_evicted_in_fifo_order_as_ghosts() {
    let mut p = S3Fifo::new(100);
    for k in 0..10u32 {
        assert!(p.insert(k, 10).is_empty());
    }
    assert_eq!(p.insert(10, 10), vec![0]);
    assert_eq!(p.insert(11, 20), vec![1, 2]);
    assert!(p.in_ghost(&0) && p.in_ghost(&1) && p.in_ghost(&2));
    assert_eq!(p.queue_of(&11), Some(Queue::Small));
}

#[test]
fn ghost_hit_goes_to_main() {
    let mut p = S3Fifo::new(100);
    for k in 0..10u32 {
        p.insert(k, 10);
    }
    assert_eq!(p.insert(10, 10), vec![0]);
    assert!(!p.contains(&0));
    assert!(p.in_ghost(&0));
    // Key 0 comes back: admitted straight to main, not to small.
    assert_eq!(p.insert(0, 10), vec![1]);
    assert_eq!(p.queue_of(&0), Some(Queue::Main));
    assert!(!p.in_ghost(&0));
    // A brand new key still goes to small.
    p.insert(50, 10);
    assert_eq!(p.queue_of(&50), Some(Queue::Small));
    // And being in main, key 0 outlives a scan of one-hit keys.
    for k in 100..200u32 {
        p.insert(k, 10);
    }
    assert!(p.contains(&0));
    p.check_invariants();
}

#[test]
fn ghost_is_bounded_by_queue_sizes() {
    let mut p = S3Fifo::new(1000);
    for k in 0..10_000u32 {
        p.insert(k, 10);
        assert!(p.ghost_len() <= p.len());
    }
    // Main is empty (nothing was ever hit): the ghost is capped by the
    // small queue's count at eviction time (99 while the newcomer waits).
    assert_eq!(p.len(), 100);
    assert_eq!(p.ghost_len(), 99);
    assert!(p.in_ghost(&9_899) && p.in_ghost(&9_801) && !p.in_ghost(&9_800));
}

#[test]
fn over_capacity_key_rejected_without_disturbing_others() {
    let mut p = S3Fifo::new(100);
    for k in 0..5u32 {
        p.insert(k, 10);
    }
    p.touch(&3);
    assert_eq!(p.insert(99, 101), vec![99]);
    assert!(!p.contains(&99));
    assert!(!p.in_ghost(&99));
    assert_eq!(p.used_bytes(), 50);
    assert_eq!(p.len(), 5);
    assert_eq!(p.freq_of(&3), Some(1));
    // Exactly the capacity is fine.
    // 3 was hit, so it is promoted to main and evicted last.
    assert_eq!(p.insert(77, 100), vec![0, 1, 2, 4, 3]);
    assert_eq!(p.used_bytes(), 100);
    // A resident key re-weighted above capacity is dropped, alone.
    p.remove(&77);
    p.insert(1, 10);
    p.insert(2, 10);
    assert_eq!(p.insert(1, 1000), vec![1]);
    assert!(!p.contains(&1) && p.contains(&2));
    assert_eq!(p.used_bytes(), 10);
    p.check_invariants();
}

#[test]
fn zero_capacity_admits_only_weightless_keys() {
    let mut p = S3Fifo::new(0);
    assert_eq!(p.insert(1u8, 1), vec![1]);
    assert!(p.insert(2, 0).is_empty());
    assert!(p.contains(&2));
    assert_eq!(p.evict_one(), Some(2));
    assert_eq!(p.evict_one(), None);
}

#[test]
fn remove_works_and_keeps_accounting() {
    let mut p = S3Fifo::new(100);
    for k in 0..10u32 {
        p.insert(k, 10);
    }
    assert_eq!(p.remove(&4), Some(10));
    assert_eq!(p.remove(&4), None);
    assert!(!p.contains(&4));
    assert!(!p.in_ghost(&4), "remove must not create a ghost");
    assert_eq!(p.used_bytes(), 90);
    assert_eq!(p.len(), 9);
    assert!(!p.keys().any(|&k| k == 4));
    // The freed room is usable without eviction.
    assert!(p.insert(20, 10).is_empty());
    // Re-inserting a removed key goes to small (it is no ghost).
    p.remove(&20);
    p.insert(4, 5);
    assert_eq!(p.queue_of(&4), Some(Queue::Small));
    // The stale slot of the removed key is skipped by eviction.
    let order: Vec<u32> = std::iter::from_fn(|| p.evict_one()).collect();
    assert_eq!(order, vec![0, 1, 2, 3, 5, 6, 7, 8, 9, 4]);
    assert_eq!(p.used_bytes(), 0);
    assert!(p.is_empty());
    p.check_invariants();
}

#[test]
fn reweighting_keeps_queue_and_frequency() {
    let mut p = S3Fifo::new(100);
    for k in 0..10u32 {
        p.insert(k, 10);
    }
    p.insert(10, 10); // evicts 0 into the ghost
    p.insert(0, 10); // ghost hit: 0 is in main; evicts 1
    p.touch(&0);
    p.touch(&5);
    assert!(p.insert(0, 4).is_empty());
    assert_eq!(p.queue_of(&0), Some(Queue::Main));
    assert_eq!(p.freq_of(&0), Some(1));
    assert_eq!(p.weight(&0), Some(4));
    assert_eq!(p.used_bytes(), 94);
    assert!(p.insert(5, 16).is_empty());
    assert_eq!(p.used_bytes(), 100);
    assert_eq!(p.freq_of(&5), Some(1));
    // Growing past the capacity evicts from the small head: 2, then 3.
    assert_eq!(p.insert(5, 30), vec![2, 3]);
    assert_eq!(p.used_bytes(), 94);
    assert!(p.contains(&5) && p.contains(&0));
    p.check_invariants();
}

#[test]
fn eviction_order_follows_s3fifo_rule() {
    let mut p = S3Fifo::new(100);
    let keys = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
    for k in keys {
        p.insert(k, 10);
        p.touch(&k);
    }
    // All of small was hit: every key moves to main with freq 0, small
    // empties, and main's head is evicted to make room.
    assert_eq!(p.insert("k", 10), vec!["a"]);
    for k in &keys[1..] {
        assert_eq!(p.queue_of(k), Some(Queue::Main));
        assert_eq!(p.freq_of(k), Some(0));
    }
    assert!(!p.in_ghost(&"a"), "main evictions are not ghosts");
    p.touch(&"c");
    let order: Vec<&str> = std::iter::from_fn(|| p.evict_one()).collect();
    // small ("k", holding 10% of capacity) goes first, then main as
    // CLOCK: "c" gets a second chance and goes last.
    assert_eq!(order, ["k", "b", "d", "e", "f", "g", "h", "i", "j", "c"]);
    assert_eq!(p.evict_one(), None);
}

#[test]
fn main_is_preferred_when_small_is_under_target() {
    let mut p = S3Fifo::new(100);
    for k in 0..10u32 {
        p.insert(k, 10);
        p.touch(&k);
    }
    // Moves 0..=9 to main, then evicts 0 from main.
    assert_eq!(p.insert(10, 5), vec![0]);
    assert!(p.insert(11, 5).is_empty());
    assert_eq!(p.queue_of(&10), Some(Queue::Small));
    assert_eq!(p.queue_of(&11), Some(Queue::Small));
    // small holds 10 >= 10: evict from small.
    assert_eq!(p.evict_one(), Some(10));
    // small holds 5 < 10 and main is non-empty: evict from main.
    assert_eq!(p.evict_one(), Some(1));
    assert!(p.contains(&11));
}

#[test]
fn frequency_saturates_at_three() {
    let mut p = S3Fifo::new(100);
    p.insert(1u32, 10);
    assert_eq!(p.freq_of(&1), Some(0));
    for _ in 0..10 {
        assert!(p.touch(&1));
    }
    assert_eq!(p.freq_of(&1), Some(MAX_FREQ));
    assert!(!p.touch(&2));
    // In main, saturation shows: "b" hit 10 times ties with "c" hit 3
    // times, so FIFO order decides and "b" goes first.
    let mut p = S3Fifo::new(100);
    for k in ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"] {
        p.insert(k, 10);
        p.touch(&k);
    }
    assert_eq!(p.insert("k", 10), vec!["a"]);
    for k in ["e", "f", "g", "h", "i", "j"] {
        p.remove(&k);
    }
    for _ in 0..10 {
        p.touch(&"b");
    }
    for _ in 0..3 {
        p.touch(&"c");
    }
    let order: Vec<&str> = std::iter::from_fn(|| p.evict_one()).collect();
    assert_eq!(order, ["k", "d", "b", "c"]);
}

#[test]
fn heavy_churn_keeps_queue_slots_bounded() {
    let mut p = S3Fifo::new(10_000);
    let mut rng = Rng(0xDEAD_BEEF_CAFE_F00D);
    let mut max_slots = 0;
    for i in 0..100_000u64 {
        let key = rng.below(2_000);
        match rng.below(10) {
            0..=3 => {
                p.insert(key, 1 + rng.below(200));
            }
            4..=6 => {
                p.touch(&key);
            }
            7 | 8 => {
                p.remove(&key);
            }
            _ => {
                p.evict_one();
            }
        }
        max_slots = max_slots.max(p.queue_slots());
        assert!(
            p.queue_slots() <= 2 * (p.len() + p.ghost_len()) + 3,
            "op {i}: {} slots for {} keys and {} ghosts",
            p.queue_slots(),
            p.len(),
            p.ghost_len()
        );
        if i % 997 == 0 {
            p.check_invariants();
        }
    }
    // 2_000 distinct keys: resident + ghost <= 2 * 2_000.
    assert!(max_slots <= 8_003, "max slots {max_slots}");
    p.check_invariants();
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u8, u64),
    Touch(u8),
    Remove(u8),
    EvictOne,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..24, 0u64..60).prop_map(|(k, w)| Op::Insert(k, w)),
        3 => (0u8..24).prop_map(Op::Touch),
        1 => (0u8..24).prop_map(Op::Remove),
        1 => Just(Op::EvictOne),
    ]
}

proptest! {
    #[test]
    fn matches_model(capacity in 0u64..200, ops in proptest::collection::vec(op(), 0..300)) {
        let mut p = S3Fifo::new(capacity);
        let mut model: HashMap<u8, u64> = HashMap::new();
        for op in ops {
            let evicted: Vec<u8> = match op {
                Op::Insert(k, w) => {
                    let was_resident = model.contains_key(&k);
                    let ev = p.insert(k, w);
                    if w > capacity {
                        prop_assert_eq!(&ev, &vec![k]);
                        model.remove(&k);
                    } else {
                        model.insert(k, w);
                        if !was_resident {
                            prop_assert!(!ev.contains(&k), "new key in its own eviction list");
                        }
                    }
                    for e in &ev {
                        if *e != k || w <= capacity {
                            prop_assert!(model.remove(e).is_some(), "evicted non-resident key {}", e);
                        }
                    }
                    let distinct: HashSet<_> = ev.iter().collect();
                    prop_assert_eq!(distinct.len(), ev.len());
                    ev
                }
                Op::Touch(k) => {
                    prop_assert_eq!(p.touch(&k), model.contains_key(&k));
                    Vec::new()
                }
                Op::Remove(k) => {
                    prop_assert_eq!(p.remove(&k), model.remove(&k));
                    Vec::new()
                }
                Op::EvictOne => match p.evict_one() {
                    Some(e) => {
                        prop_assert!(model.remove(&e).is_some());
                        vec![e]
                    }
                    None => {
                        prop_assert!(model.is_empty());
                        Vec::new()
                    }
                },
            };
            for e in &evicted {
                prop_assert!(!p.contains(e));
            }
            let sum: u64 = model.values().sum();
            prop_assert_eq!(p.used_bytes(), sum);
            prop_assert!(p.used_bytes() <= p.capacity_bytes());
            prop_assert_eq!(p.len(), model.len());
            for k in 0u8..24 {
                prop_assert_eq!(p.contains(&k), model.contains_key(&k));
                prop_assert_eq!(p.weight(&k), model.get(&k).copied());
            }
            p.check_invariants();
        }
    }
}
