//! Percentiles and summaries of latency samples.

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
}
