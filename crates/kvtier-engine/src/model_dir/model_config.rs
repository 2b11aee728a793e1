//! Model configuration, read from a Hugging Face `config.json` as
//! `transformers` 4.x or 5.x writes it.
//!
//! One forward pass serves every supported family; they differ in config
//! keys and weight names:
//!
//! * **Llama** (2, 3): Llama 3 scales RoPE frequencies
//!   (`rope_type: "llama3"`).
//! * **Qwen2** / 2.5: biases on the q/k/v projections.
//! * **Mistral**: a sliding attention window on every layer.
//! * **Qwen3**: RMSNorm of each head's queries and keys (`q_norm`,
//!   `k_norm`), an explicit `head_dim`.
//! * **Phi-3**: fused `qkv_proj` and `gate_up_proj` weights, an optional
//!   sliding window and partial rotary dimensions. Chosen as the second
//!   family beside Qwen3 (over Gemma 2) because it is the same decoder as
//!   Llama with its weights packed differently, so the reference tests
//!   check the weight loading and the window rather than a new block
//!   shape; Gemma 2 would need logit soft-capping, GeGLU, four norms per
//!   layer and alternating window layers.
//!
//! RoPE: the base `rope_theta`, and scaling `default`, `linear`, `llama3`
//! or `yarn` (attention factor, `beta_fast`/`beta_slow`, `truncate`), read
//! from 5.x's `rope_parameters` or 4.x's `rope_theta` + `rope_scaling`
//! ([`ModelConfig::rope`]). Sliding windows are honoured per layer
//! ([`ModelConfig::layer_window`]), so a long sequence gets the windowed
//! attention `transformers` computes, never a silent full one.

use std::path::Path;

use kvtier_store::{Arrangement, KvDtype, KvLayout};
use serde::Deserialize;

use crate::engine_error::EngineError;
use crate::model_dir::model_files::{CONFIG_MAX_BYTES, read_bounded_text};

/// RoPE parameters as a config writes them: 4.x's `rope_scaling` or 5.x's
/// `rope_parameters` (which also holds `rope_theta`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct RopeScaling {
    /// `default`, `linear`, `llama3` or `yarn` (others are refused).
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    /// The base (5.x keeps it here).
    pub rope_theta: Option<f64>,
    /// Scale factor.
    pub factor: Option<f64>,
    /// Llama 3: low-frequency factor.
    pub low_freq_factor: Option<f64>,
    /// Llama 3: high-frequency factor.
    pub high_freq_factor: Option<f64>,
    /// Context length the model was trained at before scaling.
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN: rotations where extrapolation ends.
    pub beta_fast: Option<f64>,
    /// YaRN: rotations where interpolation starts.
    pub beta_slow: Option<f64>,
    /// YaRN: scale of cos/sin (derived from `factor` when absent).
    pub attention_factor: Option<f64>,
    /// YaRN: `mscale` of the derived attention factor.
    pub mscale: Option<f64>,
    /// YaRN: `mscale_all_dim` of the derived attention factor.
    pub mscale_all_dim: Option<f64>,
    /// YaRN: round the correction range to whole dimensions (default true).
    pub truncate: Option<bool>,
    /// Share of each head's dimensions that rotate (5.x keeps it here).
    pub partial_rotary_factor: Option<f64>,
}

/// How RoPE frequencies are scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeKind {
    /// No scaling.
    Default,
    /// Positions divided by `factor`.
    Linear {
        /// Scale factor.
        factor: f64,
    },
    /// Llama 3's piecewise frequency scaling.
    Llama3 {
        /// Scale factor.
        factor: f64,
        /// Low-frequency factor.
        low_freq_factor: f64,
        /// High-frequency factor.
        high_freq_factor: f64,
        /// Pretraining context.
        original: usize,
    },
    /// YaRN (arXiv 2309.00071), as `transformers` computes it.
    Yarn {
        /// Scale factor.
        factor: f64,
        /// Pretraining context.
        original: usize,
        /// Rotations where extrapolation ends.
        beta_fast: f64,
        /// Rotations where interpolation starts.
        beta_slow: f64,
        /// Round the correction range to whole dimensions.
        truncate: bool,
    },
}

