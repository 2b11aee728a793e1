//! Decoding coded KV into f32 with streaming stores (x86-64 with AVX2).
//!
//! Hand-written because a restore decodes into G1 pages that no cache
//! holds: plain stores first read every destination line in (twice the
//! memory traffic), and the baseline x86-64 build converts four values at
//! a time. Streaming stores write the lines without reading them, which
//! shortens the hand-over of each restored layer. A layer-wise restore
//! shares its CPU with the forward pass, so every part of that hand-over
//! is TTFT (docs/decisions.md).
//!
//! fp8 went through the portable loops at first (they convert four values
//! at a time); its concurrency-1 TTFT stayed behind int8's, which streamed,
//! so it streams too.
//!
//! The values are bit for bit those of the portable loops in `codec.rs`
//! (the same conversions and one f32 multiply each): tests hold them to
//! each other, every fp8 and int8 byte included. Elsewhere, or without
//! AVX2, the portable loops run.

use crate::codec::KvCodec;

/// Decodes whole groups of `group` elements (`stored`, as `codec` wrote
/// them) into `out`, exactly their f32 values, with streaming stores.
/// False, having written nothing, where this path does not apply (not
/// x86-64 with AVX2, or a group that is not a multiple of 8): the caller
/// decodes the portable way.
/// The caller has checked that `stored` and `out` hold the same whole
/// number of groups.
pub(crate) fn decode_f32(codec: KvCodec, group: usize, stored: &[u8], out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if group.is_multiple_of(8) && group > 0 && avx2() {
            // SAFETY: AVX2 is present (checked above).
            return unsafe { x86::decode(codec, group, stored, out) };
        }
    }
    let _ = (codec, group, stored, out);
    false
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::is_x86_feature_detected!("avx2"))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::codec::KvCodec;

    /// Stores 8 f32 at `p`: streamed, as two 16-byte halves, where `p` is
    /// 16-byte aligned (`aligned`), plainly otherwise.
    ///
    /// # Safety
    /// AVX2; `p` valid for 8 f32 writes, and 16-byte aligned if `aligned`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn put(p: *mut f32, v: __m256, aligned: bool) {
        // SAFETY: as the caller promised.
        unsafe {
            if aligned {
                _mm_stream_ps(p, _mm256_castps256_ps128(v));
                _mm_stream_ps(p.add(4), _mm256_extractf128_ps::<1>(v));
            } else {
                _mm256_storeu_ps(p, v);
            }
        }
    }

    /// The values of the 8 E4M3 bytes in the low half of `b`, as
    /// `codec.rs`'s `fp8_value` makes them: the fields moved into f32's in
    /// integer steps (normal), or the 3 mantissa bits times 2^-9
    /// (subnormal, exponent 0), with the sign put back.
    ///
    /// # Safety
    /// AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn fp8_values(b: __m128i) -> __m256 {
        let b = _mm256_cvtepu8_epi32(b);
        let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(b, _mm256_set1_epi32(0x80)));
        let em = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
        let normal = _mm256_add_epi32(_mm256_slli_epi32::<20>(em), _mm256_set1_epi32(120 << 23));
        let sub = _mm256_castps_si256(_mm256_mul_ps(
            _mm256_cvtepi32_ps(em),
            _mm256_set1_ps(1.0 / 512.0),
        ));
        let is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em);
        _mm256_castsi256_ps(_mm256_or_si256(
            sign,
            _mm256_blendv_epi8(normal, sub, is_sub),
        ))
    }

    /// See [`super::decode_f32`].
    ///
    /// # Safety
    /// AVX2 must be present.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn decode(
        codec: KvCodec,
        group: usize,
        stored: &[u8],
        out: &mut [f32],
    ) -> bool {
        // Every group's output starts 4 * group bytes (a multiple of 32)
        // after the last, so one alignment holds for all of them.
        let aligned = (out.as_ptr() as usize).is_multiple_of(16);
        let groups = out.len() / group;
        match codec {
            KvCodec::Int8 | KvCodec::Fp8E4m3 => {
                let in_group = group + 4;
                if stored.len() != groups * in_group {
                    return false;
                }
                let fp8 = codec == KvCodec::Fp8E4m3;
                for (src, dst) in stored
                    .chunks_exact(in_group)
                    .zip(out.chunks_exact_mut(group))
                {
                    let scale = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
                    let s = _mm256_set1_ps(scale);
                    let q = &src[4..];
                    for i in (0..group).step_by(8) {
                        // SAFETY: `i + 8 <= group`: 8 bytes of `q` and 8
                        // values of `dst` from `i`; alignment as above.
                        unsafe {
                            let b = _mm_loadl_epi64(q.as_ptr().add(i).cast());
                            let x = if fp8 {
                                fp8_values(b)
                            } else {
                                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
                            };
                            put(dst.as_mut_ptr().add(i), _mm256_mul_ps(x, s), aligned);
                        }
                    }
                }
            }
            KvCodec::Bf16 => {
                if stored.len() != out.len() * 2 {
                    return false;
                }
                for (i, src) in stored.chunks_exact(16).enumerate() {
                    // SAFETY: 16 bytes of `stored` and the 8 values of
                    // `out` from `8 * i` (`out` is 8 values per 16 bytes).
                    unsafe {
                        let h = _mm_loadu_si128(src.as_ptr().cast());
                        let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                        put(out.as_mut_ptr().add(8 * i), _mm256_castsi256_ps(w), aligned);
                    }
                }
            }
            KvCodec::None => {
                if stored.len() != out.len() * 4 {
                    return false;
                }
                for (i, src) in stored.chunks_exact(32).enumerate() {
                    // SAFETY: 32 bytes of `stored`, 8 values of `out`.
                    unsafe {
                        let v = _mm256_loadu_ps(src.as_ptr().cast());
                        put(out.as_mut_ptr().add(8 * i), v, aligned);
                    }
                }
            }
        }
        // Streamed stores are weakly ordered: fence them before whoever
        // is told next (a lock's release) reads the values.
        _mm_sfence();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{encode, fp8_value};
    use crate::kv_layout::KvDtype;

    /// What the portable loops of `codec.rs` make of `stored`.
    fn portable(codec: KvCodec, group: usize, stored: &[u8]) -> Vec<f32> {
        match codec {
            KvCodec::None => stored
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            KvCodec::Bf16 => stored
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            KvCodec::Int8 | KvCodec::Fp8E4m3 => stored
                .chunks_exact(group + 4)
                .flat_map(|g| {
                    let scale = f32::from_le_bytes([g[0], g[1], g[2], g[3]]);
                    g[4..].iter().map(move |&b| match codec {
                        KvCodec::Int8 => f32::from(b as i8) * scale,
                        _ => fp8_value(b) * scale,
                    })
                })
                .collect(),
        }
    }

    /// Streams `stored` into `out` (where this path applies: x86-64 with
    /// AVX2, which it must say) and holds each value to `want` bit for bit.
    fn streams_as(
        codec: KvCodec,
        group: usize,
        stored: &[u8],
        want: &[f32],
        out: &mut [f32],
        what: &str,
    ) {
        out.fill(f32::NAN);
        let done = decode_f32(codec, group, stored, out);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(done, std::is_x86_feature_detected!("avx2"), "{what}");
        if done {
            for (i, (a, b)) in out.iter().zip(want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{what} {i}");
            }
        }
    }

    #[test]
    fn streamed_values_are_the_portable_ones_bit_for_bit_at_any_alignment() {
        for group in [8, 64, 128] {
            let n = group * 37;
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1000) as f32 * 0.37 - 185.0 + (i % 3) as f32 * 1e-3)
                .collect();
            let src: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            for codec in KvCodec::ALL {
                let len =
                    n / group * codec.group_bytes(KvDtype::F32, group as u64).unwrap() as usize;
                let mut stored = vec![0u8; len];
                encode(codec, KvDtype::F32, group, &src, &mut stored).unwrap();
                let want = portable(codec, group, &stored);
                // 0: 64-byte aligned (streamed); 1..3: 4, 8, 12 bytes off.
                let mut backing = vec![0f32; n + 32];
                let base = backing.as_ptr().align_offset(64);
                for skew in 0..4 {
                    let out = &mut backing[base + skew..base + skew + n];
                    let what = format!("{codec:?} group {group} skew {skew}, value");
                    streams_as(codec, group, &stored, &want, out, &what);
                }
            }
        }
    }

    #[test]
    fn every_fp8_and_int8_byte_is_its_portable_value_bit_for_bit() {
        // Groups of 8 bytes covering all 256 values, under scales that keep
        // subnormals, signs and the NaN bytes (read as +-480) in play.
        let codes: Vec<u8> = (0..=255).collect();
        for codec in [KvCodec::Fp8E4m3, KvCodec::Int8] {
            for scale in [1.0f32, 0.37, 3.0e-3, 1.0e4] {
                let stored: Vec<u8> = codes
                    .chunks(8)
                    .flat_map(|g| scale.to_le_bytes().into_iter().chain(g.iter().copied()))
                    .collect();
                let want = portable(codec, 8, &stored);
                let mut out = vec![0f32; 256];
                let what = format!("{codec:?} x{scale}, value of byte");
                streams_as(codec, 8, &stored, &want, &mut out, &what);
            }
        }
    }

    #[test]
    fn what_it_does_not_cover_is_left_to_the_portable_loops() {
        let mut out = vec![0f32; 12];
        // Groups that are not a multiple of 8.
        assert!(!decode_f32(KvCodec::Fp8E4m3, 12, &[0u8; 16], &mut out));
        assert!(!decode_f32(KvCodec::Int8, 12, &[0u8; 16], &mut out));
        assert!(!decode_f32(KvCodec::None, 4, &[0u8; 48], &mut out));
        assert!(out.iter().all(|&v| v == 0.0), "nothing written");
    }
}
