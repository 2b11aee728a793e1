//! Text <-> tokens as `transformers` does it, from a model directory's
//! `tokenizer.json` and `tokenizer_config.json`.
//!
//! * A **text prompt** is encoded with the special tokens the model adds to
//!   every input: `tokenizer.json`'s post-processor (Llama's `<s> $A`,
//!   Llama 3's `<|begin_of_text|> $A`; none for Qwen2), so the ids equal
//!   `AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`
//!   ([`TextTokenizer::encode`]).
//! * A **rendered chat prompt** already spells its special tokens (the
//!   template writes `bos_token`), so it is encoded with none added, as
//!   `apply_chat_template(..., tokenize=True)` does
//!   ([`TextTokenizer::encode_rendered`]).
//! * `tokenizer_config.json` is read for what `transformers` reads from it:
//!   the special token strings (`bos_token`, `eos_token`, ... : the chat
//!   template's variables), `add_bos_token` / `add_eos_token`, and the chat
//!   template ([`crate::text::chat_template`]).
//!
//! Decision on `add_bos_token` / `add_eos_token`: `transformers` rebuilds
//! the post-processor from them for the tokenizer classes that define
//! them, which the reference tests check, so kvtier honours them when the
//! file sets them: a BOS (EOS) the post-processor did not add is put first
//! (last) when the flag is true, and one it added is taken off when the
//! flag is false. When the file does not set them, the post-processor
//! alone decides.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::engine_error::EngineError;
use crate::model_dir::model_files::{TOKENIZER_MAX_BYTES, read_bounded};

/// Most bytes of `tokenizer_config.json` read (it can list every added
/// token and carry several templates).
pub const TOKENIZER_CONFIG_MAX_BYTES: u64 = 64 << 20;

/// A loaded tokenizer.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    longest_token_bytes: usize,
    config: TokenizerConfig,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// "system", "user", "assistant", ...
    pub role: String,
    /// The text.
    pub content: String,
}

/// The parts of `tokenizer_config.json` kvtier uses (all optional: a model
/// directory without the file has none of them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    /// Where it was read from (`None`: no file).
    pub path: Option<PathBuf>,
    /// `bos_token`.
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `unk_token`.
    pub unk_token: Option<String>,
    /// `pad_token`.
    pub pad_token: Option<String>,
    /// `add_bos_token`, when set.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`, when set.
    pub add_eos_token: Option<bool>,
    /// `chat_template`: the default one (a string, or the entry named
    /// "default" of a list of named templates).
    pub chat_template: Option<String>,
}

/// `tokenizer_config.json` as written: token fields are a string or an
/// `AddedToken` object with `content`.
#[derive(Debug, Deserialize)]
struct RawTokenizerConfig {
    #[serde(default)]
    bos_token: Option<Value>,
    #[serde(default)]
    eos_token: Option<Value>,
    #[serde(default)]
    unk_token: Option<Value>,
    #[serde(default)]
    pad_token: Option<Value>,
    #[serde(default)]
    add_bos_token: Option<bool>,
    #[serde(default)]
    add_eos_token: Option<bool>,
    #[serde(default)]
    chat_template: Option<Value>,
}

