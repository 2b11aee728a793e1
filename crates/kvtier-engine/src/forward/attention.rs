//! Paged attention for prefill chunks (the decode step has its own,
//! `model/decode.rs`): queries of one sequence against the K/V pages of its
//! block table, read as one K and one V tensor per layer
//! ([`KvPool::context`]: a view of the pool when the pages are consecutive)
//! so the scores and the output are one matmul each.
//!
//! Grouped-query attention: query head `i` reads KV head `i / groups`, so the
//! queries are viewed as `(kv_heads, groups * t, head_dim)` and the context's
//! K and V `(kv_heads, keys, head_dim)` serve as batched operands.

use candle_core::{Device, Tensor};

use crate::compute::softmax::CausalSoftmax;
use crate::kv::kv_pool::{KvPool, PageId};

/// Additive causal mask `(t, pages * block_tokens)` for queries at positions
/// `start..start + t`: key `j` is visible to query `i` iff `j <= start + i`
/// (which also hides the unwritten tail of the last page) and, with a
/// sliding `window`, `j > start + i - window` (as `transformers` masks it).
pub fn causal_mask(
    start: usize,
    t: usize,
    keys: usize,
    window: Option<usize>,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let mut m = Vec::with_capacity(t * keys);
    for i in 0..t {
        let last = start + i;
        let first = window.map_or(0, |w| (last + 1).saturating_sub(w));
        m.extend((0..keys).map(|j| {
            if j <= last && j >= first {
                0f32
            } else {
                f32::NEG_INFINITY
            }
        }));
    }
    Tensor::from_vec(m, (t, keys), device)
}

/// Keys a sequence's `t` queries at positions `start..start + t` read:
/// those of the pages of `table` holding positions up to `start + t - 1`.
pub fn context_keys(pool: &KvPool, table: &[PageId], start: usize, t: usize) -> usize {
    let bt = pool.block_tokens();
    (start + t).div_ceil(bt).min(table.len()) * bt
}

