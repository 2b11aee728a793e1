//! `kvtier trace stats`: what a trace holds and how much of it repeats.

use std::collections::HashSet;

use serde::Serialize;

use crate::Trace;
use crate::prefix::PrefixTree;

/// A trace's statistics (the `trace` object of `kvtier trace sim --json`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TraceStats {
    /// The trace's name.
    pub name: String,
    /// The format it was read as.
    pub format: String,
    /// Tokens per full block.
    pub block_size: u32,
    /// Requests.
    pub requests: usize,
    /// Seconds from the first arrival to the last.
    pub time_span_s: f64,
    /// Distinct sessions (0 when the trace has none).
    pub sessions: usize,
    /// Distinct block ids.
    pub unique_blocks: usize,
    /// Distinct blocks keyed by their whole prefix (what a cache holds).
    pub unique_prefix_blocks: usize,
    /// Block occurrences over all requests.
    pub block_occurrences: u64,
    /// Mean prompt tokens.
    pub mean_input_tokens: f64,
    /// Median prompt tokens.
    pub median_input_tokens: f64,
    /// Mean generated tokens.
    pub mean_output_tokens: f64,
    /// Median generated tokens.
    pub median_output_tokens: f64,
    /// Share of block occurrences whose id was seen before.
    pub repeat_fraction_blocks: f64,
    /// The same, weighted by the blocks' tokens.
    pub repeat_fraction_tokens: f64,
    /// Token hit rate of an infinite cache with the prefix rule, over the
    /// whole trace.
    pub infinite_prefix_hit_tokens: f64,
    /// The same over the second half (the simulator's default measured
    /// part): the ceiling of every policy's curve.
    pub infinite_prefix_hit_tokens_second_half: f64,
}

/// Computes a trace's statistics.
pub fn stats(trace: &Trace) -> TraceStats {
    let r = &trace.requests;
    let span = match (r.first(), r.last()) {
        (Some(a), Some(b)) => b.time_s - a.time_s,
        _ => 0.0,
    };
    let sessions: HashSet<u64> = r.iter().filter_map(|q| q.session).collect();
    let mut seen = HashSet::new();
    let (mut occurrences, mut repeats, mut tokens, mut repeat_tokens) = (0u64, 0u64, 0u64, 0u64);
    for q in r {
        for (&b, &t) in q.blocks.iter().zip(&q.block_tokens) {
            occurrences += 1;
            tokens += u64::from(t);
            if !seen.insert(b) {
                repeats += 1;
                repeat_tokens += u64::from(t);
            }
        }
    }
    let tree = PrefixTree::new(trace);
    let share = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    TraceStats {
        name: trace.name.clone(),
        format: trace.format.as_str().to_owned(),
        block_size: trace.block_size,
        requests: r.len(),
        time_span_s: span,
        sessions: sessions.len(),
        unique_blocks: seen.len(),
        unique_prefix_blocks: tree.unique_blocks(),
        block_occurrences: occurrences,
        mean_input_tokens: mean(r.iter().map(|q| q.input_tokens)),
        median_input_tokens: median(r.iter().map(|q| q.input_tokens)),
        mean_output_tokens: mean(r.iter().map(|q| q.output_tokens)),
        median_output_tokens: median(r.iter().map(|q| q.output_tokens)),
        repeat_fraction_blocks: share(repeats, occurrences),
        repeat_fraction_tokens: share(repeat_tokens, tokens),
        infinite_prefix_hit_tokens: tree.infinite_hits(0).token_rate(),
        infinite_prefix_hit_tokens_second_half: tree
            .infinite_hits(tree.measured_from(0.5))
            .token_rate(),
    }
}

fn mean(v: impl Iterator<Item = u64>) -> f64 {
    let (mut s, mut n) = (0u128, 0u64);
    for x in v {
        s += u128::from(x);
        n += 1;
    }
    if n == 0 { 0.0 } else { s as f64 / n as f64 }
}

fn median(v: impl Iterator<Item = u64>) -> f64 {
    let mut v: Vec<u64> = v.collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m] as f64
    } else {
        (v[m - 1] as f64 + v[m] as f64) / 2.0
    }
}

/// The statistics as the text `kvtier trace stats` prints.
pub fn text(s: &TraceStats) -> String {
    let pct = |x: f64| format!("{:.2} %", x * 100.0);
    [
        (
            "trace",
            format!("{} ({}, {}-token blocks)", s.name, s.format, s.block_size),
        ),
        ("requests", s.requests.to_string()),
        ("time span", format!("{:.1} s", s.time_span_s)),
        ("sessions", s.sessions.to_string()),
        (
            "unique blocks",
            format!(
                "{} ({} keyed by prefix)",
                s.unique_blocks, s.unique_prefix_blocks
            ),
        ),
        ("block occurrences", s.block_occurrences.to_string()),
        (
            "input tokens",
            format!(
                "mean {:.1}, median {:.1}",
                s.mean_input_tokens, s.median_input_tokens
            ),
        ),
        (
            "output tokens",
            format!(
                "mean {:.1}, median {:.1}",
                s.mean_output_tokens, s.median_output_tokens
            ),
        ),
        (
            "repeat fraction",
            format!(
                "{} of blocks, {} of tokens",
                pct(s.repeat_fraction_blocks),
                pct(s.repeat_fraction_tokens)
            ),
        ),
        (
            "infinite-cache prefix hit",
            format!(
                "{} of tokens ({} over the second half)",
                pct(s.infinite_prefix_hit_tokens),
                pct(s.infinite_prefix_hit_tokens_second_half)
            ),
        ),
    ]
    .iter()
    .map(|(k, v)| format!("{k:<26} {v}\n"))
    .collect()
}
