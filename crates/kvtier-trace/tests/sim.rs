//! The simulator on hand-made traces whose answers are worked out here,
//! and properties over random traces.

use kvtier_store::eviction::{Eviction, EvictionKind, PrefixArc};
use kvtier_trace::prefix::PrefixTree;
use kvtier_trace::sim::{self, SimPolicy};
use kvtier_trace::{Format, Request, Trace};
use proptest::prelude::*;

/// A trace of one-token blocks, a request a second, every request measured.
fn trace(requests: &[Vec<u64>]) -> PrefixTree {
    PrefixTree::new(&Trace {
        name: "hand-made".into(),
        format: Format::Generic,
        block_size: 1,
        requests: requests
            .iter()
            .enumerate()
            .map(|(i, b)| Request {
                time_s: i as f64,
                session: None,
                blocks: b.clone(),
                block_tokens: vec![1; b.len()],
                input_tokens: b.len() as u64,
                output_tokens: 0,
            })
            .collect(),
    })
}

fn hits(tree: &PrefixTree, policy: &str, capacity: u64) -> u64 {
    let p = SimPolicy::parse(policy).expect("policy");
    sim::run(tree, p, capacity, 0).hits.hit_tokens
}

#[test]
fn fifo_loses_the_head_and_a_cached_block_after_a_miss_is_no_hit() {
    // Capacity 2. [1,2] fills it; [3] pushes out the oldest, 1; then
    // [1,2] misses 1, and 2, though cached, follows a miss: no hit.
    let t = trace(&[vec![1, 2], vec![3], vec![1, 2]]);
    assert_eq!(hits(&t, "fifo", 2), 0);
    // LRU takes leaves only: [3] evicts 2 (not 1, its parent), and the
    // third request hits 1.
    assert_eq!(hits(&t, "lru", 2), 1);
}

#[test]
fn lru_keeps_the_recent_leaf_and_belady_bypasses_a_block_never_used_again() {
    // Capacity 1: [1], [2], [1]. LRU replaces 1 by 2 and misses all; the
    // optimum does not insert 2 (needed never, 1 is needed next) and hits
    // the third request.
    let t = trace(&[vec![1], vec![2], vec![1]]);
    assert_eq!(hits(&t, "lru", 1), 0);
    assert_eq!(hits(&t, "belady", 1), 1);
    // Capacity 2: [1,2], [1,3], [1,2]. LRU: 3 needs room, the only leaf
    // is 2 (1 is the parent), so 2 goes and the last request hits 1 only:
    // 1 + 1. The optimum bypasses 3 (never used again; 2 is used next) and
    // hits 1 in the second request and 1 and 2 in the last: 3.
    let t = trace(&[vec![1, 2], vec![1, 3], vec![1, 2]]);
    assert_eq!(hits(&t, "lru", 2), 2);
    assert_eq!(hits(&t, "belady", 2), 3);
}

#[test]
fn an_id_after_another_prefix_is_other_kv() {
    // 2 after 5 is not 2 after 1: an infinite cache hits [1,2] twice, and
    // nothing of [5,2].
    let t = trace(&[vec![1, 2], vec![1, 2], vec![5, 2]]);
    assert_eq!(t.infinite_hits(0).hit_tokens, 2);
    for p in ["lru", "fifo", "s3fifo", "kvtier", "belady"] {
        assert_eq!(hits(&t, p, 10), 2, "{p}");
    }
}

#[test]
fn the_admission_filter_stores_a_block_at_its_second_sighting() {
    // [1], [2], [1], [1]: without the filter 1 and 2 are written at once
    // and the last two requests hit; with it, 1 is written at its second
    // sighting (the third request, a miss) and only the last one hits.
    let t = trace(&[vec![1], vec![2], vec![1], vec![1]]);
    let lru = SimPolicy::parse("lru").expect("lru");
    let plain = sim::run_with(&t, lru, 10, 0, None);
    let admitted = sim::run_with(&t, lru, 10, 0, Some(100));
    assert_eq!((plain.hits.hit_tokens, plain.writes), (2, 2));
    assert_eq!((admitted.hits.hit_tokens, admitted.writes), (1, 1));
}

#[test]
fn the_simulator_drives_the_stores_own_policy_types() {
    // The simulator's "kvtier" is the store's PrefixArc itself: driving a
    // PrefixArc built here through the same trait gives the same answer,
    // and the store builds that type for EvictionKind::Kvtier.
    let t = trace(&[
        vec![1, 2, 3],
        vec![1, 2, 4],
        vec![5],
        vec![1, 2, 3],
        vec![6, 7],
        vec![1, 2, 4],
    ]);
    for capacity in 1..8 {
        let mut own = PrefixArc::new(capacity);
        let direct = sim::run_online(&t, &mut own, 0);
        let via_kind = sim::run(&t, SimPolicy::parse("kvtier").expect("kvtier"), capacity, 0);
        assert_eq!(direct, via_kind, "capacity {capacity}");
    }
    let built: Box<dyn Eviction<u32>> = EvictionKind::Kvtier.build(4);
    assert_eq!(built.name(), PrefixArc::<u32>::new(4).name());
}

/// Random traces with shared heads: requests are chains over a few ids.
fn random_trace() -> impl Strategy<Value = Vec<Vec<u64>>> {
    prop::collection::vec(prop::collection::vec(0u64..5, 1..6), 1..30)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn belady_is_never_beaten_and_a_full_size_cache_is_the_infinite_one(reqs in random_trace()) {
        let t = trace(&reqs);
        let unique = t.unique_blocks() as u64;
        let infinite = t.infinite_hits(0).hit_tokens;
        for c in 1..=unique {
            let best = hits(&t, "belady", c);
            for p in ["lru", "fifo", "s3fifo", "clock", "kvtier"] {
                let h = hits(&t, p, c);
                prop_assert!(h <= best, "{p} {h} > belady {best} at {c}");
            }
        }
        for p in ["lru", "fifo", "s3fifo", "clock", "kvtier", "belady"] {
            prop_assert_eq!(hits(&t, p, unique), infinite, "{} at full size", p);
        }
    }

    #[test]
    fn lru_never_loses_hits_with_more_room(reqs in random_trace()) {
        let t = trace(&reqs);
        let unique = t.unique_blocks() as u64;
        let mut last = 0;
        for c in 1..=unique {
            let h = hits(&t, "lru", c);
            prop_assert!(h >= last, "lru {h} at {c} < {last} at {}", c - 1);
            last = h;
        }
    }
}
