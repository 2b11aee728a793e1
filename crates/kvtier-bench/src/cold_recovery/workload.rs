//! The cold-recovery workload: S sessions, each a long prompt made of a
//! shared system prompt, the session's own history (a document, earlier
//! turns) and a short question. Text is generated deterministically from a
//! seed, so every run and every target sees the same prompts.

use serde::Serialize;

/// Shape of the workload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ColdRecoveryConfig {
    /// Sessions (each replayed once per mode and concurrency).
    pub sessions: usize,
    /// Tokens of the system prompt every session shares.
    pub shared_tokens: usize,
    /// Tokens of each session's own history.
    pub history_tokens: usize,
    /// Tokens of each session's new question.
    pub question_tokens: usize,
    /// Tokens generated per request.
    pub max_tokens: usize,
    /// Concurrency levels of pass 2.
    pub concurrency: Vec<u32>,
    /// Also empty G2 before kvtier runs, so restores come from G3 (disk).
    pub evict_g2: bool,
    /// Text seed.
    pub seed: u64,
    /// Drop the page cache before each restored twin of the concurrency-1 pairs
    /// ([`crate::cold_recovery::overlap`]), as before each kvtier run (the
    /// default); off, each restored twin follows the drop of G1 and G2 at once
    /// (`kvtier bench --no-pair-cache-drop`).
    pub pair_cache_drop: bool,
}

impl Default for ColdRecoveryConfig {
    fn default() -> Self {
        Self {
            sessions: 16,
            shared_tokens: 256,
            history_tokens: 512,
            question_tokens: 24,
            max_tokens: 8,
            concurrency: vec![1, 8, 16],
            evict_g2: true,
            seed: 42,
            pair_cache_drop: true,
        }
    }
}

impl ColdRecoveryConfig {
    /// Checks the configuration before any work starts.
    pub fn validate(&self) -> Result<(), String> {
        if self.sessions == 0 {
            return Err("sessions must be at least 1".into());
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if self.concurrency.is_empty() || self.concurrency.contains(&0) {
            return Err("concurrency levels must be positive".into());
        }
        if self.shared_tokens + self.history_tokens + self.question_tokens == 0 {
            return Err("prompts would be empty".into());
        }
        Ok(())
    }
}

/// One session's prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Index.
    pub id: usize,
    /// The prompt text.
    pub text: String,
}

const WORDS: &[&str] = &[
    "storage",
    "tier",
    "cache",
    "block",
    "prefix",
    "token",
    "model",
    "engine",
    "restore",
    "device",
    "memory",
    "latency",
    "throughput",
    "energy",
    "request",
    "session",
    "document",
    "history",
    "answer",
    "question",
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "for",
    "with",
    "on",
    "by",
];

/// SplitMix64: a tiny deterministic generator for workload text.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Appends words to `out` until `count(out)` reaches `tokens` (then trims
/// characters so it does not exceed it by much).
fn grow(out: &mut String, base: usize, tokens: usize, seed: u64, count: &dyn Fn(&str) -> usize) {
    let mut state = seed;
    // Estimate first, then correct with the real count.
    while count(out) < base + tokens {
        for _ in 0..16 {
            let w = WORDS[(next(&mut state) % WORDS.len() as u64) as usize];
            out.push_str(w);
            out.push(' ');
        }
    }
    while out.len() > 1 && count(out) > base + tokens {
        out.pop();
    }
}

/// Builds the sessions; `count` gives a text's length in the target's tokens.
pub fn sessions(cfg: &ColdRecoveryConfig, count: &dyn Fn(&str) -> usize) -> Vec<Session> {
    let mut shared = String::from("System: you answer questions about storage for inference. ");
    grow(&mut shared, 0, cfg.shared_tokens, cfg.seed, count);
    (0..cfg.sessions)
        .map(|id| {
            let mut text = shared.clone();
            text.push_str(&format!("\nSession {id} history: "));
            let with_header = count(&text);
            grow(
                &mut text,
                with_header,
                cfg.history_tokens,
                cfg.seed ^ ((id as u64 + 1) * 7919),
                count,
            );
            text.push_str("\nQuestion: ");
            let qh = count(&text);
            grow(
                &mut text,
                qh,
                cfg.question_tokens.max(1),
                cfg.seed ^ ((id as u64 + 1) * 104_729),
                count,
            );
            Session { id, text }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_share_a_prefix_differ_after_and_are_deterministic() {
        let cfg = ColdRecoveryConfig {
            sessions: 3,
            shared_tokens: 100,
            history_tokens: 200,
            question_tokens: 10,
            ..Default::default()
        };
        let bytes = |s: &str| s.len();
        let a = sessions(&cfg, &bytes);
        let b = sessions(&cfg, &bytes);
        assert_eq!(a, b);
        assert_eq!(a.len(), 3);
        let shared = a[0].text.split("\nSession").next().unwrap();
        assert!(a.iter().all(|s| s.text.starts_with(shared)));
        assert_ne!(a[0].text, a[1].text);
        for s in &a {
            let n = s.text.len();
            // 310 requested plus the two short headers.
            assert!((310..=360).contains(&n), "prompt of {n} bytes");
        }
    }

    #[test]
    fn zero_sessions_or_concurrency_is_rejected() {
        let mut c = ColdRecoveryConfig::default();
        assert!(c.validate().is_ok());
        c.sessions = 0;
        assert!(c.validate().unwrap_err().contains("sessions"));
        let c = ColdRecoveryConfig {
            concurrency: vec![0],
            ..Default::default()
        };
        assert!(c.validate().is_err());
    }
}
