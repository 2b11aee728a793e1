//! How much of a restore the first token still waits for, at concurrency 1.
//!
//! A layer-wise restore aims at a TTFT of max(restore, suffix compute)
//! instead of their sum. Both parts are measured in the same run, in
//! pairs: after the kvtier run at concurrency 1, each session's prefix is
//! dropped again (G1, G2 where the run drops it, and the page cache) and
//! its request is sent twice in a row.
//!
//! * The first is restored, as in the run.
//! * The second finds its prefix in G1 (nothing to restore). Its TTFT is
//!   the suffix's compute with each request's own fixed costs (admission,
//!   the prefix lookup, the last prompt token's forward pass at the full
//!   context, sampling), so a decode step alone, which has none of that,
//!   would understate it.
//! * The restore is the restored bytes' read time at the device's raw
//!   read limit, measured between runs: a floor, so the ratio never
//!   flatters a slow read.
//!
//! The two of a pair run a fraction of a second apart. Taken a whole pass apart
//! instead (the first version), they drifted more than the effect measured,
//! from one run to the next, where paired runs agree closely
//! (docs/decisions.md, "Contenders in the same run"). Every pair restores the
//! whole prefix, the system prompt's blocks too, so it restores more than the
//! run's requests after the first.
//!
//! `ratio` is the restored TTFT p50 over the larger of the two medians:
//! 1.0 means the restore is wholly hidden.
//!
//! The in-process target also reports each twin's TTFT as the engine's
//! scheduler timed it, to the first token being sampled (`server_ratio`, same
//! definition). The client's TTFT ends when its thread has woken for the token;
//! on a 2-vCPU VM that wake came late after restored twins and at once after
//! hot ones, until the scheduler yielded after each step; since, the two ratios
//! agree closely (docs/decisions.md, "The scheduler yields once after each
//! step"). `ratio` stays the headline: a client is what sees a first token.
//!
//! What comes before each twin moves the ratio. The restored one follows the
//! drop of G1, G2 and the page cache; the hot one follows the restored one at
//! once. On a 2-vCPU VM, idle time before both lowered the ratio (an idle
//! server was slower to a hot first token), and a request right before the
//! restored one raised it. The page-cache drop itself favours the restored twin
//! there: without it (`kvtier bench --no-pair-cache-drop`: each restored twin
//! right after the drop of G1 and G2) the ratio was higher, alternated runs
//! against runs with it, and the forward pass waited longer for restored
//! layers. `sync` alone, the drop alone, or a sleep or spinning in its place
//! did not do what both did, and G3 on tmpfs showed the same gap, so it is not
//! the disk (docs/decisions.md, "The bench keeps its protocol"). A server that
//! drops no cache is nearer the figure without the drop. The protocol stays as
//! it is, so figures compare across runs and machines, and
//! [`Overlap::page_cache_dropped`] says which one a figure used.
//!
//! What a restored request spends over its hot twin splits in two:
//!
//! * the time its forward pass stood waiting for restored layers to land
//!   (`layer_wait_p50_s`, timed by the engine at each layer's gate): the
//!   read not overlapped by compute, mostly layer 0's;
//! * the rest: the forward pass ran slower beside the restore, whose own
//!   CPU (the checks, the decode into G1) shares the cores and the memory
//!   bus with it. On a 2-vCPU VM, work beside the forward pass added about
//!   its own duration to the TTFT (`kvtier-lab idle_ttft` measures it;
//!   docs/decisions.md, "Layer by layer, when nothing else runs"). On a
//!   host whose forward pass runs on an accelerator this part shrinks; the
//!   wait does not.

use serde::Serialize;

use crate::reporting::run_summary::RequestRecord;
use crate::reporting::stats::percentile;

/// The restored TTFT against the larger of its two parts (module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Overlap {
    /// Sessions measured both ways.
    pub pairs: usize,
    /// TTFT p50 of the restored requests, seconds.
    pub restored_ttft_p50_s: f64,
    /// TTFT p50 of the same requests sent again at once, their prefixes
    /// in G1, seconds.
    pub hot_ttft_p50_s: f64,
    /// Median over requests of the restored bytes over the device's raw
    /// read limit, seconds (0 when the limit was not measured).
    pub read_floor_s: f64,
    /// `restored_ttft_p50_s / max(hot_ttft_p50_s, read_floor_s)`.
    pub ratio: f64,
    /// Median over the restored requests of the time their forward pass
    /// waited for restored layers to land, seconds (module docs).
    pub layer_wait_p50_s: f64,
    /// The same TTFTs as the engine's scheduler timed them, to the first
    /// token being sampled, without the client thread's wake-up for it
    /// (module docs): the restored twins' p50, seconds; 0 where the target
    /// does not say (an HTTP endpoint).
    pub restored_server_ttft_p50_s: f64,
    /// The hot twins' p50 of the same, seconds; 0 where not said.
    pub hot_server_ttft_p50_s: f64,
    /// `restored_server_ttft_p50_s / max(hot_server_ttft_p50_s,
    /// read_floor_s)`; 0 where not said.
    pub server_ratio: f64,
    /// The page cache was dropped before each restored twin (the default
    /// protocol; false with `kvtier bench --no-pair-cache-drop` or where
    /// a drop failed, module docs).
    pub page_cache_dropped: bool,
}

