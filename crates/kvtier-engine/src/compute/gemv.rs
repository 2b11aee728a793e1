//! The projections of a decode step: `y = x Wᵀ (+ b)` for a few rows of
//! `x` (one per decoding sequence), hand-written.
//!
//! Why not candle's matmul here: a decode step reads every weight once for
//! one row of activations, so it is bound by memory bandwidth, and the gemm
//! crate behind candle neither splits an `m = 1` product over threads nor
//! streams the weights at the bandwidth one core gets: through it a small
//! f32 model decoded no faster at 2 threads than at 1, and slower than
//! llama.cpp's dot-product kernels (scripts/bench-llamacpp,
//! docs/results.md). This kernel streams each weight row once through
//! FMA dot products (AVX-512 where the CPU has it, else AVX2) with every
//! row of `x` (kept in L1), and splits the output rows over the CPU threads
//! (`--threads`; [`crate::compute::parallel`]). Prefill chunks (many rows,
//! compute-bound) stay on candle's packed gemm.

use candle_core::{CpuStorage, DType, Storage, Tensor};

/// Most rows of `x` this kernel takes; above it the product is
/// compute-bound enough for the packed gemm.
pub const MAX_ROWS: usize = 8;

/// Output rows per unit of work handed to the pool (enough to amortise
/// its dispatch, small enough to balance two threads).
const ROWS_PER_TASK: usize = 64;

/// `x Wᵀ + b` for `x` `(m, k)` with `m <= MAX_ROWS`, `w` `(n, k)`, `b`
/// `(n)`, all contiguous f32 on the CPU; `None` when the case is not
/// this kernel's (the caller uses candle's matmul).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Option<Tensor>> {
    let (m, k) = x.dims2()?;
    if m == 0 || m > MAX_ROWS || !plain(x) {
        return Ok(None);
    }
    let (xg, xl) = x.storage_and_layout();
    let Some(xs) = f32_data(&xg, xl.start_offset(), m * k) else {
        return Ok(None);
    };
    let Some(y) = rows(xs, m, w, b)? else {
        return Ok(None);
    };
    drop(xg);
    let n = y.len() / m;
    Tensor::from_vec(y, (m, n), x.device()).map(Some)
}

/// `xs Wᵀ + b` for `m` rows `xs` (`m * k` values), row-major `(m, n)`;
/// `None` when `w` / `b` are not contiguous f32 CPU tensors of matching
/// shapes.
pub fn rows(
    xs: &[f32],
    m: usize,
    w: &Tensor,
    b: Option<&Tensor>,
) -> candle_core::Result<Option<Vec<f32>>> {
    let (n, k) = w.dims2()?;
    if m == 0
        || xs.len() != m * k
        || !plain(w)
        || b.is_some_and(|b| !plain(b) || b.elem_count() != n)
    {
        return Ok(None);
    }
    // The read guards are held for the whole product.
    let (wg, wl) = w.storage_and_layout();
    let bg = b.map(|b| b.storage_and_layout());
    let Some(ws) = f32_data(&wg, wl.start_offset(), n * k) else {
        return Ok(None);
    };
    let bias = match &bg {
        Some((g, l)) => match f32_data(g, l.start_offset(), n) {
            Some(s) => Some(s),
            None => return Ok(None),
        },
        None => None,
    };
    // Transposed output: row j of W gives the m values y[.., j] side by
    // side, so each task owns one contiguous stretch.
    let mut yt = vec![0f32; n * m];
    let job = |task: usize, out: &mut [f32]| {
        let first = task * ROWS_PER_TASK;
        let rows_here = out.len() / m;
        block(&ws[first * k..(first + rows_here) * k], k, xs, m, out);
        if let Some(b) = bias {
            for (i, ys) in out.chunks_exact_mut(m).enumerate() {
                for y in ys {
                    *y += b[first + i];
                }
            }
        }
    };
    crate::compute::parallel::for_each_chunk(&mut yt, ROWS_PER_TASK * m, job);
    drop((wg, bg));
    if m == 1 {
        return Ok(Some(yt));
    }
    let mut y = vec![0f32; m * n];
    for (j, ys) in yt.chunks_exact(m).enumerate() {
        for (r, v) in ys.iter().enumerate() {
            y[r * n + j] = *v;
        }
    }
    Ok(Some(y))
}

