//! The decoder-only transformer (Llama / Qwen2 / Mistral) on candle, with its
//! KV in the external paged pool ([`KvPool`]) instead of a private cache.
//!
//! [`Model::forward`] runs any mix of prefill chunks and decode tokens of
//! different sequences in one pass: the projections and MLP see all tokens
//! as one matrix (batched), attention runs per sequence against its pages.

use candle_core::{D, DType, Device, Tensor};
use candle_nn::{Linear, Module};

use crate::attention::{paged_attention, sequence_mask};
use crate::engine_error::EngineError;
use crate::kv_pool::{KvPool, PageId};
use crate::model_config::ModelConfig;
use crate::rope::Rope;
use crate::weights::Weights;

/// One sequence's share of a forward pass.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    /// Tokens to run (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Absolute position of the first token.
    pub start: usize,
    /// The sequence's pages, covering positions `0..start + tokens.len()`.
    pub table: &'a [PageId],
}

#[derive(Debug)]
struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Tensor,
    post_norm: Tensor,
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    rope: Rope,
    device: Device,
}

impl Model {
    /// Builds the model from loaded weights (checked against the config).
    pub fn new(
        cfg: ModelConfig,
        w: &mut Weights,
        max_positions: usize,
        device: &Device,
    ) -> Result<Self, EngineError> {
        let h = cfg.hidden_size;
        let hd = cfg.head_dim();
        let q_out = cfg.num_attention_heads * hd;
        let kv_out = cfg.kv_heads() * hd;
        let i = cfg.intermediate_size;
        let bias = cfg.qkv_bias();
        let embed = w.take("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let lin = |w: &mut Weights,
                       name: &str,
                       out: usize,
                       inp: usize,
                       b: bool|
             -> Result<Linear, EngineError> {
                let weight = w.take(&format!("{p}.{name}.weight"), &[out, inp])?;
                let bias = if b {
                    Some(w.take(&format!("{p}.{name}.bias"), &[out])?)
                } else {
                    None
                };
                Ok(Linear::new(weight, bias))
            };
            layers.push(Layer {
                q: lin(w, "self_attn.q_proj", q_out, h, bias)?,
                k: lin(w, "self_attn.k_proj", kv_out, h, bias)?,
                v: lin(w, "self_attn.v_proj", kv_out, h, bias)?,
                o: lin(w, "self_attn.o_proj", h, q_out, false)?,
                gate: lin(w, "mlp.gate_proj", i, h, false)?,
                up: lin(w, "mlp.up_proj", i, h, false)?,
                down: lin(w, "mlp.down_proj", h, i, false)?,
                input_norm: w.take(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_norm: w.take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            });
        }
        let norm = w.take("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") {
            Linear::new(embed.clone(), None)
        } else {
            Linear::new(w.take("lm_head.weight", &[cfg.vocab_size, h])?, None)
        };
        let rope = Rope::new(&cfg, max_positions.min(cfg.max_position_embeddings), device)?;
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            device: device.clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device tensors live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Longest sequence the RoPE tables cover.
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// Runs `segs`, writing their K/V into `pool`, and returns the logits of
    /// each segment's last token, `(segments, vocab)`.
    pub fn forward(&self, pool: &KvPool, segs: &[Segment<'_>]) -> Result<Tensor, EngineError> {
        let cfg = &self.cfg;
        let heads = cfg.num_attention_heads;
        let kvh = cfg.kv_heads();
        let hd = cfg.head_dim();
        let eps = cfg.rms_norm_eps as f32;
        let mut ids = Vec::new();
        let mut lasts = Vec::with_capacity(segs.len());
        for s in segs {
            if s.tokens.is_empty() {
                return Err(EngineError::Request("empty segment".into()));
            }
            if s.start + s.tokens.len() > self.rope.max_positions() {
                return Err(EngineError::Request(format!(
                    "sequence of {} tokens exceeds the model's {} positions",
                    s.start + s.tokens.len(),
                    self.rope.max_positions()
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(EngineError::Request(format!(
                    "token id {bad} outside the vocabulary"
                )));
            }
            ids.extend_from_slice(s.tokens);
            lasts.push((ids.len() - 1) as u32);
        }
        let n = ids.len();
        let ids = Tensor::from_vec(ids, n, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let masks = segs
            .iter()
            .map(|s| sequence_mask(pool, s.table, s.start, s.tokens.len(), &self.device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        for (li, layer) in self.layers.iter().enumerate() {
            let hn = candle_nn::ops::rms_norm(&x, &layer.input_norm, eps)?;
            let q = layer.q.forward(&hn)?;
            let k = layer.k.forward(&hn)?;
            let v = layer.v.forward(&hn)?;
            let mut outs = Vec::with_capacity(segs.len());
            let mut off = 0;
            for (s, mask) in segs.iter().zip(&masks) {
                let t = s.tokens.len();
                let split = |m: &Tensor, nh: usize| -> candle_core::Result<Tensor> {
                    m.narrow(0, off, t)?
                        .reshape((t, nh, hd))?
                        .transpose(0, 1)?
                        .contiguous()
                };
                let qs = self.rope.apply(&split(&q, heads)?, s.start)?;
                let ks = self.rope.apply(&split(&k, kvh)?, s.start)?;
                let vs = split(&v, kvh)?;
                pool.write(li, s.table, s.start, &ks, &vs)?;
                let a = paged_attention(pool, li, s.table, &qs, mask, kvh)?;
                outs.push(a.transpose(0, 1)?.reshape((t, heads * hd))?);
                off += t;
            }
            let attn = if outs.len() == 1 {
                outs.remove(0)
            } else {
                Tensor::cat(&outs, 0)?
            };
            x = (x + layer.o.forward(&attn)?)?;
            let hn = candle_nn::ops::rms_norm(&x, &layer.post_norm, eps)?;
            let act =
                (candle_nn::ops::silu(&layer.gate.forward(&hn)?)? * layer.up.forward(&hn)?)?;
            x = (x + layer.down.forward(&act)?)?;
        }
        let idx = Tensor::from_vec(lasts, segs.len(), &self.device)?;
        let last = x.index_select(&idx, 0)?;
        let last = candle_nn::ops::rms_norm(&last, &self.norm, eps)?;
        Ok(self.lm_head.forward(&last)?.to_dtype(DType::F32)?)
    }

    /// Argmax over the last dimension of `(n, vocab)` logits.
    pub fn argmax(logits: &Tensor) -> Result<Vec<u32>, EngineError> {
        Ok(logits.argmax(D::Minus1)?.to_vec1()?)
    }
}