/// RoPE as the model uses it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    /// The base.
    pub theta: f64,
    /// Dimensions of each head that rotate (even; the rest pass through).
    pub rotary_dim: usize,
    /// Frequency scaling.
    pub kind: RopeKind,
    /// Scale of the cos/sin tables (YaRN's attention factor; 1 otherwise).
    pub attention_factor: f64,
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
    /// "llama", "qwen2", "mistral", "qwen3" or "phi3".
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
    /// RoPE base (4.x; 5.x keeps it in `rope_parameters`).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE scaling (4.x).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// RoPE base and scaling (5.x).
    #[serde(default)]
    pub rope_parameters: Option<RopeScaling>,
    /// Share of each head's dimensions that rotate (4.x).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Pretraining context, outside the RoPE parameters (Phi-3).
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// Sliding attention window (Mistral, Phi-3; Qwen2/3 when
    /// `use_sliding_window`).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen2/3: whether `sliding_window` applies.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Qwen2/3: layers from this one on use the window.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// Attention kind per layer (`full_attention`, `sliding_attention`).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Biases on the MLP projections (refused when true).
    #[serde(default)]
    pub mlp_bias: Option<bool>,
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
            "llama" | "qwen2" | "mistral" | "qwen3" | "phi3" => {}
            other => {
                return Err(format!(
                    "unsupported model_type {other:?} (llama, qwen2, mistral, qwen3, phi3)"
                ));
            }
        }
        if self.mlp_bias == Some(true) {
            return Err("mlp_bias = true is not supported (MLP projections without bias)".into());
        }
        if let Some(w) = self.sliding_window
            && w == 0
        {
            return Err("sliding_window 0 is out of range (at least 1)".into());
        }
        if let Some(types) = &self.layer_types {
            if types.len() != self.num_hidden_layers {
                return Err(format!(
                    "layer_types lists {} layers, num_hidden_layers is {}",
                    types.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(bad) = types
                .iter()
                .find(|t| *t != "full_attention" && *t != "sliding_attention")
            {
                return Err(format!(
                    "unsupported layer type {bad:?} (full_attention, sliding_attention)"
                ));
            }
            if types.iter().any(|t| t == "sliding_attention") && self.sliding_window.is_none() {
                return Err(
                    "layer_types has sliding_attention but sliding_window is not set".into(),
                );
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
        self.rope().map(|_| ())
    }

    /// RoPE as the model uses it: 5.x's `rope_parameters`, else 4.x's
    /// `rope_theta` and `rope_scaling`; an unsupported or out-of-range
    /// setting is an error naming it.
    pub fn rope(&self) -> Result<RopeParams, String> {
        let rs = self
            .rope_parameters
            .clone()
            .or_else(|| self.rope_scaling.clone())
            .unwrap_or_default();
        let theta = rs.rope_theta.or(self.rope_theta).unwrap_or(10_000.0);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(format!(
                "rope_theta {theta} must be a positive finite number"
            ));
        }
        let partial = rs
            .partial_rotary_factor
            .or(self.partial_rotary_factor)
            .unwrap_or(1.0);
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(format!("partial_rotary_factor {partial} must be in (0, 1]"));
        }
        let rotary_dim = (self.head_dim() as f64 * partial) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(format!(
                "partial_rotary_factor {partial} gives {rotary_dim} rotary dimensions of {} \
                 (an even number is needed)",
                self.head_dim()
            ));
        }
        let positive = |name: &str, v: Option<f64>, default: Option<f64>| match v.or(default) {
            Some(v) if v.is_finite() && v > 0.0 => Ok(v),
            Some(v) => Err(format!(
                "rope_scaling.{name} {v} must be a positive finite number"
            )),
            None => Err(format!("rope_scaling.{name} is missing")),
        };
        // Phi-3 keeps the pretraining length outside the RoPE parameters,
        // and it wins there (as in transformers).
        let original = self
            .original_max_position_embeddings
            .or(rs.original_max_position_embeddings);
        let kind = match rs.rope_type.as_deref() {
            None | Some("default") => RopeKind::Default,
            Some("linear") => RopeKind::Linear {
                factor: positive("factor", rs.factor, None)?,
            },
            Some("llama3") => RopeKind::Llama3 {
                factor: positive("factor", rs.factor, None)?,
                low_freq_factor: positive("low_freq_factor", rs.low_freq_factor, Some(1.0))?,
                high_freq_factor: positive("high_freq_factor", rs.high_freq_factor, Some(4.0))?,
                original: original.unwrap_or(8192),
            },
            Some("yarn") => {
                let original = original.unwrap_or(self.max_position_embeddings);
                let factor = match rs.factor {
                    Some(f) => positive("factor", Some(f), None)?,
                    None => self.max_position_embeddings as f64 / original.max(1) as f64,
                };
                RopeKind::Yarn {
                    factor,
                    original,
                    beta_fast: positive("beta_fast", rs.beta_fast, Some(32.0))?,
                    beta_slow: positive("beta_slow", rs.beta_slow, Some(1.0))?,
                    truncate: rs.truncate.unwrap_or(true),
                }
            }
            Some(other) => {
                return Err(format!(
                    "unsupported rope_scaling type {other:?} (default, linear, llama3, yarn)"
                ));
            }
        };
        if let RopeKind::Llama3 { original: 0, .. } | RopeKind::Yarn { original: 0, .. } = kind {
            return Err("rope_scaling.original_max_position_embeddings must be positive".into());
        }
        let attention_factor = match kind {
            RopeKind::Yarn { factor, .. } => match rs.attention_factor {
                Some(a) => positive("attention_factor", Some(a), None)?,
                None => match (rs.mscale, rs.mscale_all_dim) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                },
            },
            _ => 1.0,
        };
        Ok(RopeParams {
            theta,
            rotary_dim,
            kind,
            attention_factor,
        })
    }

    /// The sliding attention window of layer `layer` (`None`: full
    /// attention), as `transformers` decides it: `layer_types` when given;
    /// else Mistral and Phi-3 window every layer when `sliding_window` is
    /// set, Qwen2/3 only with `use_sliding_window` from
    /// `max_window_layers` on.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let w = self.sliding_window?;
        if let Some(types) = &self.layer_types {
            return (types.get(layer).map(String::as_str) == Some("sliding_attention"))
                .then_some(w);
        }
        match self.model_type.as_str() {
            "mistral" | "phi3" => Some(w),
            "qwen2" | "qwen3" => (self.use_sliding_window == Some(true)
                && layer >= self.max_window_layers.unwrap_or(0))
            .then_some(w),
            _ => None,
        }
    }

    /// True when each head's queries and keys are RMS-normed (Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.model_type == "qwen3"
    }

    /// True when q/k/v and gate/up weights come fused (Phi-3).
    pub fn fused_weights(&self) -> bool {
        self.model_type == "phi3"
    }
}