/// A contiguous f32 tensor on the CPU.
fn plain(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && t.is_contiguous() && t.device().is_cpu()
}

/// Runs `f` over the values of a contiguous f32 CPU tensor (`None`
/// otherwise).
pub fn with_host<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    if !plain(t) {
        return None;
    }
    let (g, l) = t.storage_and_layout();
    let data = f32_data(&g, l.start_offset(), t.elem_count())?;
    Some(f(data))
}

/// The f32 values of a CPU storage that an in-place op may change, with the
/// element range its contiguous `layout` covers; an error naming `what`
/// when the storage is not f32 or the layout not contiguous.
pub(crate) fn f32_in_place<'a>(
    storage: &'a mut CpuStorage,
    layout: &candle_core::Layout,
    what: &str,
) -> candle_core::Result<(&'a mut [f32], std::ops::Range<usize>)> {
    let CpuStorage::F32(all) = storage else {
        return Err(candle_core::Error::Msg(format!("{what} is not f32")));
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(candle_core::Error::Msg(format!("{what} is not contiguous")));
    };
    Ok((all, start..end))
}

/// `len` f32 values of a CPU storage from element `start`.
fn f32_data(storage: &Storage, start: usize, len: usize) -> Option<&[f32]> {
    match storage {
        Storage::Cpu(CpuStorage::F32(v)) => v.get(start..start + len),
        _ => None,
    }
}

/// `out[j * m + r] = Σ w[j][i] * x[r][i]` for the rows `j` of `w` (each
/// `k` values) and the `m` rows `x[r]` of `xs`: one block of output rows.
fn block(w: &[f32], k: usize, xs: &[f32], m: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd512() {
            // SAFETY: the CPU has AVX-512F (checked by `simd512`).
            unsafe { block_avx512(w, k, xs, m, out) };
            return;
        }
        if simd() {
            // SAFETY: the CPU has AVX2 and FMA (checked by `simd`).
            unsafe { block_avx2(w, k, xs, m, out) };
            return;
        }
    }
    for (j, ys) in out.chunks_exact_mut(m).enumerate() {
        for (r, y) in ys.iter_mut().enumerate() {
            *y = dot_portable(&w[j * k..(j + 1) * k], &xs[r * k..(r + 1) * k]);
        }
    }
}

/// True when the CPU has AVX2 and FMA (checked once).
#[cfg(target_arch = "x86_64")]
pub(crate) fn simd() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    })
}

/// True when the CPU has AVX-512F (checked once).
#[cfg(target_arch = "x86_64")]
pub(crate) fn simd512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::is_x86_feature_detected!("avx512f"))
}

/// Weight rows per pass of [`block_avx512`]: each 16-value piece of `x`
/// is loaded once for all of them, and their streams are in flight at
/// once. On an AVX-512 machine decode ran faster with 4 rows per pass than
/// with one, and a little faster again with 8 (docs/decisions.md, "The
/// engine"). 8 rows keep 16 accumulators and the two `x` pieces in 32
/// vector registers.
#[cfg(target_arch = "x86_64")]
const ROWS_PER_PASS: usize = 8;

