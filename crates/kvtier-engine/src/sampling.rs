//! Choosing the next token from logits: greedy, temperature, nucleus (top-p),
//! reproducible with a seed.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling parameters of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: None,
        }
    }
}

/// A per-request sampler.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded from `params.seed` (or from the OS).
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self { params, rng }
    }

    /// Picks a token id from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 || logits.len() < 2 {
            return argmax(logits);
        }
        let t = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / t).exp()))
            .collect();
        let total: f32 = probs.iter().map(|p| p.1).sum();
        if !(total.is_finite() && total > 0.0) {
            return argmax(logits);
        }
        probs.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top_p = self.params.top_p.clamp(f32::MIN_POSITIVE, 1.0);
        let mut kept = 0.0;
        let mut cut = probs.len();
        for (i, p) in probs.iter().enumerate() {
            kept += p.1 / total;
            if kept >= top_p {
                cut = i + 1;
                break;
            }
        }
        let probs = &probs[..cut];
        let mass: f32 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.random_range(0.0..mass);
        for &(id, p) in probs {
            if r < p {
                return id;
            }
            r -= p;
        }
        probs.last().map_or(0, |p| p.0)
    }
}

/// Index of the largest logit (first on ties; 0 for an empty slice).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_max() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_top_p_restricts() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32) * 0.1).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            seed: Some(7),
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
        let mut s = Sampler::new(SamplingParams { top_p: 0.01, ..p });
        for _ in 0..20 {
            assert_eq!(
                s.sample(&logits),
                49,
                "tiny nucleus keeps only the top token"
            );
        }
    }
}