/// YaRN's `mscale` (its Eq. 21): `0.1 * mscale * ln(scale) + 1`, 1 for
/// `scale <= 1`.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl ModelConfig {
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

    /// End-of-sequence ids of the model's `generation_config.json` too
    /// (instruction-tuned models list their end-of-turn tokens there), when
    /// the directory has one; a bad file is ignored with a warning (it only
    /// adds stop tokens).
    pub fn eos_ids_in(&self, dir: &Path) -> Vec<u32> {
        let mut ids = self.eos_ids();
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return ids;
        }
        #[derive(Deserialize)]
        struct Generation {
            #[serde(default)]
            eos_token_id: Option<TokenIds>,
        }
        let parsed = read_bounded_text(&path, CONFIG_MAX_BYTES)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<Generation>(&t).map_err(|e| e.to_string()));
        match parsed {
            Ok(g) => {
                for id in g
                    .eos_token_id
                    .as_ref()
                    .map(TokenIds::to_vec)
                    .unwrap_or_default()
                {
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
            }
            Err(e) => tracing::warn!("ignoring {}: {e}", path.display()),
        }
        ids
    }

    /// End-of-sequence ids.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// The store layout of one KV block of `block_tokens` tokens: f32 KV,
    /// layer-major (a G1 page's own order, `kv_pool.rs`), uncoded.
    pub fn kv_layout(&self, block_tokens: usize) -> KvLayout {
        KvLayout {
            arrangement: Arrangement::LayerMajor,
            ..KvLayout::kv_major(
                self.num_hidden_layers as u32,
                self.kv_heads() as u32,
                self.head_dim() as u32,
                block_tokens as u32,
                KvDtype::F32,
            )
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
