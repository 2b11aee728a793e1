//! Percentiles and summaries of samples: latency percentiles, the median
//! and paired fractions the device-relative benchmarks report, and how
//! sample lists are printed.

use serde::Serialize;

/// The `p`-th percentile (0..=100) of `samples` by linear interpolation
/// between closest ranks; `None` for no samples or a NaN.
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if samples.is_empty() || samples.iter().any(|x| x.is_nan()) || !(0.0..=100.0).contains(&p) {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = p / 100.0 * (s.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let w = rank - lo as f64;
    Some(s[lo] * (1.0 - w) + s[hi] * w)
}

/// p50, p90 and p99 of a sample set (0 when empty).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    /// Summarises `samples`.
    pub fn of(samples: &[f64]) -> Self {
        let p = |q| percentile(samples, q).unwrap_or(0.0);
        Self {
            p50: p(50.0),
            p90: p(90.0),
            p99: p(99.0),
        }
    }
}

/// The median of `v` (mean of the middle two for an even count; 0 if empty
/// or NaN).
pub fn median(v: &[f64]) -> f64 {
    percentile(v, 50.0).unwrap_or(0.0)
}

/// `a / b`, or 0 when `b` is not positive (no baseline measured).
pub fn fraction(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// For case samples taken between limit samples (`limits[k]` before sample
/// `k`, `limits[k + 1]` after it, `positions[i]` = the `k` of `samples[i]`),
/// the median of each sample over the mean of its two neighbours: robust to
/// the device drifting during the run.
pub fn paired_fraction(samples: &[f64], positions: &[usize], limits: &[f64]) -> f64 {
    let ratios: Vec<f64> = samples
        .iter()
        .zip(positions)
        .filter_map(|(&s, &k)| {
            let around = match (limits.get(k), limits.get(k + 1)) {
                (Some(a), Some(b)) => (a + b) / 2.0,
                (Some(a), None) | (None, Some(a)) => *a,
                (None, None) => return None,
            };
            (around > 0.0).then_some(s / around)
        })
        .collect();
    median(&ratios)
}

/// Samples as a table prints them: two decimals, space-separated.
pub fn format_samples(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_between_ranks() {
        let s = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&s, 0.0), Some(1.0));
        assert_eq!(percentile(&s, 100.0), Some(4.0));
        assert_eq!(percentile(&s, 50.0), Some(2.5));
        assert!((percentile(&s, 90.0).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    }

    #[test]
    fn empty_nan_and_out_of_range_are_none() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[1.0, f64::NAN], 50.0), None);
        assert_eq!(percentile(&[1.0], 101.0), None);
        assert_eq!(Percentiles::of(&[]), Percentiles::default());
    }

    #[test]
    fn paired_fractions() {
        // limit samples 1, 2, 3; case samples after limit 0 and limit 1.
        let f = paired_fraction(&[0.75, 1.25], &[0, 1], &[1.0, 2.0, 3.0]);
        assert_eq!(f, (0.5 + 0.5) / 2.0);
        assert_eq!(paired_fraction(&[1.0], &[5], &[]), 0.0);
    }

    #[test]
    fn medians_fractions_and_sample_lists() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0]), 3.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(fraction(1.0, 0.0), 0.0);
        assert_eq!(fraction(1.0, 4.0), 0.25);
        assert_eq!(format_samples(&[1.0, 2.346]), "1.00 2.35");
    }
}