fn token_string(v: Option<Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl TokenizerConfig {
    /// Reads `dir/tokenizer_config.json`; a missing file is an empty config.
    pub fn from_dir(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let bytes = read_bounded(&path, TOKENIZER_CONFIG_MAX_BYTES)?;
        Self::from_json(&bytes)
            .map_err(|msg| EngineError::Tokenizer {
                path: path.clone(),
                msg,
            })
            .map(|c| Self {
                path: Some(path),
                ..c
            })
    }

    /// Parses the file's bytes.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        let raw: RawTokenizerConfig = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        let chat_template = match raw.chat_template {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(Value::Array(named)) => {
                let find = |want: &str| {
                    named.iter().find_map(|t| {
                        (t.get("name").and_then(Value::as_str) == Some(want))
                            .then(|| t.get("template").and_then(Value::as_str))
                            .flatten()
                    })
                };
                Some(
                    find("default")
                        .ok_or("chat_template lists named templates but none named \"default\"")?
                        .to_string(),
                )
            }
            Some(_) => return Err("chat_template must be a string or a list".into()),
        };
        Ok(Self {
            path: None,
            bos_token: token_string(raw.bos_token),
            eos_token: token_string(raw.eos_token),
            unk_token: token_string(raw.unk_token),
            pad_token: token_string(raw.pad_token),
            add_bos_token: raw.add_bos_token,
            add_eos_token: raw.add_eos_token,
            chat_template,
        })
    }
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json` and, when present,
    /// `dir/tokenizer_config.json`.
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
        let config = TokenizerConfig::from_dir(dir)?;
        Ok(Self::new(inner, path, config))
    }

    /// A tokenizer from its parts (`path` names it in errors).
    pub fn new(inner: Tokenizer, path: PathBuf, config: TokenizerConfig) -> Self {
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
        let bos_id = config
            .bos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t));
        let eos_id = config
            .eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t));
        Self {
            inner,
            path,
            longest_token_bytes,
            config,
            bos_id,
            eos_id,
        }
    }

    /// Bytes of text one token can stand for at most (an upper bound): a
    /// text of `n` bytes has at least `n / longest_token_bytes()` tokens,
    /// which lets a server refuse an over-long prompt before tokenizing it.
    pub fn longest_token_bytes(&self) -> usize {
        self.longest_token_bytes
    }

    /// What `tokenizer_config.json` said.
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    fn encode_with(&self, text: &str, specials: bool) -> Result<Vec<u32>, EngineError> {
        let enc = self
            .inner
            .encode(text, specials)
            .map_err(|e| EngineError::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of a text prompt, with the special tokens the model adds
    /// to every input (`transformers`' `tokenizer(text)`; see the module
    /// docs). Special-token strings in `text` are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let mut ids = self.encode_with(text, true)?;
        let (add_bos, add_eos) = (self.config.add_bos_token, self.config.add_eos_token);
        if add_bos.is_none() && add_eos.is_none() {
            return Ok(ids);
        }
        // What the post-processor added: the ids with specials minus the
        // plain ones, at each end.
        let plain = self.encode_with(text, false)?;
        let added_front = ids.len() > plain.len() && !ids.starts_with(&plain);
        let added_back = ids.len() > plain.len() && !ids.ends_with(&plain);
        if let Some(bos) = self.bos_id {
            match add_bos {
                Some(true) if ids.first() != Some(&bos) => ids.insert(0, bos),
                Some(false) if added_front && ids.first() == Some(&bos) => {
                    ids.remove(0);
                }
                _ => {}
            }
        }
        if let Some(eos) = self.eos_id {
            match add_eos {
                Some(true) if ids.last() != Some(&eos) => ids.push(eos),
                Some(false) if added_back && ids.last() == Some(&eos) => {
                    ids.pop();
                }
                _ => {}
            }
        }
        Ok(ids)
    }

    /// Token ids of a prompt that spells its own special tokens (a rendered
    /// chat template): none are added.
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.encode_with(text, false)
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

    /// The text one token stands for on its own, special tokens spelled
    /// out (what a logprobs entry shows; a byte-level token that is part of
    /// a multi-byte character decodes to U+FFFD).
    pub fn token_text(&self, id: u32) -> Result<String, EngineError> {
        self.inner
            .decode(&[id], false)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn embedded(dir: &Path) -> TextTokenizer {
        crate::model_dir::preset::build_tokenizer()
            .unwrap()
            .save(dir.join("tokenizer.json"), false)
            .unwrap();
        TextTokenizer::from_dir(dir).unwrap()
    }

    #[test]
    fn embedded_tokenizer_round_trips_text_and_specials() {
        let dir = tempfile::tempdir().unwrap();
        let tok = embedded(dir.path());
        let text = "Hello, wörld! 123\n\ttabs";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte");
        assert_eq!(tok.decode(&ids).unwrap(), text);
        let ids = tok
            .encode_rendered("<|im_start|>user\nhi<|im_end|>")
            .unwrap();
        assert_eq!(
            ids[0],
            crate::model_dir::preset::BOS_ID + 2,
            "<|im_start|> is one token"
        );
        assert!(ids.contains(&crate::model_dir::preset::IM_END_ID));
        assert_eq!(tok.vocab_size(), 260);
        assert_eq!(tok.token_text(u32::from(b'H')).unwrap(), "H");
        assert_eq!(
            tok.token_text(crate::model_dir::preset::IM_END_ID).unwrap(),
            "<|im_end|>"
        );
    }

    #[test]
    fn add_bos_and_eos_flags_of_the_config_are_honoured() {
        let dir = tempfile::tempdir().unwrap();
        let plain = embedded(dir.path());
        let hi = plain.encode("hi").unwrap();
        assert_eq!(
            hi,
            vec![u32::from(b'h'), u32::from(b'i')],
            "no post-processor"
        );
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>",
                "add_bos_token": true, "add_eos_token": true}"#,
        )
        .unwrap();
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        let (bos, eos) = (
            crate::model_dir::preset::BOS_ID,
            crate::model_dir::preset::EOS_ID,
        );
        assert_eq!(tok.encode("hi").unwrap(), vec![bos, hi[0], hi[1], eos]);
        assert_eq!(
            tok.encode_rendered("hi").unwrap(),
            hi,
            "a rendered prompt gets none"
        );
        assert_eq!(tok.config().bos_token.as_deref(), Some("<s>"));
    }

    #[test]
    fn named_chat_templates_pick_the_default_one() {
        let c = TokenizerConfig::from_json(
            br#"{"chat_template": [{"name": "tool_use", "template": "T"},
                                   {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(c.chat_template.as_deref(), Some("D"));
        let e =
            TokenizerConfig::from_json(br#"{"chat_template": [{"name": "x", "template": "T"}]}"#)
                .unwrap_err();
        assert!(e.contains("default"), "{e}");
        assert!(TokenizerConfig::from_json(br#"{"chat_template": 3}"#).is_err());
    }

    #[test]
    fn missing_or_corrupt_tokenizer_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let e = TextTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        std::fs::write(dir.path().join("tokenizer.json"), b"{not json").unwrap();
        let e = TextTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        embedded(dir.path());
        std::fs::write(dir.path().join("tokenizer_config.json"), b"[1, 2").unwrap();
        let e = TextTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tokenizer_config.json"), "{e}");
    }
}
