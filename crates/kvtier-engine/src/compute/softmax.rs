//! The causal softmax of a prefill chunk's attention scores, in place,
//! hand-written.
//!
//! Why: through candle a chunk's scores got a mask added (one more pass over
//! `heads x t x keys` values) and then candle's softmax, which calls the C
//! library's scalar `expf` for every score, masked ones included; in a profile
//! of a long prefill the softmax and the mask add were a large share of the
//! time. Here each row is normalised over its visible keys only (causal, and
//! inside the sliding window when the layer has one), with an 8-wide polynomial
//! `exp` (Cephes' `expf`, a few ulp), the hidden keys set to zero, rows split
//! over the rayon pool.

use candle_core::{CpuStorage, InplaceOp1, Layout};
use rayon::prelude::*;

/// Softmax of each row of a `(heads, t, keys)` score tensor in place, row
/// `i` of a head being the query at position `start + i`: key `j` is
/// visible iff `j <= start + i` and, with a `window`, `j > start + i -
/// window`; hidden keys get weight 0.
#[derive(Debug, Clone, Copy)]
pub struct CausalSoftmax {
    /// Queries per head.
    pub t: usize,
    /// Keys per row.
    pub keys: usize,
    /// Position of the first query.
    pub start: usize,
    /// Sliding window, if any.
    pub window: Option<usize>,
}

impl InplaceOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "kvtier-causal-softmax"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (all, range) = crate::compute::gemv::f32_in_place(storage, layout, "attention scores")?;
        let rows = all
            .get_mut(range)
            .ok_or_else(|| candle_core::Error::Msg("scores outside their storage".into()))?;
        if self.keys == 0 || self.t == 0 || rows.len() % (self.keys * self.t) != 0 {
            return Err(candle_core::Error::Msg("scores of another shape".into()));
        }
        let job = |(r, row): (usize, &mut [f32])| {
            let pos = self.start + r % self.t;
            let last = (pos + 1).min(self.keys);
            let first = self
                .window
                .map_or(0, |w| (pos + 1).saturating_sub(w))
                .min(last);
            softmax_range(row, first, last);
        };
        if rayon::current_num_threads() > 1 {
            rows.par_chunks_mut(self.keys).enumerate().for_each(job);
        } else {
            rows.chunks_mut(self.keys).enumerate().for_each(job);
        }
        Ok(())
    }
}

/// Softmax of `row[first..last]` in place, every other entry set to 0.
fn softmax_range(row: &mut [f32], first: usize, last: usize) {
    row[..first].fill(0.0);
    row[last..].fill(0.0);
    let live = &mut row[first..last];
    if live.is_empty() {
        return;
    }
    let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        live.fill(0.0);
        return;
    }
    let sum = exp_shifted(live, max);
    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    for v in live.iter_mut() {
        *v *= inv;
    }
}

/// `v[i] = exp(v[i] - shift)` for every entry; returns their sum.
fn exp_shifted(v: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::compute::gemv::simd() {
            // SAFETY: the CPU has AVX2 and FMA (checked by `simd`).
            return unsafe { exp_shifted_avx2(v, shift) };
        }
    }
    let mut sum = 0.0;
    for x in v.iter_mut() {
        *x = (*x - shift).exp();
        sum += *x;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(v: &mut [f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let n = v.len() / 8 * 8;
    let p = v.as_mut_ptr();
    // SAFETY: loads and stores of 8 floats at offsets below `n <= len`.
    let mut sum = unsafe {
        let s = _mm256_set1_ps(shift);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < n {
            let x = _mm256_sub_ps(_mm256_loadu_ps(p.add(i)), s);
            let e = exp8(x);
            _mm256_storeu_ps(p.add(i), e);
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        let lanes: [f32; 8] = std::mem::transmute(acc);
        lanes.iter().sum::<f32>()
    };
    for x in &mut v[n..] {
        *x = (*x - shift).exp();
        sum += *x;
    }
    sum
}

/// `exp` of eight floats: `x = n ln2 + r`, `exp(r)` by Cephes' degree-5
/// polynomial, `2^n` built in the exponent bits. Inputs below -87.3 give
/// about 1e-38 instead of 0 (the caller's inputs are `<= 0`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.336_55)),
        _mm256_set1_ps(88.376_26),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, r2, r), _mm256_set1_ps(1.0));
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(y, pow2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn the_vector_exp_is_within_a_few_ulp() {
        let xs: Vec<f32> = (0..2000).map(|i| -80.0 + i as f32 * 0.04).collect();
        let mut ys = xs.clone();
        let sum = exp_shifted(&mut ys, 0.0);
        let mut want_sum = 0f64;
        for (x, y) in xs.iter().zip(&ys) {
            let want = f64::from(*x).exp();
            want_sum += want;
            assert!(
                ((f64::from(*y) - want) / want).abs() < 1e-6,
                "exp({x}) = {y}, want {want}"
            );
        }
        assert!(((f64::from(sum) - want_sum) / want_sum).abs() < 1e-5);
    }

    /// The in-place causal softmax equals candle's softmax of the masked
    /// scores, with and without a window.
    #[test]
    fn equals_masked_softmax() {
        let dev = Device::Cpu;
        let (heads, t, keys, start) = (3usize, 5usize, 16usize, 9usize);
        let data: Vec<f32> = (0..heads * t * keys)
            .map(|i| ((i * 7919) % 97) as f32 * 0.13 - 6.0)
            .collect();
        for window in [None, Some(4)] {
            let scores = Tensor::from_vec(data.clone(), (heads, t, keys), &dev).unwrap();
            let mask =
                crate::forward::attention::causal_mask(start, t, keys, window, &dev).unwrap();
            let want =
                candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask).unwrap()).unwrap();
            let got = scores.copy().unwrap();
            got.inplace_op1(&CausalSoftmax {
                t,
                keys,
                start,
                window,
            })
            .unwrap();
            let (w, g): (Vec<f32>, Vec<f32>) = (
                want.flatten_all().unwrap().to_vec1().unwrap(),
                got.flatten_all().unwrap().to_vec1().unwrap(),
            );
            for (a, b) in w.iter().zip(&g) {
                assert!((a - b).abs() < 1e-6, "window {window:?}: {a} vs {b}");
            }
        }
    }
}
