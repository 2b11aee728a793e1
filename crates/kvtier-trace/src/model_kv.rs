//! KV bytes per token of a model, from its `config.json` or a preset: what
//! turns a capacity in bytes into blocks (`kvtier trace sim --model`) and
//! hit tokens into restore bytes (`kvtier plan`).
//!
//! Multi-head and grouped-query attention keep K and V per KV head per
//! layer; multi-head latent attention (DeepSeek's MLA, a config with
//! `kv_lora_rank`) keeps one latent vector and a rope part per token per
//! layer. Stored bytes are counted with kvtier's own codecs
//! ([`KvCodec::group_bytes`]: a group is a head's vector, or MLA's whole
//! per-layer vector, with its scale for int8 and fp8).

use std::path::Path;

use kvtier_store::{KvCodec, KvDtype};
use serde::Serialize;

/// The KV shape of a model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelKv {
    /// Where it came from (a folder or a preset name).
    pub name: String,
    /// Decoder layers.
    pub layers: u32,
    /// KV heads (GQA); 1 for MLA.
    pub kv_heads: u32,
    /// Elements per KV head vector (MLA: latent plus rope part).
    pub head_dim: u32,
    /// Vectors per head per token: 2 (K and V), 1 for MLA.
    pub vectors: u32,
    /// The KV dtype (the model's `torch_dtype`).
    #[serde(skip)]
    pub dtype: KvDtype,
    /// Parameters, when known (prefill FLOPs are about 2 per parameter per
    /// token).
    pub parameters: Option<u64>,
}

/// Presets: published shapes, so a plan needs no download.
///
/// * `llama-3.1-8b`: Meta's `config.json` for Llama-3.1-8B (32 layers,
///   8 KV heads, head dim 4096/32 = 128, bfloat16; 8.03 B parameters, the
///   model card).
/// * `llama-3.1-70b`: Meta's `config.json` for Llama-3.1-70B (80 layers,
///   8 KV heads, head dim 8192/64 = 128, bfloat16; 70.6 B parameters).
pub const PRESETS: [&str; 2] = ["llama-3.1-8b", "llama-3.1-70b"];

impl ModelKv {
    /// A preset by name, or `None`.
    pub fn preset(name: &str) -> Option<ModelKv> {
        let (layers, params) = match name {
            "llama-3.1-8b" => (32, 8_030_000_000),
            "llama-3.1-70b" => (80, 70_600_000_000),
            _ => return None,
        };
        Some(ModelKv {
            name: name.to_owned(),
            layers,
            kv_heads: 8,
            head_dim: 128,
            vectors: 2,
            dtype: KvDtype::Bf16,
            parameters: Some(params),
        })
    }

