//! Prompts for a live replay (`kvtier trace replay`): token ids made from a
//! trace's block ids, so that a server sees exactly the trace's sharing.
//!
//! Each block id maps to a fixed pseudo-random run of token ids: equal ids
//! give equal runs, different ids different ones (with overwhelming
//! likelihood), so two prompts share a token prefix exactly where the trace
//! says they share blocks. Traces count blocks of hundreds of tokens and a
//! small server cannot take such prompts at the trace's rate, so a full
//! block becomes `block_tokens` tokens (the trace's block size times a
//! token scale, e.g. 512 x 1/16 = 32) and a partial last block its share of
//! that, at least one token.
//!
//! Token ids are drawn from a range the model's vocabulary holds as plain
//! tokens: by default [`DEFAULT_IDS`], ids 3 to 255, which are bytes or
//! single characters in byte-level vocabularies (GPT-2, Llama 3, Qwen2,
//! kvtier's presets) and byte-fallback tokens in Llama 2's, and never a
//! special token (those sit at the ends: Llama 2's `<unk>`, `<s>`, `</s>`
//! at 0-2, the others' far above 255), so no prompt carries a BOS or EOS
//! by chance.

use std::ops::Range;

use crate::Request;

/// The token ids prompts are drawn from by default.
pub const DEFAULT_IDS: Range<u32> = 3..256;

/// Turns requests into token-id prompts.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptBuilder {
    /// Tokens a full block of the trace becomes.
    pub block_tokens: u32,
    /// The trace's tokens per full block.
    pub trace_block_size: u32,
    /// Token ids are drawn from this range.
    pub ids: Range<u32>,
}

impl PromptBuilder {
    /// A builder for a trace of `trace_block_size`-token blocks, each
    /// becoming `block_tokens` tokens drawn from `ids`.
    pub fn new(trace_block_size: u32, block_tokens: u32, ids: Range<u32>) -> Result<Self, String> {
        if block_tokens == 0 || trace_block_size == 0 {
            return Err("block tokens and the trace's block size must be positive".into());
        }
        if ids.end < ids.start.saturating_add(2) {
            return Err(format!(
                "token ids {}..{} are too few to draw prompts from",
                ids.start, ids.end
            ));
        }
        Ok(Self {
            block_tokens,
            trace_block_size,
            ids,
        })
    }

    /// Tokens the block of `tokens` trace tokens becomes: `block_tokens`
    /// for a full block, its share of that (at least 1) for a partial one.
    pub fn tokens_of(&self, tokens: u32) -> u32 {
        let full = u64::from(self.block_tokens);
        let share = (u64::from(tokens.min(self.trace_block_size)) * full)
            .div_ceil(u64::from(self.trace_block_size));
        share.clamp(1, full) as u32
    }

    /// The prompt of a request: each block's run, head first.
    pub fn prompt(&self, request: &Request) -> Vec<u32> {
        let mut out = Vec::new();
        for (&id, &tokens) in request.blocks.iter().zip(&request.block_tokens) {
            let n = self.tokens_of(tokens);
            out.extend((0..n).map(|i| self.token(id, i)));
        }
        out
    }

    /// Token `i` of block `id`'s run.
    fn token(&self, id: u64, i: u32) -> u32 {
        let span = u64::from(self.ids.end - self.ids.start);
        self.ids.start
            + (splitmix64(id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(i)) % span) as u32
    }
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `x`.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(blocks: &[u64], tokens: &[u32]) -> Request {
        Request {
            time_s: 0.0,
            session: None,
            blocks: blocks.to_vec(),
            block_tokens: tokens.to_vec(),
            input_tokens: tokens.iter().map(|&t| u64::from(t)).sum(),
            output_tokens: 1,
        }
    }

    #[test]
    fn shared_blocks_give_a_shared_token_prefix_and_nothing_more() {
        let b = PromptBuilder::new(512, 32, 1000..32_000).expect("builder");
        let a = b.prompt(&request(&[1, 2, 3], &[512, 512, 100]));
        let c = b.prompt(&request(&[1, 2, 4], &[512, 512, 512]));
        // Two full blocks of 32 and a partial one of ceil(100/512 * 32) = 7.
        assert_eq!(a.len(), 32 + 32 + 7);
        assert_eq!(c.len(), 96);
        assert_eq!(a[..64], c[..64]);
        assert_ne!(a[64..], c[64..71]);
        // The same request again is the same prompt; ids stay in range.
        assert_eq!(a, b.prompt(&request(&[1, 2, 3], &[512, 512, 100])));
        assert!(a.iter().chain(&c).all(|&t| (1000..32_000).contains(&t)));
        // A one-token partial block still gives a token.
        assert_eq!(b.tokens_of(1), 1);
    }

    #[test]
    fn nonsense_sizes_are_refused() {
        assert!(PromptBuilder::new(512, 0, DEFAULT_IDS).is_err());
        assert!(PromptBuilder::new(0, 32, DEFAULT_IDS).is_err());
        assert!(PromptBuilder::new(512, 32, 7..8).is_err());
        let (lo, hi) = (9, 2);
        assert!(PromptBuilder::new(512, 32, lo..hi).is_err());
    }
}
