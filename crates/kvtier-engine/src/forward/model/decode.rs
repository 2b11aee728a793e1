//! The decode step, hand-written: one new token for each of a few
//! sequences, on the CPU, without candle's tensor operations.
//!
//! Why: a decode step is a few hundred small operations on vectors of a few
//! thousand values plus one pass over every weight. Through candle each of
//! those operations allocates a tensor and goes through its dispatch, which
//! cost about as much as the arithmetic, and its attention gathered every page
//! of the context into one tensor (a copy that grew with the context and with
//! the number of pages) before two matmuls. Here the projections are
//! [`crate::compute::gemv`]'s streaming dot products, the norms, RoPE and
//! SwiGLU are plain loops over host vectors, the new K/V goes straight into its
//! page, and attention walks the sequence's page table in place with an online
//! softmax (no gather, no score matrix), so its cost is the context's bytes
//! whatever the page size. Work is split over the CPU threads
//! ([`crate::compute::parallel`]) by output rows (projections) and by
//! (sequence, KV head) (attention).
//!
//! The results equal the candle path's up to float rounding (tested
//! below), and `transformers`' within the reference tests' tolerance
//! (python/engine_tests).

use candle_core::Tensor;

use super::{Layer, LayerGate, Model, Segment};
use crate::compute::gemv::{self, with_host};
use crate::engine_error::EngineError;
use crate::kv::kv_pool::KvPool;

/// Keys scored together before their exponentials (a run inside one page).
const KEY_RUN: usize = 32;

