//! Choosing the next token from logits, as vLLM does: logit bias, then the
//! penalties (repetition over prompt and output, presence and frequency
//! over the output), then temperature, top-k, min-p and top-p (nucleus);
//! greedy at temperature 0; reproducible with a seed. And the log
//! probabilities a client asks for, always of the raw model distribution
//! (log-softmax of the logits before any of the above; vLLM's default
//! `raw_logprobs`), so they compare with `transformers`' directly.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Most alternatives a request may ask for per token (vLLM's default
/// `max_logprobs`).
pub const MAX_LOGPROBS: usize = 20;

/// Sampling parameters of one request. `Default` is greedy with nothing
/// else.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one; 0
    /// disables it.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of every token seen in
    /// the prompt or the output; 1 disables it.
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
    /// Report each token's log probability and this many alternatives
    /// (`None`: no log probabilities).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    fn penalises(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// Log probabilities of one generated token (raw model distribution).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// Of the chosen token.
    pub logprob: f32,
    /// The most likely tokens, most likely first, with theirs.
    pub top: Vec<(u32, f32)>,
}

/// A chosen token, with its log probabilities when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token id.
    pub token: u32,
    /// Its log probabilities (`Some` when the request asked).
    pub logprobs: Option<TokenLogprobs>,
}

/// A per-request sampler: holds the tokens seen so far for the penalties.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Times each token was generated.
    counts: HashMap<u32, u32>,
    /// Tokens of the prompt (for the repetition penalty).
    prompt: HashSet<u32>,
}

impl Sampler {
    /// A sampler seeded from `params.seed` (or from the OS); `prompt` is
    /// what the repetition penalty counts besides the output.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let prompt = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            params,
            rng,
            counts: HashMap::new(),
            prompt,
        }
    }

    /// Picks a token id from `logits` and records it as generated.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let logprobs = self
            .params
            .logprobs
            .map(|n| top_logprobs(logits, n.min(MAX_LOGPROBS)));
        let token = self.choose(logits);
        *self.counts.entry(token).or_default() += 1;
        let logprobs = logprobs.map(|(lse, top)| TokenLogprobs {
            logprob: logits
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |l| l - lse),
            top,
        });
        Sampled { token, logprobs }
    }

    fn choose(&mut self, raw: &[f32]) -> u32 {
        let p = &self.params;
        if raw.len() < 2 {
            return 0;
        }
        let plain = p.logit_bias.is_empty() && !p.penalises();
        if plain && p.temperature <= 0.0 {
            return argmax(raw);
        }
        let mut logits = raw.to_vec();
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            for &id in self.prompt.iter().chain(self.counts.keys()) {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        for (&id, &n) in &self.counts {
            if let Some(l) = logits.get_mut(id as usize) {
                *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
        if p.temperature <= 0.0 {
            return argmax(&logits);
        }
        self.draw(&logits)
    }

    /// Samples from `softmax(logits / temperature)` restricted by top-k,
    /// min-p and top-p.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let t = p.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return argmax(logits);
        }
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / t).exp()))
            .filter(|&(_, w)| w > 0.0)
            .collect();
        let by_weight = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1);
        if p.top_k > 0 && p.top_k < probs.len() {
            probs.select_nth_unstable_by(p.top_k - 1, by_weight);
            probs.truncate(p.top_k);
        }
        if p.min_p > 0.0 {
            // The largest weight is exp(0) = 1 (max's own token).
            let floor = p.min_p;
            probs.retain(|&(_, w)| w >= floor);
        }
        let total: f32 = probs.iter().map(|p| p.1).sum();
        if !(total.is_finite() && total > 0.0) {
            return argmax(logits);
        }
        if p.top_p < 1.0 {
            probs.sort_unstable_by(by_weight);
            let top_p = p.top_p.clamp(f32::MIN_POSITIVE, 1.0);
            let mut kept = 0.0;
            let mut cut = probs.len();
            for (i, q) in probs.iter().enumerate() {
                kept += q.1 / total;
                if kept >= top_p {
                    cut = i + 1;
                    break;
                }
            }
            probs.truncate(cut);
        }
        let mass: f32 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.random_range(0.0..mass);
        for &(id, w) in &probs {
            if r < w {
                return id;
            }
            r -= w;
        }
        probs.last().map_or(0, |p| p.0)
    }
}

