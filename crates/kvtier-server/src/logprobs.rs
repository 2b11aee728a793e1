//! Log probabilities in OpenAI's two shapes: the completions API's
//! (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat
//! API's (`content: [{token, logprob, bytes, top_logprobs}]`).
//!
//! A token is shown as its own text (special tokens spelled out; a piece of a
//! multi-byte character as U+FFFD), or, with vLLM's
//! `return_tokens_as_token_ids`, as `token_id:<id>` so clients can tell tokens
//! of equal text apart. Values are the raw model's log probabilities
//! ([`kvtier_engine::serving::sampling`]); minus infinity, which JSON cannot
//! carry, is written as -9999 (as vLLM does).

use kvtier_engine::serving::sampling::Sampled;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::app_state::AppState;

/// What JSON gets for a log probability of minus infinity (or NaN).
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// How tokens are named in a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenNames {
    /// `token_id:<id>` instead of the token's text.
    pub as_ids: bool,
}

impl TokenNames {
    /// The name of token `id`.
    pub fn name(self, state: &AppState, id: u32) -> String {
        if self.as_ids {
            return format!("token_id:{id}");
        }
        state
            .tokenizer
            .token_text(id)
            .unwrap_or_else(|_| "\u{FFFD}".to_string())
    }
}

/// A log probability as JSON writes it: finite (see [`LOGPROB_FLOOR`]),
/// and the shortest decimal that reads back as the same `f32`, so every
/// field shows one value the same way.
fn finite(l: f32) -> f64 {
    let l = if l.is_nan() {
        LOGPROB_FLOOR
    } else {
        l.max(LOGPROB_FLOOR)
    };
    l.to_string().parse().unwrap_or(f64::from(LOGPROB_FLOOR))
}

/// The completions API's `logprobs` object.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CompletionLogprobs {
    /// Each token, named.
    pub tokens: Vec<String>,
    /// Each token's log probability.
    pub token_logprobs: Vec<f64>,
    /// The most likely tokens at each position, with the chosen one.
    pub top_logprobs: Vec<Map<String, Value>>,
    /// Where each token's text starts in the choice's text (characters).
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// The object for `tokens`, whose text starts at character `offset` of
    /// the choice's text; returns it and the offset after them.
    pub fn build(
        state: &AppState,
        names: TokenNames,
        tokens: &[Sampled],
        mut offset: usize,
    ) -> (Self, usize) {
        let mut out = Self::default();
        for s in tokens {
            let Some(lp) = &s.logprobs else { continue };
            let name = names.name(state, s.token);
            let mut top = Map::new();
            for &(id, l) in &lp.top {
                top.insert(names.name(state, id), finite(l).into());
            }
            top.entry(name.clone())
                .or_insert_with(|| finite(lp.logprob).into());
            out.text_offset.push(offset);
            // Offsets follow the tokens' own texts, in characters.
            offset += state
                .tokenizer
                .token_text(s.token)
                .map_or(0, |t| t.chars().count());
            out.tokens.push(name);
            out.token_logprobs.push(finite(lp.logprob));
            out.top_logprobs.push(top);
        }
        (out, offset)
    }
}

/// One alternative of a chat logprobs entry.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatTopLogprob {
    /// The token, named.
    pub token: String,
    /// Its log probability.
    pub logprob: f64,
    /// The UTF-8 bytes of its name.
    pub bytes: Vec<u8>,
}

/// One token of the chat API's `logprobs.content`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatLogprobEntry {
    /// The token, named.
    pub token: String,
    /// Its log probability.
    pub logprob: f64,
    /// The UTF-8 bytes of its name.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its position.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// The chat API's `logprobs` object.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ChatLogprobs {
    /// One entry per token.
    pub content: Vec<ChatLogprobEntry>,
}

impl ChatLogprobs {
    /// The object for `tokens`.
    pub fn build(state: &AppState, names: TokenNames, tokens: &[Sampled]) -> Self {
        let entry = |id: u32, logprob: f32| {
            let token = names.name(state, id);
            ChatTopLogprob {
                bytes: token.as_bytes().to_vec(),
                token,
                logprob: finite(logprob),
            }
        };
        let content = tokens
            .iter()
            .filter_map(|s| {
                let lp = s.logprobs.as_ref()?;
                let chosen = entry(s.token, lp.logprob);
                Some(ChatLogprobEntry {
                    token: chosen.token,
                    logprob: chosen.logprob,
                    bytes: chosen.bytes,
                    top_logprobs: lp.top.iter().map(|&(id, l)| entry(id, l)).collect(),
                })
            })
            .collect();
        Self { content }
    }
}
