//! A scaled cut of a trace that keeps its sharing: a share of its
//! conversations, each kept whole.
//!
//! Taking every k-th request, or the first minutes, of a conversation
//! trace cuts conversations apart: the turns that would have reused an
//! earlier turn's KV fall outside the cut, and its reuse drops far below
//! the trace's (the Mooncake conversation trace's first few hundred
//! requests reuse a fraction of what the whole trace does;
//! `kvtier trace stats` shows it). Keeping whole conversations lowers the
//! load and keeps the reuse.
//!
//! A conversation is the requests of one session where the trace names
//! sessions; where it does not (Mooncake), the requests whose first block
//! after the prefix every request shares (a common system prompt) is the
//! same. Which conversations are kept is a hash of that key, so the same
//! share of the same trace is always the same cut.

use crate::Trace;
use crate::prompts::splitmix64;

/// What names a request's conversation.
fn conversation(trace: &Trace, common: usize, i: usize) -> u64 {
    let r = &trace.requests[i];
    match r.session {
        Some(s) => splitmix64(s ^ 0x5E55_1011),
        None => match r.blocks.get(common) {
            Some(&b) => splitmix64(b),
            // Nothing beyond the common prefix: a conversation of its own.
            None => splitmix64(i as u64 ^ 0xA11_0AE),
        },
    }
}

/// How many leading blocks every request of `trace` shares.
fn common_prefix(trace: &Trace) -> usize {
    let Some(first) = trace.requests.first() else {
        return 0;
    };
    trace.requests.iter().fold(first.blocks.len(), |n, r| {
        n.min(
            r.blocks
                .iter()
                .zip(&first.blocks)
                .take_while(|(a, b)| a == b)
                .count(),
        )
    })
}

/// The requests of a `share` (0..=1) of `trace`'s conversations, in trace
/// order, times unchanged.
pub fn conversations(trace: &Trace, share: f64) -> Trace {
    let common = common_prefix(trace);
    let limit = (share.clamp(0.0, 1.0) * u64::MAX as f64) as u64;
    let keep = |i: usize| share >= 1.0 || conversation(trace, common, i) < limit;
    Trace {
        name: trace.name.clone(),
        format: trace.format,
        block_size: trace.block_size,
        requests: (0..trace.requests.len())
            .filter(|&i| keep(i))
            .map(|i| trace.requests[i].clone())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Format, Request};

    fn req(session: Option<u64>, blocks: &[u64]) -> Request {
        Request {
            time_s: 0.0,
            session,
            blocks: blocks.to_vec(),
            block_tokens: vec![16; blocks.len()],
            input_tokens: 16 * blocks.len() as u64,
            output_tokens: 1,
        }
    }

    fn trace(requests: Vec<Request>) -> Trace {
        Trace {
            name: "t".into(),
            format: Format::Generic,
            block_size: 16,
            requests,
        }
    }

    #[test]
    fn conversations_are_kept_whole_and_the_share_is_about_right() {
        // 400 conversations of 3 turns behind one shared system block.
        let mut rs = Vec::new();
        for turn in 1..=3u64 {
            for c in 0..400u64 {
                let mut blocks = vec![0];
                blocks.extend((0..turn).map(|t| 1000 + c * 10 + t));
                rs.push(req(None, &blocks));
            }
        }
        let t = trace(rs);
        let cut = conversations(&t, 0.25);
        assert_eq!(cut.requests.len() % 3, 0, "whole conversations");
        let n = cut.requests.len() / 3;
        assert!((60..=140).contains(&n), "{n} of 400 kept");
        let firsts: std::collections::BTreeSet<u64> =
            cut.requests.iter().map(|r| r.blocks[1]).collect();
        assert_eq!(firsts.len(), n);
        assert_eq!(
            cut.requests,
            conversations(&t, 0.25).requests,
            "deterministic"
        );
        assert_eq!(conversations(&t, 1.0).requests.len(), 1200);
        assert!(conversations(&t, 0.0).requests.is_empty());
    }

    #[test]
    fn named_sessions_decide_where_the_trace_has_them() {
        let t = trace((0..200u64).map(|i| req(Some(i % 50), &[i])).collect());
        let cut = conversations(&t, 0.5);
        let sessions: std::collections::BTreeSet<u64> =
            cut.requests.iter().filter_map(|r| r.session).collect();
        assert_eq!(
            cut.requests.len(),
            sessions.len() * 4,
            "every turn of a kept session"
        );
    }
}