/// `log(sum(exp(logits)))` and the `n` most likely tokens with their log
/// probabilities, most likely first.
pub fn top_logprobs(logits: &[f32], n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return (max, Vec::new());
    }
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
    let n = n.min(idx.len());
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_logit);
    }
    idx.truncate(n);
    idx.sort_unstable_by(|a, b| by_logit(a, b).then(a.cmp(b)));
    let top = idx
        .into_iter()
        .map(|i| (i, logits[i as usize] - lse))
        .collect();
    (lse, top)
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

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(p, &[])
    }

    #[test]
    fn greedy_picks_the_max() {
        let mut s = sampler(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]).token, 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_top_p_restricts() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32) * 0.1).collect();
        let p = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        let draw = |p: &SamplingParams| -> Vec<u32> {
            let mut s = sampler(p.clone());
            (0..20).map(|_| s.sample(&logits).token).collect()
        };
        let a = draw(&p);
        assert_eq!(a, draw(&p));
        assert!(a.iter().collect::<HashSet<_>>().len() > 1);
        let tiny = draw(&SamplingParams {
            top_p: 0.01,
            ..p.clone()
        });
        assert!(
            tiny.iter().all(|&t| t == 49),
            "tiny nucleus keeps only the top token"
        );
    }

    #[test]
    fn top_k_and_min_p_keep_only_the_likely_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| i as f32 * 0.05).collect();
        let base = SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..Default::default()
        };
        let mut s = sampler(SamplingParams {
            top_k: 3,
            ..base.clone()
        });
        let seen: HashSet<u32> = (0..200).map(|_| s.sample(&logits).token).collect();
        assert_eq!(seen, HashSet::from([97, 98, 99]), "top-3");
        // min_p 0.9: keep tokens with weight >= 0.9 of the top one:
        // exp(-0.05 k) >= 0.9 for k <= 2.
        let mut s = sampler(SamplingParams { min_p: 0.9, ..base });
        let seen: HashSet<u32> = (0..200).map(|_| s.sample(&logits).token).collect();
        assert_eq!(seen, HashSet::from([97, 98, 99]), "min-p");
    }

    #[test]
    fn bias_and_penalties_change_the_greedy_choice() {
        let logits = [1.0, 2.0, 1.9, -3.0];
        let mut s = sampler(SamplingParams {
            logit_bias: vec![(3, 100.0)],
            ..Default::default()
        });
        assert_eq!(s.sample(&logits).token, 3, "bias +100 wins");
        // Frequency penalty: token 1 loses 0.2 per time it was generated,
        // so after one pick token 2 (1.9) leads.
        let mut s = sampler(SamplingParams {
            frequency_penalty: 0.2,
            ..Default::default()
        });
        assert_eq!(s.sample(&logits).token, 1);
        assert_eq!(s.sample(&logits).token, 2);
        // Repetition penalty 2 on a token of the prompt halves its logit.
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..Default::default()
            },
            &[1],
        );
        assert_eq!(s.sample(&logits).token, 2);
        // Presence penalty: once generated, a token loses a fixed amount.
        let mut s = sampler(SamplingParams {
            presence_penalty: 1.5,
            ..Default::default()
        });
        assert_eq!(s.sample(&logits).token, 1);
        assert_eq!(s.sample(&logits).token, 2);
        assert_eq!(s.sample(&logits).token, 0);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax_whatever_the_sampling() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 0.0];
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        let want = |i: usize| logits[i] - z.ln();
        let mut s = sampler(SamplingParams {
            logprobs: Some(3),
            temperature: 0.0,
            presence_penalty: 2.0,
            ..Default::default()
        });
        let out = s.sample(&logits);
        assert_eq!(out.token, 1, "ties go to the first");
        let lp = out.logprobs.unwrap();
        assert!((lp.logprob - want(1)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        for (id, l) in lp.top {
            assert!((l - want(id as usize)).abs() < 1e-6);
        }
        // The penalty moved the choice, not the reported distribution.
        let out = s.sample(&logits);
        assert_eq!(out.token, 3);
        assert!((out.logprobs.unwrap().logprob - want(3)).abs() < 1e-6);
        assert_eq!(
            sampler(SamplingParams::default()).sample(&logits).logprobs,
            None
        );
    }
}