/// [`block`] with AVX-512: [`ROWS_PER_PASS`] weight rows per pass, each
/// dotted with every row of `x`. Every output is [`dots_avx512`]'s, with
/// the same sums in the same order whatever `m` and wherever the row falls,
/// so a sequence's logits do not depend on what it is batched with.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block_avx512(w: &[f32], k: usize, xs: &[f32], m: usize, out: &mut [f32]) {
    const P: usize = ROWS_PER_PASS;
    let rows = out.len() / m;
    let whole = rows / P * P;
    for j in (0..whole).step_by(P) {
        let wr = &w[j * k..(j + P) * k];
        for r in 0..m {
            // SAFETY: the CPU has AVX-512F (this function's contract).
            let y = unsafe { dots_avx512::<P>(wr, k, &xs[r * k..(r + 1) * k]) };
            for (u, v) in y.into_iter().enumerate() {
                out[(j + u) * m + r] = v;
            }
        }
    }
    for j in whole..rows {
        let wr = &w[j * k..(j + 1) * k];
        for r in 0..m {
            // SAFETY: as above.
            let [y] = unsafe { dots_avx512::<1>(wr, k, &xs[r * k..(r + 1) * k]) };
            out[j * m + r] = y;
        }
    }
}

/// [`dot`] with AVX-512 ([`dots_avx512`] for one row).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    // SAFETY: the CPU has AVX-512F (this function's contract); `a` holds
    // at least `n` values.
    let [y] = unsafe { dots_avx512::<1>(&a[..n], n, &b[..n]) };
    y
}

/// The dot products of the `N` consecutive rows of `w` (`k` values each)
/// with `x` (`k` values): two 16-wide FMA accumulators per row, the last
/// values (fewer than 16) through masked loads. Panics when `w` holds
/// fewer than `N * k` values or `x` fewer than `k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_avx512<const N: usize>(w: &[f32], k: usize, x: &[f32]) -> [f32; N] {
    use std::arch::x86_64::*;
    assert!(w.len() >= N * k && x.len() >= k);
    let (pw, px) = (w.as_ptr(), x.as_ptr());
    let mut out = [0f32; N];
    // SAFETY: every load reads lanes below `k` of `x` and of row `u < N`
    // of `w` (full loads below `k`, masked loads for the rest), all inside
    // the slices checked above; loadu has no alignment requirement.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        let mut o = 0;
        while o + 32 <= k {
            let x0 = _mm512_loadu_ps(px.add(o));
            let x1 = _mm512_loadu_ps(px.add(o + 16));
            for (u, acc) in acc.iter_mut().enumerate() {
                let row = pw.add(u * k + o);
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(row), x0, acc[0]);
                acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(row.add(16)), x1, acc[1]);
            }
            o += 32;
        }
        while o < k {
            let left = (k - o).min(16);
            let mask: __mmask16 = if left == 16 {
                0xFFFF
            } else {
                (1u16 << left) - 1
            };
            let x0 = _mm512_maskz_loadu_ps(mask, px.add(o));
            for (u, acc) in acc.iter_mut().enumerate() {
                let row = _mm512_maskz_loadu_ps(mask, pw.add(u * k + o));
                acc[0] = _mm512_fmadd_ps(row, x0, acc[0]);
            }
            o += 16;
        }
        for (y, acc) in out.iter_mut().zip(&acc) {
            *y = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        }
    }
    out
}

/// [`block`] with AVX2, one weight row at a time. (Four rows per pass,
/// each `x` load feeding four FMAs, decoded slower with AVX2, and so did a
/// software prefetch ahead of the rows. With AVX-512 rows per pass paid:
/// [`ROWS_PER_PASS`].)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(w: &[f32], k: usize, xs: &[f32], m: usize, out: &mut [f32]) {
    for (j, ys) in out.chunks_exact_mut(m).enumerate() {
        let wrow = &w[j * k..(j + 1) * k];
        for (r, y) in ys.iter_mut().enumerate() {
            // SAFETY: the CPU has AVX2 and FMA (this function's contract).
            *y = unsafe { dot_avx2(wrow, &xs[r * k..(r + 1) * k]) };
        }
    }
}

/// The sum of a vector's eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_hadd_ps(s, s);
    let s = _mm_hadd_ps(s, s);
    _mm_cvtss_f32(s)
}

