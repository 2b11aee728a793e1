//! The offline optimum: Belady's rule over the leaves of the prefix tree,
//! with bypass.
//!
//! When room is needed, the leaf whose next use is furthest away goes; but
//! when the block about to be inserted is needed later than (or as late
//! as) every leaf that could make room for it, it is not inserted at all
//! (bypass), and neither is the rest of its request. Blocks of the request
//! being served that were resident when it arrived are never taken for its
//! own room. These are the conventions of the published curves
//! ("optimal-belady-bypass").
//!
//! It runs on the store's [`LeafQueue`] with the distance to the next use
//! as priority.

use kvtier_store::eviction::LeafQueue;

use crate::prefix::{Hits, NEVER, PrefixTree, ROOT, look_up};
use crate::sim::Outcome;

/// Runs the optimum at `capacity` blocks, measuring requests from `from`.
pub fn run(tree: &PrefixTree, capacity: u64, from: usize) -> Outcome {
    let mut q: LeafQueue<u32> = LeafQueue::new();
    let mut protected = vec![u32::MAX; tree.parent.len()];
    let mut hits = Hits::default();
    let mut request_hits = Vec::new();
    let (mut writes, mut filled) = (0u64, false);
    // Lower priorities go first: the furthest next use is the lowest.
    let priority = |next: u32| u64::from(NEVER - next);
    for (i, r) in tree.requests.iter().enumerate() {
        let got = look_up(tree, r.clone(), i >= from, &mut hits, |e, alive| {
            let n = tree.node[e];
            let hit = q.contains(&n);
            if alive && hit {
                q.set_priority(&n, priority(tree.next_use[e]));
            }
            hit
        });
        let mark = i as u32;
        for e in r.clone() {
            let n = tree.node[e];
            if q.contains(&n) {
                protected[n as usize] = mark;
            }
        }
        for e in r.clone() {
            let n = tree.node[e];
            if q.contains(&n) {
                continue;
            }
            if q.len() as u64 >= capacity {
                let may_take = |k: &u32, _: u64| protected[*k as usize] != mark;
                let Some((_, p)) = q.peek_leaf(0, may_take) else {
                    break;
                };
                let victim_next = NEVER - p as u32;
                if victim_next <= tree.next_use[e] {
                    break;
                }
                q.pop_leaf(0, may_take);
            }
            let parent = tree.parent[n as usize];
            if (q.len() as u64) < capacity && (parent == ROOT || q.contains(&parent)) {
                let parent = (parent != ROOT).then_some(parent);
                q.insert(n, parent, 1, priority(tree.next_use[e]));
                writes += 1;
                filled |= q.len() as u64 >= capacity && i < from;
            } else {
                break;
            }
        }
        if i >= from {
            request_hits.push(got as u32);
        }
    }
    Outcome {
        hits,
        writes,
        filled_before_measurement: filled,
        request_hits,
    }
}
