//! Paged attention: queries of one sequence against the K/V pages of its
//! block table, one matmul per page (no gather copy of the whole context).
//!
//! Grouped-query attention: query head `i` reads KV head `i / groups`, so the
//! queries are viewed as `(kv_heads, groups * t, head_dim)` and every page's
//! K and V `(kv_heads, block_tokens, head_dim)` serve as batched operands.

use candle_core::{D, Device, Tensor};

use crate::kv_pool::{KvPool, PageId};

/// Additive causal mask `(t, pages * block_tokens)` for queries at positions
/// `start..start + t`: key `j` is visible to query `i` iff `j <= start + i`
/// (which also hides the unwritten tail of the last page).
pub fn causal_mask(
    start: usize,
    t: usize,
    keys: usize,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let mut m = Vec::with_capacity(t * keys);
    for i in 0..t {
        let last = start + i;
        m.extend((0..keys).map(|j| if j <= last { 0f32 } else { f32::NEG_INFINITY }));
    }
    Tensor::from_vec(m, (t, keys), device)
}

/// Attention output `(heads, t, head_dim)` for queries `q` `(heads, t,
/// head_dim)` at positions `start..start + t`, whose K/V (already written to
/// the pool) live in `table`.
pub fn paged_attention(
    pool: &KvPool,
    layer: usize,
    table: &[PageId],
    q: &Tensor,
    start: usize,
    kv_heads: usize,
) -> candle_core::Result<Tensor> {
    let (heads, t, hd) = q.dims3()?;
    let groups = heads / kv_heads;
    let bt = pool.block_tokens();
    let used = (start + t).div_ceil(bt);
    let pages = &table[..used.min(table.len())];
    let scale = 1.0 / (hd as f64).sqrt();
    let q = (q.reshape((kv_heads, groups * t, hd))? * scale)?;

    let mut scores = Vec::with_capacity(pages.len());
    for &p in pages {
        let k = pool.page_k(layer, p)?;
        scores.push(q.matmul(&k.t()?)?);
    }
    let scores = if scores.len() == 1 {
        scores.remove(0)
    } else {
        Tensor::cat(&scores, 2)?
    };
    let keys = pages.len() * bt;
    let mask = causal_mask(start, t, keys, q.device())?;
    let scores = scores
        .reshape((kv_heads, groups, t, keys))?
        .broadcast_add(&mask)?;
    let weights =
        candle_nn::ops::softmax_last_dim(&scores)?.reshape((kv_heads, groups * t, keys))?;

    let mut out: Option<Tensor> = None;
    for (i, &p) in pages.iter().enumerate() {
        let w = weights.narrow(D::Minus1, i * bt, bt)?.contiguous()?;
        let part = w.matmul(&pool.page_v(layer, p)?)?;
        out = Some(match out {
            None => part,
            Some(acc) => (acc + part)?,
        });
    }
    match out {
        Some(o) => o.reshape((heads, t, hd)),
        None => Tensor::zeros((heads, t, hd), q.dtype(), q.device()),
    }
}