/// `Σ a[i] * b[i]`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd512() {
            // SAFETY: the CPU has AVX-512F (checked by `simd512`).
            return unsafe { dot_avx512(a, b) };
        }
        if simd() {
            // SAFETY: the CPU has AVX2 and FMA (checked by `simd`).
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

/// Eight running sums, so the compiler can keep them in vector lanes.
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// [`dot`] with four 8-wide FMA accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let blocks = n / 32;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    // SAFETY: every load reads 8 floats at an offset below `blocks * 32
    // <= n`, inside both slices; loadu has no alignment requirement.
    let mut sum = unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in 0..blocks {
            let o = i * 32;
            for (u, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(pa.add(o + 8 * u));
                let y = _mm256_loadu_ps(pb.add(o + 8 * u));
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
        }
        hsum(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ))
    };
    for i in blocks * 32..n {
        sum += a[i] * b[i];
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::{Linear, Module};

    fn values(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.37 + seed).sin() * 0.5)
            .collect()
    }

    #[test]
    fn equals_candles_linear_for_every_small_batch_and_odd_widths() {
        let dev = Device::Cpu;
        for (m, n, k) in [(1, 130, 77), (3, 64, 768), (8, 200, 33), (1, 1, 1)] {
            let x = Tensor::from_vec(values(m * k, 1.0), (m, k), &dev).unwrap();
            let w = Tensor::from_vec(values(n * k, 2.0), (n, k), &dev).unwrap();
            let b = Tensor::from_vec(values(n, 3.0), n, &dev).unwrap();
            for bias in [None, Some(&b)] {
                let want = Linear::new(w.clone(), bias.cloned()).forward(&x).unwrap();
                let got = linear(&x, &w, bias).unwrap().unwrap();
                let (want, got): (Vec<f32>, Vec<f32>) = (
                    want.flatten_all().unwrap().to_vec1().unwrap(),
                    got.flatten_all().unwrap().to_vec1().unwrap(),
                );
                for (a, b) in want.iter().zip(&got) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                        "{m}x{n}x{k}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_rows_result_does_not_depend_on_its_batch() {
        let dev = Device::Cpu;
        for (n, k) in [(130, 77), (67, 768), (5, 16)] {
            let w = Tensor::from_vec(values(n * k, 2.0), (n, k), &dev).unwrap();
            let xs = values(5 * k, 1.0);
            let batched = rows(&xs, 5, &w, None).unwrap().unwrap();
            for r in 0..5 {
                let alone = rows(&xs[r * k..(r + 1) * k], 1, &w, None).unwrap().unwrap();
                assert_eq!(alone[..], batched[r * n..(r + 1) * n], "{n}x{k} row {r}");
            }
        }
    }

    #[test]
    fn other_cases_are_left_to_candle() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((MAX_ROWS + 1, 4), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
        assert!(linear(&x, &w, None).unwrap().is_none(), "too many rows");
        let x16 = Tensor::zeros((1, 4), DType::F16, &dev).unwrap();
        assert!(linear(&x16, &w, None).unwrap().is_none(), "not f32");
        let strided = Tensor::zeros((4, 2), DType::F32, &dev)
            .unwrap()
            .t()
            .unwrap();
        assert!(
            linear(&strided, &w, None).unwrap().is_none(),
            "not contiguous"
        );
    }

    #[test]
    fn dot_kernels_agree() {
        for n in [0, 1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000] {
            let (a, b) = (values(n, 0.5), values(n, 1.5));
            let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - plain).abs() < 1e-3, "{n}");
            assert!((dot_portable(&a, &b) - plain).abs() < 1e-3, "{n}");
            #[cfg(target_arch = "x86_64")]
            {
                // Each SIMD kernel this CPU has, whichever `dot` picked.
                if simd() {
                    // SAFETY: the CPU has AVX2 and FMA.
                    assert!(
                        (unsafe { dot_avx2(&a, &b) } - plain).abs() < 1e-3,
                        "avx2 {n}"
                    );
                }
                if simd512() {
                    // SAFETY: the CPU has AVX-512F.
                    assert!(
                        (unsafe { dot_avx512(&a, &b) } - plain).abs() < 1e-3,
                        "avx512 {n}"
                    );
                }
            }
        }
    }
}