/// Attention output `(heads, t, head_dim)` for queries `q` `(heads, t,
/// head_dim)` at positions `causal.start..`, whose K/V (already written to
/// the pool) live in `table`, over `causal.keys` keys (from
/// [`context_keys`]), each query seeing the keys up to its own position
/// (within the window when there is one). Without a `mask`, on the CPU, the
/// scores are normalised in place ([`CausalSoftmax`]); otherwise through
/// the additive `mask` ([`causal_mask`] of `causal`, made here when not
/// given) and candle's softmax. A forward pass makes each mask once and
/// hands it to every layer: it is the same for all of them.
pub fn paged_attention(
    pool: &KvPool,
    layer: usize,
    table: &[PageId],
    q: &Tensor,
    causal: CausalSoftmax,
    kv_heads: usize,
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let (heads, t, hd) = q.dims3()?;
    let groups = heads / kv_heads;
    let keys = causal.keys;
    let pages = &table[..(keys / pool.block_tokens()).min(table.len())];
    let scale = 1.0 / (hd as f64).sqrt();
    let q = (q.reshape((kv_heads, groups * t, hd))? * scale)?;
    if pages.is_empty() {
        return Tensor::zeros((heads, t, hd), q.dtype(), q.device());
    }
    let k = pool.context(layer, pages, false)?;
    let scores = q.matmul(&k.t()?)?;
    let weights = if q.device().is_cpu() && mask.is_none() {
        scores.inplace_op1(&causal)?;
        scores
    } else {
        let made;
        let mask = match mask {
            Some(m) => m,
            None => {
                made = causal_mask(causal.start, t, keys, causal.window, q.device())?;
                &made
            }
        };
        let scores = scores
            .reshape((kv_heads, groups, t, keys))?
            .broadcast_add(mask)?;
        candle_nn::ops::softmax_last_dim(&scores)?.reshape((kv_heads, groups * t, keys))?
    };
    let v = pool.context(layer, pages, true)?;
    weights.matmul(&v)?.reshape((heads, t, hd))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention computed the plain way: every key of the context, one
    /// query at a time, from the K/V written into the pool.
    fn reference(
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        q: &[Vec<f32>],
        start: usize,
        hd: usize,
    ) -> Vec<Vec<f32>> {
        q.iter()
            .enumerate()
            .map(|(i, q)| {
                let n = start + i + 1;
                let s: Vec<f32> = (0..n)
                    .map(|j| {
                        q.iter().zip(&k[j]).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                (0..hd)
                    .map(|d| (0..n).map(|j| e[j] / z * v[j][d]).sum())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn paged_attention_equals_the_plain_attention_over_any_table() {
        // A sequence of 13 tokens on pages 5, 1, 6, 2 (not in order: joined
        // by a copy) and on 2, 3, 4, 5 (consecutive: one view).
        for table in [vec![5, 1, 6, 2], vec![2, 3, 4, 5]] {
            check_against_reference(&table);
        }
    }

    fn check_against_reference(table: &[PageId]) {
        let dev = Device::Cpu;
        let (kvh, groups, hd, bt) = (2usize, 2usize, 8usize, 4usize);
        let pool = KvPool::new(1, kvh, hd, bt, 8, &dev).unwrap();
        let len = 13;
        let val = |h: usize, j: usize, d: usize, w: f32| ((h * 31 + j * 7 + d) as f32 * w).sin();
        let kv = |w: f32| {
            let data: Vec<f32> = (0..kvh)
                .flat_map(|h| (0..len).flat_map(move |j| (0..hd).map(move |d| val(h, j, d, w))))
                .collect();
            Tensor::from_vec(data, (kvh, len, hd), &dev).unwrap()
        };
        pool.write(0, table, 0, &kv(0.37), &kv(0.11)).unwrap();
        for (start, t) in [(12, 1), (9, 4), (0, 13)] {
            let heads = kvh * groups;
            let qd: Vec<f32> = (0..heads * t * hd)
                .map(|x| ((x * 13) as f32 * 0.05).cos())
                .collect();
            let q = Tensor::from_vec(qd.clone(), (heads, t, hd), &dev).unwrap();
            let causal = CausalSoftmax {
                t,
                keys: context_keys(&pool, table, start, t),
                start,
                window: None,
            };
            // In place (the CPU's way) and through a given mask (the way
            // of every other device): both equal the plain attention.
            let mask = causal_mask(start, t, causal.keys, None, &dev).unwrap();
            for mask in [None, Some(&mask)] {
                let got = paged_attention(&pool, 0, table, &q, causal, kvh, mask).unwrap();
                let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
                check_heads(&got, &qd, (heads, groups, t, hd, len, start), &val);
            }
        }
    }

    /// Each query head of `got` against the plain attention of its KV head.
    fn check_heads(
        got: &[f32],
        qd: &[f32],
        (heads, groups, t, hd, len, start): (usize, usize, usize, usize, usize, usize),
        val: &dyn Fn(usize, usize, usize, f32) -> f32,
    ) {
        for qh in 0..heads {
            let h = qh / groups;
            let keys: Vec<Vec<f32>> = (0..len)
                .map(|j| (0..hd).map(|d| val(h, j, d, 0.37)).collect())
                .collect();
            let vals: Vec<Vec<f32>> = (0..len)
                .map(|j| (0..hd).map(|d| val(h, j, d, 0.11)).collect())
                .collect();
            let qs: Vec<Vec<f32>> = (0..t)
                .map(|i| qd[(qh * t + i) * hd..(qh * t + i + 1) * hd].to_vec())
                .collect();
            let want = reference(&keys, &vals, &qs, start, hd);
            for i in 0..t {
                for d in 0..hd {
                    let g = got[(qh * t + i) * hd + d];
                    assert!(
                        (g - want[i][d]).abs() < 1e-5,
                        "head {qh} query {i} dim {d}: {g} vs {}",
                        want[i][d]
                    );
                }
            }
        }
    }
}