    /// A preset name or a model folder with `config.json`.
    pub fn load(spec: &str) -> Result<ModelKv, String> {
        if let Some(p) = Self::preset(spec) {
            return Ok(p);
        }
        let dir = Path::new(spec);
        if !dir.is_dir() {
            return Err(format!(
                "{spec:?} is neither a model folder nor a preset ({})",
                PRESETS.join(", ")
            ));
        }
        Self::from_config(&dir.join("config.json"))
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_config(path: &Path) -> Result<ModelKv, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
        let int = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_u64())
                .and_then(|x| u32::try_from(x).ok())
        };
        let need = |k: &str| {
            int(k)
                .filter(|x| *x > 0)
                .ok_or_else(|| format!("{}: no positive {k}", path.display()))
        };
        let layers = need("num_hidden_layers")?;
        let dtype = match v
            .get("torch_dtype")
            .and_then(|d| d.as_str())
            .unwrap_or("float32")
        {
            "bfloat16" => KvDtype::Bf16,
            "float16" => KvDtype::F16,
            _ => KvDtype::F32,
        };
        let (kv_heads, head_dim, vectors) = if let Some(latent) = int("kv_lora_rank") {
            (1, latent + int("qk_rope_head_dim").unwrap_or(0), 1)
        } else {
            let heads = need("num_attention_heads")?;
            let kv = int("num_key_value_heads").unwrap_or(heads);
            let dim = match int("head_dim") {
                Some(d) => d,
                None => need("hidden_size")? / heads,
            };
            (kv, dim, 2)
        };
        // Parameters of a Llama-style decoder, for prefill FLOPs: attention
        // (q and o of hidden x hidden, k and v of hidden x KV width), the
        // gated MLP (three hidden x intermediate), embeddings and, unless
        // tied, the output head. MLA configs are left unestimated.
        let parameters = match (
            int("hidden_size"),
            int("intermediate_size"),
            int("vocab_size"),
        ) {
            (Some(h), Some(i), Some(vocab)) if vectors == 2 => {
                let (h, i, vocab) = (u64::from(h), u64::from(i), u64::from(vocab));
                let kv = u64::from(kv_heads) * u64::from(head_dim);
                let per_layer = 2 * h * h + 2 * h * kv + 3 * h * i;
                let tied = v
                    .get("tie_word_embeddings")
                    .and_then(|t| t.as_bool())
                    .unwrap_or(false);
                Some(u64::from(layers) * per_layer + vocab * h * if tied { 1 } else { 2 })
            }
            _ => None,
        };
        Ok(ModelKv {
            name: path
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            layers,
            kv_heads,
            head_dim,
            vectors,
            dtype,
            parameters,
        })
    }

    /// Stored KV bytes of one token under `codec` (`None` when the codec
    /// cannot store the model's dtype, e.g. bf16 of bf16).
    pub fn bytes_per_token(&self, codec: KvCodec) -> Option<u64> {
        let groups = u64::from(self.layers) * u64::from(self.kv_heads) * u64::from(self.vectors);
        let codec = if codec == KvCodec::Bf16 && self.dtype != KvDtype::F32 {
            KvCodec::None
        } else {
            codec
        };
        if !codec.supports(self.dtype) {
            return None;
        }
        groups.checked_mul(codec.group_bytes(self.dtype, u64::from(self.head_dim))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_is_128_kib_a_token_and_int8_a_little_over_half() {
        let m = ModelKv::preset("llama-3.1-8b").expect("preset");
        // 32 layers x 8 heads x 2 x 128 x 2 bytes.
        assert_eq!(m.bytes_per_token(KvCodec::None), Some(131_072));
        // int8: 128 bytes and a 4-byte scale per head vector.
        assert_eq!(m.bytes_per_token(KvCodec::Int8), Some(32 * 8 * 2 * 132));
    }

    #[test]
    fn gqa_and_mla_configs() {
        let dir = tempfile::tempdir().expect("dir");
        let p = dir.path().join("config.json");
        std::fs::write(&p, r#"{"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256, "torch_dtype": "float32"}"#).expect("write");
        let m = ModelKv::from_config(&p).expect("gqa");
        assert_eq!(m.bytes_per_token(KvCodec::None), Some(4 * 2 * 2 * 32 * 4));
        assert_eq!(m.parameters, None);
        std::fs::write(&p, r#"{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": true}"#).expect("write");
        let m = ModelKv::from_config(&p).expect("gqa with sizes");
        // Per layer: 2*64*64 + 2*64*32 + 3*64*128 = 36864; embeddings 6400.
        assert_eq!(m.parameters, Some(2 * 36_864 + 6_400));
        std::fs::write(&p, r#"{"num_hidden_layers": 2, "num_attention_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}"#).expect("write");
        let m = ModelKv::from_config(&p).expect("mla");
        assert_eq!(m.bytes_per_token(KvCodec::None), Some(2 * 576 * 2));
        std::fs::write(&p, r#"{"num_attention_heads": 16}"#).expect("write");
        assert!(
            ModelKv::from_config(&p)
                .expect_err("no layers")
                .contains("num_hidden_layers")
        );
    }
}
