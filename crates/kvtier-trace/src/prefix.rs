//! A trace's blocks as nodes of one prefix tree: a block is keyed by its
//! whole prefix (its parent node and its id), so an id reused after another
//! prefix is another node, as KV computed after another prefix is other
//! KV. This is the "context-aware" block of the published KV-cache curves;
//! for traces whose ids are already chained (Mooncake, RAGPulse as read
//! here) it changes nothing.

use std::collections::HashMap;
use std::ops::Range;

use crate::Trace;

/// The root: the parent of every head block; never resident.
pub const ROOT: u32 = 0;

/// The next-use mark of a block never used again.
pub const NEVER: u32 = u32::MAX;

/// The trace, requests without blocks left out, as events over nodes.
#[derive(Debug, Clone)]
pub struct PrefixTree {
    /// Each node's parent ([`ROOT`] for head blocks); index 0 is the root.
    pub parent: Vec<u32>,
    /// Each request's events (a range of the event arrays).
    pub requests: Vec<Range<usize>>,
    /// The node of each event (a request's block).
    pub node: Vec<u32>,
    /// The tokens of each event.
    pub tokens: Vec<u32>,
    /// The index of the next request that uses each event's node, or
    /// [`NEVER`].
    pub next_use: Vec<u32>,
    /// Each request's arrival, in seconds.
    pub time_s: Vec<f64>,
}

impl PrefixTree {
    /// Builds the tree of `trace`. Requests with no blocks are left out:
    /// they can neither hit nor fill a cache.
    pub fn new(trace: &Trace) -> Self {
        let mut parent = vec![ROOT];
        let mut edges: HashMap<(u32, u64), u32> = HashMap::new();
        let (mut requests, mut node, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
        let mut time_s = Vec::new();
        for r in trace.requests.iter().filter(|r| !r.blocks.is_empty()) {
            time_s.push(r.time_s);
            let start = node.len();
            let mut at = ROOT;
            for (&id, &t) in r.blocks.iter().zip(&r.block_tokens) {
                let next = parent.len() as u32;
                at = *edges.entry((at, id)).or_insert_with(|| {
                    parent.push(at);
                    next
                });
                node.push(at);
                tokens.push(t);
            }
            requests.push(start..node.len());
        }
        let mut next_use = vec![NEVER; node.len()];
        let mut last = vec![NEVER; parent.len()];
        for (i, r) in requests.iter().enumerate().rev() {
            for e in r.clone() {
                next_use[e] = last[node[e] as usize];
            }
            for e in r.clone() {
                last[node[e] as usize] = i as u32;
            }
        }
        Self {
            parent,
            requests,
            node,
            tokens,
            next_use,
            time_s,
        }
    }

    /// Distinct blocks (nodes other than the root).
    pub fn unique_blocks(&self) -> usize {
        self.parent.len() - 1
    }

    /// The first measured request when the first `warmup` fraction is
    /// warm-up (floor, as the published curves count).
    pub fn measured_from(&self, warmup: f64) -> usize {
        ((self.requests.len() as f64 * warmup.clamp(0.0, 1.0)).floor() as usize)
            .min(self.requests.len())
    }

    /// Hit tokens and hit blocks of an infinite cache over the requests
    /// from `from` on, with their total tokens and blocks: a block hits
    /// while every block before it in its request hit.
    pub fn infinite_hits(&self, from: usize) -> Hits {
        let mut seen = vec![false; self.parent.len()];
        let mut h = Hits::default();
        for (i, r) in self.requests.iter().enumerate() {
            let mut alive = true;
            for e in r.clone() {
                let n = self.node[e] as usize;
                alive &= seen[n];
                if i >= from {
                    h.count(self.tokens[e], alive);
                }
            }
            for e in r.clone() {
                seen[self.node[e] as usize] = true;
            }
        }
        h
    }
}

/// Looks request `r` up under the prefix rule: `probe(event, alive)` says
/// whether the event's block is cached (and records the hit when `alive`,
/// every earlier block of the request having hit); each block is counted
/// into `hits` when `measured`. Returns the request's hit tokens.
pub fn look_up(
    tree: &PrefixTree,
    r: Range<usize>,
    measured: bool,
    hits: &mut Hits,
    mut probe: impl FnMut(usize, bool) -> bool,
) -> u64 {
    let before = hits.hit_tokens;
    let mut alive = true;
    for e in r {
        alive &= probe(e, alive);
        if measured {
            hits.count(tree.tokens[e], alive);
        }
    }
    hits.hit_tokens - before
}

/// Hits over a measured part of a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hits {
    /// Tokens that hit.
    pub hit_tokens: u64,
    /// All tokens.
    pub tokens: u64,
    /// Blocks that hit.
    pub hit_blocks: u64,
    /// All blocks.
    pub blocks: u64,
}

impl Hits {
    /// Counts one block.
    pub fn count(&mut self, tokens: u32, hit: bool) {
        self.tokens += u64::from(tokens);
        self.blocks += 1;
        if hit {
            self.hit_tokens += u64::from(tokens);
            self.hit_blocks += 1;
        }
    }

    /// Hit tokens over tokens (0 when nothing was measured).
    pub fn token_rate(&self) -> f64 {
        ratio(self.hit_tokens, self.tokens)
    }

    /// Hit blocks over blocks.
    pub fn block_rate(&self) -> f64 {
        ratio(self.hit_blocks, self.blocks)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Format, Request};

    pub(crate) fn trace(requests: &[&[u64]]) -> Trace {
        Trace {
            name: "t".into(),
            format: Format::Generic,
            block_size: 1,
            requests: requests
                .iter()
                .enumerate()
                .map(|(i, b)| Request {
                    time_s: i as f64,
                    session: None,
                    blocks: b.to_vec(),
                    block_tokens: vec![1; b.len()],
                    input_tokens: b.len() as u64,
                    output_tokens: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn an_id_after_another_prefix_is_another_node_and_next_uses_count_requests() {
        let t = trace(&[&[1, 2], &[3, 2], &[], &[1, 2, 4]]);
        let p = PrefixTree::new(&t);
        // 1, 1/2, 3, 3/2, 1/2/4.
        assert_eq!(p.unique_blocks(), 5);
        assert_eq!(p.requests.len(), 3);
        assert_eq!(p.next_use[..2], [2, 2]);
        assert_eq!(p.next_use[2..4], [NEVER, NEVER]);
        let h = p.infinite_hits(0);
        assert_eq!((h.hit_blocks, h.blocks), (2, 7));
        assert_eq!(p.measured_from(0.5), 1);
    }
}
