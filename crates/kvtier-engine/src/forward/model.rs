//! The decoder-only transformer (Llama, Qwen2, Mistral, Qwen3, Phi-3) on
//! candle, with its KV in the external paged pool ([`KvPool`]) instead of a
//! private cache.
//!
//! [`Model::forward`] runs any mix of prefill chunks and decode tokens of
//! different sequences in one pass: the projections and MLP see all tokens
//! as one matrix (batched), attention runs per sequence against its pages.
//!
//! Each layer holds q/k/v as one fused projection and gate/up as another
//! (Phi-3's weights come so; the others' are concatenated at load): one
//! matmul each instead of three and two, fewer passes over the activations
//! and fewer operations per step.

mod decode;

use candle_core::{D, DType, Device, Tensor};
use candle_nn::{Linear, Module};

use crate::compute::softmax::CausalSoftmax;
use crate::engine_error::EngineError;
use crate::forward::attention::{causal_mask, context_keys, paged_attention};
use crate::forward::rope::Rope;
use crate::kv::kv_pool::{KvPool, PageId};
use crate::model_dir::model_config::ModelConfig;
use crate::model_dir::weights::Weights;

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
    /// q, k and v projections, fused: `(q_out + 2 * kv_out, hidden)`.
    qkv: Linear,
    o: Linear,
    /// gate and up projections, fused: `(2 * intermediate, hidden)`.
    gate_up: Linear,
    down: Linear,
    input_norm: Tensor,
    post_norm: Tensor,
    /// Qwen3's per-head RMSNorm of queries and keys.
    qk_norm: Option<(Tensor, Tensor)>,
    /// Sliding attention window (`None`: full attention).
    window: Option<usize>,
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

/// Called with each layer's index before that layer touches the KV pool
/// ([`Model::forward_gated`]): after its Q/K/V projection, which needs no
/// KV, so a layer-wise restore's wait overlaps that much of the layer.
pub(crate) type LayerGate<'a> = &'a (dyn Fn(usize) + Sync);

/// `x Wᵀ + b`: by the decode kernel for a few rows ([`crate::compute::gemv`]),
/// by candle's gemm otherwise.
fn project(lin: &Linear, x: &Tensor) -> candle_core::Result<Tensor> {
    match crate::compute::gemv::linear(x, lin.weight(), lin.bias())? {
        Some(y) => Ok(y),
        None => lin.forward(x),
    }
}

/// Takes `{prefix}.{name}.weight` of `shape` and its bias when `bias`.
fn take_linear(
    w: &mut Weights,
    prefix: &str,
    name: &str,
    shape: [usize; 2],
    bias: bool,
) -> Result<(Tensor, Option<Tensor>), EngineError> {
    let weight = w.take(&format!("{prefix}.{name}.weight"), &shape)?;
    let bias = if bias {
        Some(w.take(&format!("{prefix}.{name}.bias"), &[shape[0]])?)
    } else {
        None
    };
    Ok((weight, bias))
}

