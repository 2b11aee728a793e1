//! How much of a restore the first token still waits for, at concurrency 1.
//!
//! A layer-wise restore aims at a TTFT of max(restore, suffix compute)
//! instead of their sum. Both parts are measured in the same run:
//!
//! * the suffix's compute is the TTFT of the same requests sent again at
//!   once, their prefixes still in G1 (nothing to restore). It holds what
//!   any request costs besides the restore (admission, the prefix lookup,
//!   the last prompt token's forward pass at the full context, sampling),
//!   so a decode step alone, which has none of that, would understate it;
//! * the restore is the restored bytes' read time at the device's raw
//!   read limit, measured between runs: a floor, so the ratio never
//!   flatters a slow read.
//!
//! `ratio` is the restored TTFT p50 over the larger of the two medians:
//! 1.0 means the restore is wholly hidden.

use serde::Serialize;

use crate::run_summary::RequestRecord;
use crate::stats::percentile;

/// The restored TTFT against the larger of its two parts (module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Overlap {
    /// TTFT p50 of the restored requests at concurrency 1, seconds.
    pub restored_ttft_p50_s: f64,
    /// TTFT p50 of the same requests with their prefixes in G1, seconds.
    pub hot_ttft_p50_s: f64,
    /// Median over requests of the restored bytes over the device's raw
    /// read limit, seconds (0 when the limit was not measured).
    pub read_floor_s: f64,
    /// `restored_ttft_p50_s / max(hot_ttft_p50_s, read_floor_s)`.
    pub ratio: f64,
}

impl Overlap {
    /// From the restored run at concurrency 1, the hot TTFT p50 and the
    /// device's read limit in GB/s. `None` without a request that restored
    /// anything, or without a positive hot TTFT.
    pub fn of(
        restored: &[RequestRecord],
        hot_ttft_p50_s: f64,
        device_limit_gbps: f64,
    ) -> Option<Self> {
        let ok: Vec<&RequestRecord> = restored
            .iter()
            .filter(|r| r.error.is_none() && r.restored_bytes > 0)
            .collect();
        if ok.is_empty() || hot_ttft_p50_s <= 0.0 {
            return None;
        }
        let ttft: Vec<f64> = ok.iter().map(|r| r.ttft_s).collect();
        let restored_ttft_p50_s = percentile(&ttft, 50.0)?;
        let read_floor_s = if device_limit_gbps > 0.0 {
            let reads: Vec<f64> = ok
                .iter()
                .map(|r| r.restored_bytes as f64 / (device_limit_gbps * 1e9))
                .collect();
            percentile(&reads, 50.0)?
        } else {
            0.0
        };
        Some(Self {
            restored_ttft_p50_s,
            hot_ttft_p50_s,
            read_floor_s,
            ratio: restored_ttft_p50_s / hot_ttft_p50_s.max(read_floor_s),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ttft: f64, bytes: u64) -> RequestRecord {
        RequestRecord {
            ttft_s: ttft,
            restored_bytes: bytes,
            ..Default::default()
        }
    }

    #[test]
    fn the_ratio_is_over_the_larger_part() {
        let runs = [
            rec(0.020, 1_000_000_000),
            rec(0.022, 1_000_000_000),
            rec(0.024, 1_000_000_000),
        ];
        // Compute (hot TTFT) is the larger part: 0.022 / 0.016.
        let o = Overlap::of(&runs, 0.016, 1000.0).expect("measured");
        assert!((o.ratio - 0.022 / 0.016).abs() < 1e-9, "{o:?}");
        assert!((o.read_floor_s - 0.001).abs() < 1e-12, "{o:?}");
        // The read is: 1 GB at 50 GB/s is 0.020 s.
        let o = Overlap::of(&runs, 0.016, 50.0).expect("measured");
        assert!((o.ratio - 0.022 / 0.020).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn nothing_restored_or_no_hot_ttft_is_not_a_ratio() {
        assert_eq!(Overlap::of(&[rec(0.02, 0)], 0.016, 1.0), None);
        assert_eq!(Overlap::of(&[rec(0.02, 10)], 0.0, 1.0), None);
        let failed = RequestRecord {
            error: Some("x".into()),
            ..rec(0.02, 10)
        };
        assert_eq!(Overlap::of(&[failed], 0.016, 1.0), None);
    }
}
