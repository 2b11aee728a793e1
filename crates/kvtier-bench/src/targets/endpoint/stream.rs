//! What a completion stream tells: timing, token counts and cache hits
//! from its OpenAI chunks and kvtier's additions.

use serde_json::Value;

use crate::reporting::report::{RequestRecord, TierTokens};

/// The `error.message` of an OpenAI-style error body, else the body itself
/// (shortened).
pub(super) fn error_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let msg = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("error"))
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    let mut s = msg.unwrap_or_else(|| body.trim().to_string());
    if s.len() > 300 {
        let mut end = 300;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

fn as_usize(v: Option<&Value>) -> Option<usize> {
    v.and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok())
}

/// What one stream told so far.
#[derive(Debug, Default)]
pub(super) struct StreamState {
    ttft_s: Option<f64>,
    pub(super) text_chunks: usize,
    pub(super) finished: bool,
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
    cached_tokens: Option<usize>,
    tiers: Option<TierTokens>,
    restored_bytes: Option<u64>,
    /// The generated text so far.
    pub(super) text: String,
    /// Generated token ids, where the server named them `token_id:N` in
    /// the log probabilities.
    pub(super) token_ids: Vec<u32>,
    /// When each generated token arrived (seconds from the request), one
    /// entry per named token, else per non-empty text chunk.
    pub(super) token_times: Vec<f64>,
}

impl StreamState {
    /// Takes in one chunk; an `Err` is an error the server streamed.
    pub(super) fn absorb(&mut self, chunk: &Value, at: f64) -> Result<(), String> {
        if let Some(e) = chunk.get("error") {
            return Err(format!(
                "server error mid-stream: {}",
                error_message(&e.to_string())
            ));
        }
        for choice in chunk
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let text = choice
                .get("text")
                .or_else(|| choice.pointer("/delta/content"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            let named: Vec<u32> = choice
                .pointer("/logprobs/tokens")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str()?.strip_prefix("token_id:")?.parse().ok())
                .collect();
            if !text.is_empty() || !named.is_empty() {
                // A named token is a token even when its text is a piece
                // of a character still incomplete.
                self.ttft_s.get_or_insert(at);
            }
            if !text.is_empty() {
                self.text_chunks += 1;
                self.text.push_str(text);
                if named.is_empty() {
                    self.token_times.push(at);
                }
            }
            self.token_times.extend(named.iter().map(|_| at));
            self.token_ids.extend(named);
            if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
                self.finished = true;
            }
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            self.prompt_tokens = as_usize(u.get("prompt_tokens")).or(self.prompt_tokens);
            self.completion_tokens =
                as_usize(u.get("completion_tokens")).or(self.completion_tokens);
            self.cached_tokens =
                as_usize(u.pointer("/prompt_tokens_details/cached_tokens")).or(self.cached_tokens);
        }
        if let Some(k) = chunk.get("kvtier").filter(|k| k.is_object()) {
            if let Some(c) = k.get("cached_tokens").filter(|c| c.is_object()) {
                let tier = |t: &str| as_usize(c.get(t)).unwrap_or(0);
                self.tiers = Some(TierTokens {
                    g1: tier("g1"),
                    g2: tier("g2"),
                    g3: tier("g3"),
                    g4: tier("g4"),
                });
            }
            self.restored_bytes = k
                .get("restored_bytes")
                .and_then(Value::as_u64)
                .or(self.restored_bytes);
        }
        Ok(())
    }

    /// Fills `rec` from what the stream told.
    pub(super) fn fill(&self, rec: &mut RequestRecord, e2e_s: f64) {
        rec.e2e_s = e2e_s;
        rec.ttft_s = self.ttft_s.unwrap_or(e2e_s);
        rec.output_tokens = self.completion_tokens.unwrap_or(self.text_chunks);
        if let Some(p) = self.prompt_tokens {
            rec.prompt_tokens = p;
        }
        rec.hit_tokens = match (self.tiers, self.cached_tokens) {
            (Some(t), _) => t,
            // Tier unknown: counted in G1 (see the module docs).
            (None, Some(c)) => TierTokens {
                g1: c,
                ..Default::default()
            },
            (None, None) => TierTokens::default(),
        };
        rec.restored_bytes = self.restored_bytes.unwrap_or(0);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn cached_tokens_without_tiers_count_as_g1_and_kvtier_tiers_win() {
        let mut s = StreamState::default();
        s.absorb(
            &json!({"choices": [{"text": "a", "finish_reason": null}]}),
            0.1,
        )
        .unwrap();
        s.absorb(
            &json!({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 32}}}),
            0.2,
        )
        .unwrap();
        let mut rec = RequestRecord::default();
        s.fill(&mut rec, 0.3);
        assert_eq!((rec.ttft_s, rec.e2e_s), (0.1, 0.3));
        assert_eq!((rec.prompt_tokens, rec.output_tokens), (40, 2));
        assert_eq!(
            rec.hit_tokens,
            TierTokens {
                g1: 32,
                g2: 0,
                g3: 0,
                g4: 0
            }
        );
        s.absorb(
            &json!({"kvtier": {"cached_tokens": {"g1": 0, "g2": 16, "g3": 16, "g4": 32}, "restored_bytes": 9}}),
            0.2,
        )
        .unwrap();
        s.fill(&mut rec, 0.3);
        assert_eq!(
            rec.hit_tokens,
            TierTokens {
                g1: 0,
                g2: 16,
                g3: 16,
                g4: 32
            }
        );
        assert_eq!(rec.restored_bytes, 9);
        assert!(
            s.absorb(&json!({"error": {"message": "boom"}}), 0.3)
                .unwrap_err()
                .contains("boom")
        );
    }
}