/// One projection from several stacked along the output dimension.
fn fuse(parts: Vec<(Tensor, Option<Tensor>)>) -> Result<Linear, EngineError> {
    let weights: Vec<&Tensor> = parts.iter().map(|p| &p.0).collect();
    let weight = Tensor::cat(&weights, 0)?;
    let biases: Option<Vec<&Tensor>> = parts.iter().map(|p| p.1.as_ref()).collect();
    let bias = biases.map(|b| Tensor::cat(&b, 0)).transpose()?;
    Ok(Linear::new(weight, bias))
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
            let (qkv, gate_up) = if cfg.fused_weights() {
                let qkv = take_linear(w, &p, "self_attn.qkv_proj", [q_out + 2 * kv_out, h], bias)?;
                let gate_up = take_linear(w, &p, "mlp.gate_up_proj", [2 * i, h], false)?;
                (fuse(vec![qkv])?, fuse(vec![gate_up])?)
            } else {
                let q = take_linear(w, &p, "self_attn.q_proj", [q_out, h], bias)?;
                let k = take_linear(w, &p, "self_attn.k_proj", [kv_out, h], bias)?;
                let v = take_linear(w, &p, "self_attn.v_proj", [kv_out, h], bias)?;
                let gate = take_linear(w, &p, "mlp.gate_proj", [i, h], false)?;
                let up = take_linear(w, &p, "mlp.up_proj", [i, h], false)?;
                (fuse(vec![q, k, v])?, fuse(vec![gate, up])?)
            };
            let qk_norm = if cfg.qk_norm() {
                Some((
                    w.take(&format!("{p}.self_attn.q_norm.weight"), &[hd])?,
                    w.take(&format!("{p}.self_attn.k_norm.weight"), &[hd])?,
                ))
            } else {
                None
            };
            layers.push(Layer {
                qkv,
                o: Linear::new(
                    w.take(&format!("{p}.self_attn.o_proj.weight"), &[h, q_out])?,
                    None,
                ),
                gate_up,
                down: Linear::new(w.take(&format!("{p}.mlp.down_proj.weight"), &[h, i])?, None),
                input_norm: w.take(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_norm: w.take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                qk_norm,
                window: cfg.layer_window(l),
            });
        }
        let norm = w.take("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") {
            Linear::new(embed.clone(), None)
        } else {
            Linear::new(w.take("lm_head.weight", &[cfg.vocab_size, h])?, None)
        };
        let rope_params = cfg.rope().map_err(EngineError::Weights)?;
        let rope = Rope::new(
            &rope_params,
            max_positions.min(cfg.max_position_embeddings),
            device,
        )?;
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
    /// each segment's last token, `(segments, vocab)`. A step of single
    /// decode tokens takes the hand-written path (`decode.rs`), anything
    /// else candle's.
    ///
    /// The general pass runs on a thread of the rayon pool
    /// (`rayon::scope`): candle's parallel parts then start on the thread
    /// that is already running, instead of each being handed over from the
    /// caller's thread and waited for. The decode step runs on the caller's
    /// thread, which works beside kvtier's spinning pool
    /// ([`crate::compute::parallel`]).
    pub fn forward(&self, pool: &KvPool, segs: &[Segment<'_>]) -> Result<Tensor, EngineError> {
        self.forward_gated(pool, segs, &|_| {})
    }

    /// [`forward`](Self::forward), calling `gate(l)` before layer `l`
    /// touches the pool (after its Q/K/V projection): a layer-wise restore
    /// waits there for that layer of the prefix ([`crate::kv::layer_restore`]).
    pub(crate) fn forward_gated(
        &self,
        pool: &KvPool,
        segs: &[Segment<'_>],
        gate: LayerGate<'_>,
    ) -> Result<Tensor, EngineError> {
        self.check_segments(segs)?;
        match self.forward_decode(pool, segs, gate)? {
            Some(logits) => Ok(logits),
            None => rayon::scope(|_| self.forward_general(pool, segs, gate)),
        }
    }

    /// Refuses empty segments, positions past the RoPE tables and token
    /// ids outside the vocabulary.
    fn check_segments(&self, segs: &[Segment<'_>]) -> Result<(), EngineError> {
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
            if let Some(&bad) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.cfg.vocab_size)
            {
                return Err(EngineError::Request(format!(
                    "token id {bad} outside the vocabulary"
                )));
            }
        }
        Ok(())
    }

    /// [`forward`](Self::forward) through candle's operations: projections
    /// and MLP batched over every token, attention per sequence.
    pub(crate) fn forward_general(
        &self,
        pool: &KvPool,
        segs: &[Segment<'_>],
        gate: LayerGate<'_>,
    ) -> Result<Tensor, EngineError> {
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
            ids.extend_from_slice(s.tokens);
            lasts.push((ids.len() - 1) as u32);
        }
        let n = ids.len();
        let ids = Tensor::from_vec(ids, n, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        // Every windowed layer has the config's one window.
        let window = self.layers.iter().find_map(|l| l.window);
        let keys: Vec<usize> = segs
            .iter()
            .map(|s| context_keys(pool, s.table, s.start, s.tokens.len()))
            .collect();
        let q_out = heads * hd;
        let kv_out = kvh * hd;
        let inter = cfg.intermediate_size;
        // Off the CPU, attention adds a causal mask: one per segment (and
        // per window, where some layers slide), the same for every layer,
        // so made once here rather than built and copied over per layer.
        let mut masks: Vec<[Option<Tensor>; 2]> = vec![[None, None]; segs.len()];
        for (li, layer) in self.layers.iter().enumerate() {
            let hn = candle_nn::ops::rms_norm(&x, &layer.input_norm, eps)?;
            let qkv = project(&layer.qkv, &hn)?;
            gate(li);
            let mut outs = Vec::with_capacity(segs.len());
            let mut off = 0;
            for (si, (s, &keys)) in segs.iter().zip(&keys).enumerate() {
                let t = s.tokens.len();
                // Rows of this segment, columns `col..col + nh * hd`, as
                // `(nh, t, hd)`; Qwen3 norms each head's vector first.
                let split =
                    |col: usize, nh: usize, norm: Option<&Tensor>| -> candle_core::Result<Tensor> {
                        let m = qkv
                            .narrow(0, off, t)?
                            .narrow(1, col, nh * hd)?
                            .reshape((t, nh, hd))?;
                        let m = match norm {
                            Some(w) => candle_nn::ops::rms_norm(&m.contiguous()?, w, eps)?,
                            None => m,
                        };
                        m.transpose(0, 1)?.contiguous()
                    };
                let (qn, kn) = match &layer.qk_norm {
                    Some((qn, kn)) => (Some(qn), Some(kn)),
                    None => (None, None),
                };
                let qs = self.rope.apply(&split(0, heads, qn)?, s.start)?;
                let ks = self.rope.apply(&split(q_out, kvh, kn)?, s.start)?;
                let vs = split(q_out + kv_out, kvh, None)?;
                pool.write(li, s.table, s.start, &ks, &vs)?;
                let causal = CausalSoftmax {
                    t,
                    keys,
                    start: s.start,
                    window: layer.window.and(window),
                };
                let mask = if crate::compute::device::host_paths(&self.device) {
                    None
                } else {
                    let slot = &mut masks[si][usize::from(causal.window.is_some())];
                    if slot.is_none() {
                        *slot = Some(causal_mask(s.start, t, keys, causal.window, &self.device)?);
                    }
                    slot.as_ref()
                };
                let a = paged_attention(pool, li, s.table, &qs, causal, kvh, mask)?;
                outs.push(a.transpose(0, 1)?.reshape((t, heads * hd))?);
                off += t;
            }
            let attn = if outs.len() == 1 {
                outs.remove(0)
            } else {
                Tensor::cat(&outs, 0)?
            };
            x = (x + project(&layer.o, &attn)?)?;
            let hn = candle_nn::ops::rms_norm(&x, &layer.post_norm, eps)?;
            let gu = project(&layer.gate_up, &hn)?;
            let act =
                (candle_nn::ops::silu(&gu.narrow(1, 0, inter)?)? * gu.narrow(1, inter, inter)?)?;
            x = (x + project(&layer.down, &act.contiguous()?)?)?;
        }
        let idx = Tensor::from_vec(lasts, segs.len(), &self.device)?;
        let last = x.index_select(&idx, 0)?;
        let last = candle_nn::ops::rms_norm(&last, &self.norm, eps)?;
        Ok(project(&self.lm_head, &last)?.to_dtype(DType::F32)?)
    }

    /// Argmax over the last dimension of `(n, vocab)` logits.
    pub fn argmax(logits: &Tensor) -> Result<Vec<u32>, EngineError> {
        Ok(logits.argmax(D::Minus1)?.to_vec1()?)
    }
}