impl Model {
    /// Logits `(segments, vocab)` of one decode token per segment, or
    /// `None` when this path does not apply (not the CPU, a segment of
    /// more than one token, too many segments): the caller runs the
    /// general forward pass.
    pub(super) fn forward_decode(
        &self,
        pool: &KvPool,
        segs: &[Segment<'_>],
        gate: LayerGate<'_>,
    ) -> Result<Option<Tensor>, EngineError> {
        let m = segs.len();
        if !crate::compute::device::host_paths(&self.device)
            || m == 0
            || m > gemv::MAX_ROWS
            || segs.iter().any(|s| s.tokens.len() != 1)
        {
            return Ok(None);
        }
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps as f32;
        let Some(mut x) = with_host(&self.embed, |e| {
            let mut x = Vec::with_capacity(m * h);
            for s in segs {
                let t = s.tokens[0] as usize;
                x.extend_from_slice(&e[t * h..(t + 1) * h]);
            }
            x
        }) else {
            return Ok(None);
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let Some(()) = self.decode_layer(pool, (li, gate), layer, segs, &mut x, eps)? else {
                return Ok(None);
            };
        }
        let Some(xn) = rms_norm_rows(&x, h, &self.norm, eps) else {
            return Ok(None);
        };
        let Some(logits) = gemv::rows(&xn, m, self.lm_head.weight(), self.lm_head.bias())? else {
            return Ok(None);
        };
        let vocab = logits.len() / m;
        Ok(Some(Tensor::from_vec(logits, (m, vocab), &self.device)?))
    }

    /// One layer (`li`, gated by `gate` before it touches the pool) of the
    /// decode step over the residual rows `x` (updated in place); `None`
    /// when a weight is not on the host.
    fn decode_layer(
        &self,
        pool: &KvPool,
        (li, gate): (usize, LayerGate<'_>),
        layer: &Layer,
        segs: &[Segment<'_>],
        x: &mut [f32],
        eps: f32,
    ) -> Result<Option<()>, EngineError> {
        let cfg = &self.cfg;
        let (m, h) = (segs.len(), cfg.hidden_size);
        let (heads, kvh, hd) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let (q_out, kv_out) = (heads * hd, kvh * hd);
        let Some(hn) = rms_norm_rows(x, h, &layer.input_norm, eps) else {
            return Ok(None);
        };
        let Some(mut qkv) = gemv::rows(&hn, m, layer.qkv.weight(), layer.qkv.bias())? else {
            return Ok(None);
        };
        gate(li);
        let width = q_out + 2 * kv_out;
        for (row, s) in qkv.chunks_exact_mut(width).zip(segs) {
            let (q, kv) = row.split_at_mut(q_out);
            let (k, v) = kv.split_at_mut(kv_out);
            if let Some((qn, kn)) = &layer.qk_norm {
                for (part, w) in [(&mut *q, qn), (&mut *k, kn)] {
                    for head in part.chunks_exact_mut(hd) {
                        if !rms_norm_in_place(head, w, eps) {
                            return Ok(None);
                        }
                    }
                }
            }
            for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                if !self.rope.rotate(head, s.start) {
                    return Ok(None);
                }
            }
            pool.write_token(li, s.table, s.start, k, v)?;
        }
        let Some(attn) = attend(pool, li, segs, &qkv, width, (heads, kvh, hd), layer.window) else {
            return Ok(None);
        };
        let Some(o) = gemv::rows(&attn, m, layer.o.weight(), layer.o.bias())? else {
            return Ok(None);
        };
        add(x, &o);
        let Some(hn) = rms_norm_rows(x, h, &layer.post_norm, eps) else {
            return Ok(None);
        };
        let Some(gu) = gemv::rows(&hn, m, layer.gate_up.weight(), layer.gate_up.bias())? else {
            return Ok(None);
        };
        let inter = cfg.intermediate_size;
        let mut act = Vec::with_capacity(m * inter);
        for row in gu.chunks_exact(2 * inter) {
            let (g, u) = row.split_at(inter);
            act.extend(g.iter().zip(u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u));
        }
        let Some(d) = gemv::rows(&act, m, layer.down.weight(), layer.down.bias())? else {
            return Ok(None);
        };
        add(x, &d);
        Ok(Some(()))
    }
}

/// `x += y`.
fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// RMSNorm of each row of `x` (`width` values) with `weight`, as candle
/// computes it (the mean of squares in f32).
fn rms_norm_rows(x: &[f32], width: usize, weight: &Tensor, eps: f32) -> Option<Vec<f32>> {
    with_host(weight, |w| {
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks_exact(width) {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
            let r = 1.0 / (ms + eps).sqrt();
            out.extend(row.iter().zip(w).map(|(v, w)| v * r * w));
        }
        out
    })
}

/// RMSNorm of one head's vector in place (Qwen3's q/k norm); false when
/// the weight is not on the host.
fn rms_norm_in_place(x: &mut [f32], weight: &Tensor, eps: f32) -> bool {
    with_host(weight, |w| {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, w) in x.iter_mut().zip(w) {
            *v *= r * w;
        }
    })
    .is_some()
}

/// Attention of each segment's new token over its context (positions up
/// to and including its own, within `window` when the layer slides),
/// reading the K/V pages of its table in place. `qkv` holds each row's
/// queries first (`heads * hd`, rotated); returns `(segments, heads * hd)`.
fn attend(
    pool: &KvPool,
    layer: usize,
    segs: &[Segment<'_>],
    qkv: &[f32],
    width: usize,
    (heads, kvh, hd): (usize, usize, usize),
    window: Option<usize>,
) -> Option<Vec<f32>> {
    let groups = heads / kvh;
    let bt = pool.block_tokens();
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; segs.len() * heads * hd];
    pool.with_layer(layer, |ks, vs| {
        // One task per (segment, KV head): its `groups` query heads, whose
        // outputs are adjacent.
        let job = |task: usize, out: &mut [f32]| {
            let (r, kh) = (task / kvh, task % kvh);
            let s = &segs[r];
            let pos = s.start;
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let q = &qkv[r * width + kh * groups * hd..r * width + (kh + 1) * groups * hd];
            let mut best = vec![f32::NEG_INFINITY; groups];
            let mut total = vec![0f32; groups];
            let mut scores = [0f32; KEY_RUN];
            let mut p = first;
            while p <= pos {
                let Some(&page) = s.table.get(p / bt) else {
                    break;
                };
                let off = p % bt;
                let run = (bt - off).min(pos + 1 - p).min(KEY_RUN);
                let at = pool.row_elem(page, kh, off);
                let (kr, vr) = (&ks[at..at + run * hd], &vs[at..at + run * hd]);
                for g in 0..groups {
                    let qg = &q[g * hd..(g + 1) * hd];
                    let acc = &mut out[g * hd..(g + 1) * hd];
                    let mut top = best[g];
                    for (j, key) in kr.chunks_exact(hd).enumerate() {
                        scores[j] = gemv::dot(qg, key) * scale;
                        top = top.max(scores[j]);
                    }
                    let keep = (best[g] - top).exp();
                    if keep != 1.0 {
                        total[g] *= keep;
                        for a in acc.iter_mut() {
                            *a *= keep;
                        }
                    }
                    for (j, val) in vr.chunks_exact(hd).enumerate() {
                        let e = (scores[j] - top).exp();
                        total[g] += e;
                        for (a, v) in acc.iter_mut().zip(val) {
                            *a += e * v;
                        }
                    }
                    best[g] = top;
                }
                p += run;
            }
            for g in 0..groups {
                let inv = if total[g] > 0.0 { 1.0 / total[g] } else { 0.0 };
                for a in &mut out[g * hd..(g + 1) * hd] {
                    *a *= inv;
                }
            }
        };
        let chunk = groups * hd;
        crate::compute::parallel::for_each_chunk(&mut out, chunk, job);
    })?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use crate::forward::model::{Model, Segment};
    use crate::kv::kv_pool::KvPool;
    use crate::model_dir::model_config::ModelConfig;
    use crate::model_dir::preset::{Preset, write_preset};
    use crate::model_dir::weights::Weights;

    fn model(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) -> Model {
        write_preset(Preset::Tiny, 7, dir).unwrap();
        let path = dir.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        edit(&mut cfg);
        std::fs::write(&path, cfg.to_string()).unwrap();
        let cfg = ModelConfig::from_dir(dir).unwrap();
        let mut w = Weights::load(dir, &Device::Cpu, candle_core::DType::F32).unwrap();
        Model::new(cfg, &mut w, 512, &Device::Cpu).unwrap()
    }

    /// Three sequences of different lengths on scattered pages: the
    /// hand-written step's logits (and the K/V it writes) equal the general
    /// path's, with full attention and with a sliding window shorter than
    /// the contexts.
    #[test]
    fn the_decode_step_equals_the_general_forward_pass() {
        for window in [None, Some(9)] {
            let dir = tempfile::tempdir().unwrap();
            let m = model(dir.path(), |c| {
                if let Some(w) = window {
                    c["model_type"] = "mistral".into();
                    c["sliding_window"] = w.into();
                }
            });
            let cfg = m.config().clone();
            let bt = 8;
            let mk_pool = || {
                KvPool::new(
                    cfg.num_hidden_layers,
                    cfg.kv_heads(),
                    cfg.head_dim(),
                    bt,
                    16,
                    &Device::Cpu,
                )
                .unwrap()
            };
            let (a, b) = (mk_pool(), mk_pool());
            let tables: [Vec<u32>; 3] = [vec![3, 0, 9], vec![1, 5], vec![2, 7, 11, 4]];
            let lens = [19usize, 12, 30];
            let prompts: Vec<Vec<u32>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    (0..n as u32)
                        .map(|t| (t * 37 + i as u32 * 11) % 250)
                        .collect()
                })
                .collect();
            // Prefill each prompt but its last token in both pools.
            for pool in [&a, &b] {
                for (p, t) in prompts.iter().zip(&tables) {
                    let seg = Segment {
                        tokens: &p[..p.len() - 1],
                        start: 0,
                        table: t,
                    };
                    m.forward(pool, &[seg]).unwrap();
                }
            }
            let segs: Vec<Segment<'_>> = prompts
                .iter()
                .zip(&tables)
                .map(|(p, t)| Segment {
                    tokens: &p[p.len() - 1..],
                    start: p.len() - 1,
                    table: t,
                })
                .collect();
            let fast = m
                .forward_decode(&a, &segs, &|_| {})
                .unwrap()
                .expect("the decode path applies");
            let general = m.forward_general(&b, &segs, &|_| {}).unwrap();
            let (f, g): (Vec<f32>, Vec<f32>) = (
                fast.flatten_all().unwrap().to_vec1().unwrap(),
                general.flatten_all().unwrap().to_vec1().unwrap(),
            );
            assert_eq!(f.len(), g.len());
            for (x, y) in f.iter().zip(&g) {
                assert!((x - y).abs() < 1e-4, "window {window:?}: {x} vs {y}");
            }
            // The new tokens' K/V landed where the general path put them.
            for (s, t) in segs.iter().zip(&tables) {
                let page = t[s.start / bt] as usize;
                for layer in 0..cfg.num_hidden_layers {
                    let ka: Vec<f32> = a
                        .page_k(layer, page as u32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    let kb: Vec<f32> = b
                        .page_k(layer, page as u32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    for (x, y) in ka.iter().zip(&kb) {
                        assert!((x - y).abs() < 1e-5);
                    }
                }
            }
        }
    }
}
