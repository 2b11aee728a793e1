//! The embedded default models: deterministic random-weight Llama-architecture
//! models written as a normal Hugging Face model directory (`config.json`,
//! `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` with a
//! ChatML chat template), so everything runs with no
//! download, through exactly the code that loads real models.
//!
//! * `tiny`: 2 layers, hidden 64: milliseconds per token; for tests.
//! * `small`: 8 layers, hidden 1024, GQA 16/4 heads, MLP 2816: about 90 M
//!   parameters (360 MB f32), large enough that a couple of thousand tokens
//!   of prefill take seconds on a 2-core machine.
//!
//! The tokenizer is byte-level BPE with no merges (one token per byte, GPT-2's
//! byte-to-unicode alphabet) plus four special tokens; it round-trips any
//! UTF-8 text. Weights are uniform with standard deviation 0.02 from a seeded
//! generator: the same seed gives the same bytes on every machine.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype as StDtype, TensorView as StView};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::engine_error::EngineError;

/// Special tokens of the embedded tokenizer, in id order after the 256 bytes.
pub const SPECIAL_TOKENS: [&str; 4] = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"];
/// Id of `<s>`.
pub const BOS_ID: u32 = 256;
/// Id of `</s>`.
pub const EOS_ID: u32 = 257;
/// Id of `<|im_end|>` (end of a chat turn; also a stop token).
pub const IM_END_ID: u32 = 259;

/// A named preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// For tests.
    Tiny,
    /// For benchmarks (~90 M parameters).
    Small,
}

impl Preset {
    /// Parses "tiny" or "small".
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Preset::Tiny),
            "small" => Some(Preset::Small),
            _ => None,
        }
    }

    /// The preset's name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
        }
    }

    /// Its `config.json` (with `seed` recorded for reference).
    pub fn config_json(self, seed: u64) -> serde_json::Value {
        let (hidden, layers, heads, kv_heads, inter) = match self {
            Preset::Tiny => (64, 2, 4, 2, 128),
            Preset::Small => (1024, 8, 16, 4, 2816),
        };
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 256 + SPECIAL_TOKENS.len(),
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": false,
            "hidden_act": "silu",
            "bos_token_id": BOS_ID,
            "eos_token_id": [EOS_ID, IM_END_ID],
            "torch_dtype": "float32",
            "kvtier_preset": self.name(),
            "kvtier_seed": seed,
        })
    }
}

/// GPT-2's reversible map from bytes to printable characters.
pub fn byte_alphabet() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = vec!['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        map[b as usize] = char::from_u32(c).unwrap_or('?');
    }
    map
}

/// Builds the embedded byte-level tokenizer.
pub fn build_tokenizer() -> Result<Tokenizer, EngineError> {
    let err = |m: String| EngineError::Tokenizer {
        path: "tokenizer.json".into(),
        msg: m,
    };
    let vocab: Vec<(String, u32)> = byte_alphabet()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(
            vocab
                .into_iter()
                .collect::<tokenizers::models::bpe::Vocab>(),
            Vec::new(),
        )
        .build()
        .map_err(|e| err(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, false, false);
    tok.with_pre_tokenizer(Some(byte_level));
    tok.with_decoder(Some(byte_level));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|s| AddedToken::from(*s, true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| err(e.to_string()))?;
    Ok(tok)
}

struct Owned {
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Writes the preset model into `dir` (created if needed). Deterministic in
/// `seed`. Returns the parameter count.
pub fn write_preset(preset: Preset, seed: u64, dir: &Path) -> Result<u64, EngineError> {
    let io = |path: &Path, e: std::io::Error| EngineError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let cfg_json = preset.config_json(seed);
    let cfg_text =
        serde_json::to_string_pretty(&cfg_json).map_err(|e| EngineError::Weights(e.to_string()))?;
    let cfg = crate::model_dir::model_config::ModelConfig::from_json(&cfg_text).map_err(|msg| {
        EngineError::Config {
            path: dir.join("config.json"),
            msg,
        }
    })?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tensors: Vec<(String, Owned)> = Vec::new();
    let bound = 0.02f32 * 3f32.sqrt();
    let mut random = |shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        let mut data = Vec::with_capacity(n * 4);
        for _ in 0..n {
            let x: f32 = rng.random_range(-bound..bound);
            data.extend_from_slice(&x.to_le_bytes());
        }
        Owned { shape, data }
    };
    let ones = |n: usize| Owned {
        shape: vec![n],
        data: 1f32.to_le_bytes().repeat(n),
    };
    let h = cfg.hidden_size;
    let hd = cfg.head_dim();
    let q = cfg.num_attention_heads * hd;
    let kv = cfg.kv_heads() * hd;
    let i = cfg.intermediate_size;
    tensors.push((
        "model.embed_tokens.weight".into(),
        random(vec![cfg.vocab_size, h]),
    ));
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        tensors.push((format!("{p}.self_attn.q_proj.weight"), random(vec![q, h])));
        tensors.push((format!("{p}.self_attn.k_proj.weight"), random(vec![kv, h])));
        tensors.push((format!("{p}.self_attn.v_proj.weight"), random(vec![kv, h])));
        tensors.push((format!("{p}.self_attn.o_proj.weight"), random(vec![h, q])));
        tensors.push((format!("{p}.mlp.gate_proj.weight"), random(vec![i, h])));
        tensors.push((format!("{p}.mlp.up_proj.weight"), random(vec![i, h])));
        tensors.push((format!("{p}.mlp.down_proj.weight"), random(vec![h, i])));
        tensors.push((format!("{p}.input_layernorm.weight"), ones(h)));
        tensors.push((format!("{p}.post_attention_layernorm.weight"), ones(h)));
    }
    tensors.push(("model.norm.weight".into(), ones(h)));
    tensors.push(("lm_head.weight".into(), random(vec![cfg.vocab_size, h])));

    let views = tensors
        .iter()
        .map(|(name, t)| {
            StView::new(StDtype::F32, t.shape.clone(), &t.data)
                .map(|v| (name.clone(), v))
                .map_err(|e| EngineError::Weights(format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let st_path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &st_path)
        .map_err(|e| EngineError::Weights(format!("{}: {e}", st_path.display())))?;
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, cfg_text).map_err(|e| io(&cfg_path, e))?;
    let tok_path = dir.join("tokenizer.json");
    build_tokenizer()?
        .save(&tok_path, true)
        .map_err(|e| EngineError::Tokenizer {
            path: tok_path.clone(),
            msg: e.to_string(),
        })?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc = serde_json::to_string_pretty(&tokenizer_config())
        .map_err(|e| EngineError::Weights(e.to_string()))?;
    std::fs::write(&tc_path, tc).map_err(|e| io(&tc_path, e))?;
    Ok(cfg.parameter_count())
}

/// The presets' `tokenizer_config.json`: their special tokens, no BOS
/// added to text prompts (as Qwen2), and the ChatML chat template they
/// were built for.
pub fn tokenizer_config() -> serde_json::Value {
    serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "add_bos_token": false,
        "add_eos_token": false,
        "chat_template": crate::text::chat_template::DEFAULT_TEMPLATE,
    })
}