impl Overlap {
    /// From (restored, hot) pairs of the same request and the device's
    /// read limit in GB/s. `None` unless every pair is whole: both served,
    /// the first restored something, and the second found in G1 at least
    /// every token the first had cached (else the second computed more
    /// than the first, or restored too). `page_cache_dropped`: whether the
    /// page cache was dropped before every restored twin.
    pub fn of(
        pairs: &[(RequestRecord, RequestRecord)],
        device_limit_gbps: f64,
        page_cache_dropped: bool,
    ) -> Option<Self> {
        let whole = |(r, h): &(RequestRecord, RequestRecord)| {
            r.error.is_none()
                && h.error.is_none()
                && r.restored_bytes > 0
                && h.hit_tokens.g1 > 0
                && h.hit_tokens.g1 >= r.hit_tokens.total()
        };
        if pairs.is_empty() || !pairs.iter().all(whole) {
            return None;
        }
        let restored: Vec<f64> = pairs.iter().map(|(r, _)| r.ttft_s).collect();
        let hot: Vec<f64> = pairs.iter().map(|(_, h)| h.ttft_s).collect();
        let waits: Vec<f64> = pairs.iter().map(|(r, _)| r.layer_wait_s).collect();
        let restored_ttft_p50_s = percentile(&restored, 50.0)?;
        let hot_ttft_p50_s = percentile(&hot, 50.0)?;
        if hot_ttft_p50_s <= 0.0 {
            return None;
        }
        let read_floor_s = if device_limit_gbps > 0.0 {
            let reads: Vec<f64> = pairs
                .iter()
                .map(|(r, _)| r.restored_bytes as f64 / (device_limit_gbps * 1e9))
                .collect();
            percentile(&reads, 50.0)?
        } else {
            0.0
        };
        let over_larger = |restored: f64, hot: f64| restored / hot.max(read_floor_s);
        // The scheduler's own timing, where every twin has one.
        let said = pairs
            .iter()
            .all(|(r, h)| r.server_ttft_s > 0.0 && h.server_ttft_s > 0.0);
        let (restored_server_ttft_p50_s, hot_server_ttft_p50_s, server_ratio) = if said {
            let r: Vec<f64> = pairs.iter().map(|(r, _)| r.server_ttft_s).collect();
            let h: Vec<f64> = pairs.iter().map(|(_, h)| h.server_ttft_s).collect();
            let (r, h) = (percentile(&r, 50.0)?, percentile(&h, 50.0)?);
            (r, h, over_larger(r, h))
        } else {
            (0.0, 0.0, 0.0)
        };
        Some(Self {
            pairs: pairs.len(),
            restored_ttft_p50_s,
            hot_ttft_p50_s,
            read_floor_s,
            ratio: over_larger(restored_ttft_p50_s, hot_ttft_p50_s),
            layer_wait_p50_s: percentile(&waits, 50.0)?,
            restored_server_ttft_p50_s,
            hot_server_ttft_p50_s,
            server_ratio,
            page_cache_dropped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reporting::run_summary::TierTokens;

    /// A restored request (`bytes` from G3, 800 tokens cached) and its
    /// hot twin (`g1` tokens in G1).
    fn pair(restored: f64, bytes: u64, hot: f64, g1: usize) -> (RequestRecord, RequestRecord) {
        let r = RequestRecord {
            ttft_s: restored,
            restored_bytes: bytes,
            hit_tokens: TierTokens {
                g3: 800,
                ..Default::default()
            },
            ..Default::default()
        };
        let h = RequestRecord {
            ttft_s: hot,
            hit_tokens: TierTokens {
                g1,
                ..Default::default()
            },
            ..Default::default()
        };
        (r, h)
    }

    #[test]
    fn the_ratio_is_the_restored_median_over_the_larger_part() {
        let pairs = [
            pair(0.020, 1_000_000_000, 0.015, 800),
            pair(0.022, 1_000_000_000, 0.016, 800),
            pair(0.024, 1_000_000_000, 0.030, 801),
        ];
        // Compute (hot TTFT p50 0.016) is the larger part: 0.022 / 0.016.
        let o = Overlap::of(&pairs, 1000.0, true).expect("measured");
        assert_eq!(o.pairs, 3);
        assert!((o.hot_ttft_p50_s - 0.016).abs() < 1e-12, "{o:?}");
        assert!((o.ratio - 0.022 / 0.016).abs() < 1e-9, "{o:?}");
        assert!((o.read_floor_s - 0.001).abs() < 1e-12, "{o:?}");
        // The read is: 1 GB at 50 GB/s is 0.020 s.
        let o = Overlap::of(&pairs, 50.0, true).expect("measured");
        assert!((o.ratio - 0.022 / 0.020).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn the_server_ratio_needs_the_scheduler_s_timing_of_every_twin() {
        let mut pairs = [
            pair(0.020, 1_000_000_000, 0.015, 800),
            pair(0.022, 1_000_000_000, 0.016, 800),
            pair(0.024, 1_000_000_000, 0.017, 800),
        ];
        // An HTTP endpoint says nothing: no server figures.
        let o = Overlap::of(&pairs, 1000.0, true).expect("measured");
        assert_eq!(
            (
                o.restored_server_ttft_p50_s,
                o.hot_server_ttft_p50_s,
                o.server_ratio
            ),
            (0.0, 0.0, 0.0)
        );
        for ((r, h), (rs, hs)) in
            pairs
                .iter_mut()
                .zip([(0.019, 0.0149), (0.018, 0.0150), (0.017, 0.0160)])
        {
            r.server_ttft_s = rs;
            h.server_ttft_s = hs;
        }
        let o = Overlap::of(&pairs, 1000.0, true).expect("measured");
        assert!(
            (o.restored_server_ttft_p50_s - 0.018).abs() < 1e-12,
            "{o:?}"
        );
        assert!((o.hot_server_ttft_p50_s - 0.015).abs() < 1e-12, "{o:?}");
        assert!((o.server_ratio - 0.018 / 0.015).abs() < 1e-9, "{o:?}");
        // The client's figures are untouched.
        assert!((o.ratio - 0.022 / 0.016).abs() < 1e-9, "{o:?}");
        // One twin without it: none at all, rather than a median of some.
        pairs[1].1.server_ttft_s = 0.0;
        let o = Overlap::of(&pairs, 1000.0, true).expect("measured");
        assert_eq!(o.server_ratio, 0.0);
    }

    #[test]
    fn the_layer_wait_is_the_restored_requests_median() {
        let mut pairs = [
            pair(0.020, 10, 0.015, 800),
            pair(0.022, 10, 0.016, 800),
            pair(0.024, 10, 0.017, 800),
        ];
        for ((r, h), wait) in pairs.iter_mut().zip([0.0009, 0.0001, 0.0004]) {
            r.layer_wait_s = wait;
            // A hot request restores nothing; its field is not counted.
            h.layer_wait_s = 1.0;
        }
        let o = Overlap::of(&pairs, 1.0, true).expect("measured");
        assert!((o.layer_wait_p50_s - 0.0004).abs() < 1e-12, "{o:?}");
    }

    #[test]
    fn a_pair_that_is_not_restored_then_hot_is_not_a_ratio() {
        let ok = pair(0.02, 10, 0.016, 800);
        assert!(Overlap::of(std::slice::from_ref(&ok), 1.0, true).is_some());
        assert_eq!(Overlap::of(&[], 1.0, true), None);
        // Nothing restored.
        assert_eq!(Overlap::of(&[pair(0.02, 0, 0.016, 800)], 1.0, true), None);
        // The second found less in G1 than the first had cached.
        assert_eq!(
            Overlap::of(&[ok.clone(), pair(0.02, 10, 0.016, 799)], 1.0, true),
            None
        );
        // Either failed.
        let mut failed = ok.clone();
        failed.0.error = Some("x".into());
        assert_eq!(Overlap::of(&[failed], 1.0, true), None);
        let mut failed = ok;
        failed.1.error = Some("x".into());
        assert_eq!(Overlap::of(&[failed], 1.0, true), None);
        // No hot TTFT.
        assert_eq!(Overlap::of(&[pair(0.02, 10, 0.0, 800)], 1.0, true), None);
    }
}
