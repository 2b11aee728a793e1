//! Model configuration, read from a Hugging Face `config.json`.
//!
//! Llama (2/3), Qwen2/2.5 and Mistral share one forward pass; they differ in
//! config keys: Qwen2 has biases on the q/k/v projections, Llama 3 scales
//! RoPE frequencies (`rope_scaling.rope_type = "llama3"`), Mistral has a
//! sliding window (ignored: attention is full, which equals the windowed
//! result for sequences shorter than the window).

use std::path::Path;

use kvtier_store::{Arrangement, KvDtype, KvLayout};
use serde::Deserialize;

use crate::engine_error::EngineError;
use crate::model_files::{CONFIG_MAX_BYTES, read_bounded_text};

/// Llama 3 RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RopeScaling {
    /// "llama3" (others are rejected).
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    /// Scale factor.
    pub factor: f64,
    /// Low-frequency factor.
    #[serde(default = "one")]
    pub low_freq_factor: f64,
    /// High-frequency factor.
    #[serde(default = "four")]
    pub high_freq_factor: f64,
    /// Context length the model was trained at before scaling.
    #[serde(default = "eight_k")]
    pub original_max_position_embeddings: usize,
}

fn one() -> f64 {
    1.0
}
fn four() -> f64 {
    4.0
}
fn eight_k() -> usize {
    8192
}

/// An `eos_token_id` is a number or a list of numbers.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// All ids.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// The subset of `config.json` the engine uses.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ModelConfig {
    /// "llama", "qwen2" or "mistral".
    pub model_type: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden (residual stream) width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (grouped-query attention); defaults to the query heads.
    pub num_key_value_heads: Option<usize>,
    /// Head width; defaults to hidden_size / heads.
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// RoPE scaling (Llama 3).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Longest supported context.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// lm_head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2 always has them).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Activation (only "silu" is supported).
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Weight dtype as stored ("float32", "bfloat16", "float16").
    #[serde(default)]
    pub torch_dtype: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    4096
}
fn default_act() -> String {
    "silu".into()
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join("config.json");
        let text = read_bounded_text(&path, CONFIG_MAX_BYTES)?;
        Self::from_json(&text).map_err(|msg| EngineError::Config { path, msg })
    }

    /// Parses and validates config JSON.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let cfg: ModelConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), String> {
        match self.model_type.as_str() {
            "llama" | "qwen2" | "mistral" => {}
            other => {
                return Err(format!(
                    "unsupported model_type {other:?} (llama, qwen2, mistral)"
                ));
            }
        }
        if self.hidden_act != "silu" {
            return Err(format!(
                "unsupported hidden_act {:?} (silu)",
                self.hidden_act
            ));
        }
        // Sane ranges, far above any published model, checked before
        // anything is sized from them.
        for (name, v, max) in [
            ("vocab_size", self.vocab_size, 1 << 22),
            ("hidden_size", self.hidden_size, 1 << 16),
            ("intermediate_size", self.intermediate_size, 1 << 18),
            ("num_hidden_layers", self.num_hidden_layers, 1 << 10),
            ("num_attention_heads", self.num_attention_heads, 1 << 10),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                1 << 24,
            ),
            ("num_key_value_heads", self.kv_heads(), 1 << 10),
            ("head_dim", self.head_dim.unwrap_or(1), 1 << 12),
        ] {
            if v == 0 || v > max {
                return Err(format!("{name} {v} is out of range (1 to {max})"));
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!(
                "rope_theta {} must be a positive finite number",
                self.rope_theta
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return Err(format!(
                "rms_norm_eps {} must be in (0, 1)",
                self.rms_norm_eps
            ));
        }
        let kv = self.kv_heads();
        if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {kv}",
                self.num_attention_heads
            ));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err("hidden_size is not a multiple of num_attention_heads".into());
        }
        if !self.head_dim().is_multiple_of(2) || self.head_dim() == 0 {
            return Err(format!(
                "head_dim {} must be even and positive",
                self.head_dim()
            ));
        }
        if let Some(rs) = &self.rope_scaling {
            if rs.rope_type.as_deref().is_some_and(|t| t != "llama3") {
                return Err(format!("unsupported rope_scaling type {:?}", rs.rope_type));
            }
            for (name, v) in [
                ("factor", rs.factor),
                ("low_freq_factor", rs.low_freq_factor),
                ("high_freq_factor", rs.high_freq_factor),
            ] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(format!(
                        "rope_scaling.{name} {v} must be a positive finite number"
                    ));
                }
            }
            if rs.original_max_position_embeddings == 0 {
                return Err(
                    "rope_scaling.original_max_position_embeddings must be positive".into(),
                );
            }
        }
        Ok(())
    }

    /// Refuses a model whose weights, as f32, could not fit in `memory`
    /// bytes (0: unknown, not checked), before any of them is allocated.
    pub fn check_fits(&self, memory: u64) -> Result<(), String> {
        let weights = self.parameter_count().saturating_mul(4);
        if memory > 0 && weights > memory {
            return Err(format!(
                "its shapes imply {} parameters ({:.1} GB as f32), more than this machine's {:.1} GB of memory",
                self.parameter_count(),
                weights as f64 / 1e9,
                memory as f64 / 1e9
            ));
        }
        Ok(())
    }

    /// KV heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// True when q/k/v projections carry biases.
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias.unwrap_or(self.model_type == "qwen2")
    }

    /// End-of-sequence ids.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// The store layout of one KV block of `block_tokens` tokens (f32 KV).
    pub fn kv_layout(&self, block_tokens: usize) -> KvLayout {
        KvLayout {
            layers: self.num_hidden_layers as u32,
            kv_heads: self.kv_heads() as u32,
            head_dim: self.head_dim() as u32,
            block_tokens: block_tokens as u32,
            dtype: KvDtype::F32,
            arrangement: Arrangement::KvMajor,
            shard: None,
        }
    }

    /// Parameters, counted from the shapes.
    pub fn parameter_count(&self) -> u64 {
        let h = self.hidden_size as u64;
        let q = (self.num_attention_heads * self.head_dim()) as u64;
        let kv = (self.kv_heads() * self.head_dim()) as u64;
        let i = self.intermediate_size as u64;
        let v = self.vocab_size as u64;
        let per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers as u64 * per_layer + h + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN: &str = r#"{"model_type":"qwen2","vocab_size":100,"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-6,
        "rope_theta":1000000.0,"max_position_embeddings":512,"tie_word_embeddings":true,"eos_token_id":[1,2]}"#;

    #[test]
    fn qwen2_defaults_and_derived_sizes() {
        let c = ModelConfig::from_json(QWEN).unwrap();
        assert!(c.qkv_bias());
        assert_eq!(c.head_dim(), 16);
        assert_eq!(c.kv_heads(), 2);
        assert_eq!(c.eos_ids(), vec![1, 2]);
        let l = c.kv_layout(16);
        assert_eq!(l.payload_bytes(), 2 * 2 * 2 * 16 * 16 * 4);
    }

    #[test]
    fn bad_configs_are_clear_errors() {
        let bad_heads = QWEN.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3");
        assert!(
            ModelConfig::from_json(&bad_heads)
                .unwrap_err()
                .contains("multiple")
        );
        let bad_type = QWEN.replace("qwen2", "gpt2");
        assert!(
            ModelConfig::from_json(&bad_type)
                .unwrap_err()
                .contains("gpt2")
        );
        assert!(ModelConfig::from_json("{").is_err());
        let zero = QWEN.replace("\"hidden_size\":64", "\"hidden_size\":0");
        assert!(ModelConfig::from_json(&zero).is_err());
    }
}
