//! Text <-> tokens, through the model directory's `tokenizer.json`, plus the
//! chat prompt format.
//!
//! Chat template: kvtier renders chat messages in the ChatML form
//! (`<|im_start|>role\ncontent<|im_end|>\n`, then `<|im_start|>assistant\n`)
//! for every model. Jinja templates from `tokenizer_config.json` are not
//! interpreted yet; ChatML is what Qwen2 uses and what the embedded models
//! are built for.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::engine_error::EngineError;
use crate::model_files::{TOKENIZER_MAX_BYTES, read_bounded};

/// A loaded tokenizer.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    longest_token_bytes: usize,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// "system", "user" or "assistant".
    pub role: String,
    /// The text.
    pub content: String,
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(EngineError::Tokenizer {
                path,
                msg: "file not found".into(),
            });
        }
        let bytes = read_bounded(&path, TOKENIZER_MAX_BYTES)?;
        let inner = Tokenizer::from_bytes(bytes).map_err(|e| EngineError::Tokenizer {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        // UTF-8 length of the longest vocabulary string: at least as many
        // bytes as its token stands for (a byte-level BPE spells one byte as
        // one or two UTF-8 bytes, SentencePiece a space as three).
        let longest_token_bytes = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Self {
            inner,
            path,
            longest_token_bytes,
        })
    }

    /// Bytes of text one token can stand for at most (an upper bound): a
    /// text of `n` bytes has at least `n / longest_token_bytes()` tokens,
    /// which lets a server refuse an over-long prompt before tokenizing it.
    pub fn longest_token_bytes(&self) -> usize {
        self.longest_token_bytes
    }

    /// Token ids of `text` (special-token strings in it are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| EngineError::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })
    }

    /// Vocabulary size including special tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of a token string, if it exists.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// Renders chat messages as one ChatML prompt ending with the assistant's turn.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_tokenizer_round_trips_text_and_specials() {
        let dir = tempfile::tempdir().unwrap();
        crate::preset::build_tokenizer()
            .unwrap()
            .save(dir.path().join("tokenizer.json"), false)
            .unwrap();
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        let text = "Hello, wörld! 123\n\ttabs";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte");
        assert_eq!(tok.decode(&ids).unwrap(), text);
        let chat = render_chat(&[ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }]);
        let ids = tok.encode(&chat).unwrap();
        assert_eq!(
            ids[0],
            crate::preset::BOS_ID + 2,
            "<|im_start|> is one token"
        );
        assert!(ids.contains(&crate::preset::IM_END_ID));
        assert_eq!(tok.vocab_size(), 260);
    }

    #[test]
    fn missing_or_corrupt_tokenizer_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let e = TextTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        std::fs::write(dir.path().join("tokenizer.json"), b"{not json").unwrap();
        let e = TextTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
    }
}
