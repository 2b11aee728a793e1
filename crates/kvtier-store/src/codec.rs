//! KV codecs: how a block's payload is stored in G2, G3 and G4, so a
//! restore moves fewer bytes than the engine's own dtype would.
//!
//! A [`KvLayout`]'s `dtype` is what the engine hands the store and gets
//! back (its *logical* payload, [`KvLayout::payload_bytes`]); its `codec`
//! is how those elements are kept (the *stored* payload,
//! [`KvLayout::stored_payload_bytes`], the one written after the block
//! header). G2 holds the stored form too, so a block moves between tiers
//! without re-encoding, and G2 holds 2-3.8x more blocks.
//!
//! The payload is coded in **groups** of `head_dim` consecutive elements:
//! one token's row of one head (of K, of V or of a latent; a vLLM CPU
//! page's `2 * head_size` row is two groups, K's half and V's). Each
//! group is stored on its own, in payload order:
//!
//! | codec      | one group of `head_dim` elements, stored as                  |
//! |------------|--------------------------------------------------------------|
//! | `none`     | the elements as given                                         |
//! | `bf16`     | `head_dim` bfloat16 (round to nearest even; NaN and Inf kept) |
//! | `fp8-e4m3` | `scale` (f32 LE) then `head_dim` OCP E4M3 bytes of `x / scale`, `scale = max|x| / 448` |
//! | `int8`     | `scale` (f32 LE) then `head_dim` i8 of `round(x / scale)`, `scale = max|x| / 127`   |
//!
//! A scale per (token, head) is finer than the per (block, layer, head)
//! scales the issue asked as a minimum: one outlier token does not cost its
//! neighbours their precision, and the scale costs 4 bytes per `head_dim`
//! (6 % at 64). Because every group's stored size is fixed, a region of
//! the logical payload that starts and ends on group boundaries (every
//! layer, K/V part, head and token range does) maps to one contiguous
//! stored range ([`KvLayout::stored_range`]): a reader decodes one layer,
//! or one head's rows, without touching the rest.
//!
//! Decisions:
//! * fp8 and int8 refuse a group holding NaN or Inf ([`CodecError::NotFinite`]):
//!   it has no faithful scaled form, so such a block is not stored (the
//!   engine recomputes it, and gets the same NaN); bf16 keeps them.
//! * An all-zero group has scale 0 and decodes to zeros.
//! * `bf16` codes f32 only (from f16 or bf16 it saves nothing); `fp8-e4m3`
//!   and `int8` code f32, f16 and bf16; an f8 dtype takes no codec.
//! * Decoding writes straight into the caller's memory (a G1 page, a vLLM
//!   block tensor): the copy that a restore makes anyway is the decode, no
//!   extra pass over memory.

use std::fmt;
use std::ops::Range;

use float8::F8E4M3;
use half::{bf16, f16};

use crate::kv_layout::{KvDtype, KvLayout};

/// How a block's payload is stored. The discriminant is the block
/// header's byte 7 (`docs/block-format.md`); it never changes for an
/// existing variant.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvCodec {
    /// The engine's dtype, byte for byte.
    #[default]
    None = 0,
    /// bfloat16 (from f32): half the bytes.
    Bf16 = 1,
    /// OCP FP8 E4M3 with an f32 scale per group.
    Fp8E4m3 = 2,
    /// Symmetric int8 with an f32 scale per group.
    Int8 = 3,
}

/// Why a payload could not be coded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// fp8 and int8 cannot scale a group holding NaN or Inf.
    #[error("{codec} cannot code a non-finite KV value (NaN or Inf)")]
    NotFinite {
        /// The codec asked.
        codec: KvCodec,
    },
    /// Buffers or ranges that do not match whole groups of the layout.
    #[error("{0}")]
    Shape(String),
}

impl KvCodec {
    /// Every codec, in discriminant order.
    pub const ALL: [KvCodec; 4] = [
        KvCodec::None,
        KvCodec::Bf16,
        KvCodec::Fp8E4m3,
        KvCodec::Int8,
    ];

    /// The codec stored as byte `v` in a block header; `None` if unknown.
    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.get(usize::from(v)).copied()
    }

    /// The name used by `--kv-offload-codec`, configs and the Python API:
    /// `none`, `bf16`, `fp8-e4m3`, `int8`.
    pub fn name(self) -> &'static str {
        match self {
            KvCodec::None => "none",
            KvCodec::Bf16 => "bf16",
            KvCodec::Fp8E4m3 => "fp8-e4m3",
            KvCodec::Int8 => "int8",
        }
    }

    /// Parses a name as printed by [`KvCodec::name`] (ASCII
    /// case-insensitive; `_` is taken for `-`).
    pub fn from_name(name: &str) -> Option<Self> {
        let name = name.replace('_', "-");
        Self::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(&name))
    }

    /// Whether this codec can store elements of `dtype`.
    pub fn supports(self, dtype: KvDtype) -> bool {
        match self {
            KvCodec::None => true,
            KvCodec::Bf16 => dtype == KvDtype::F32,
            KvCodec::Fp8E4m3 | KvCodec::Int8 => {
                matches!(dtype, KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16)
            }
        }
    }

    /// Stored bytes of one group of `group` elements of `dtype`.
    pub fn group_bytes(self, dtype: KvDtype, group: u64) -> Option<u64> {
        match self {
            KvCodec::None => group.checked_mul(u64::from(dtype.size_bytes())),
            KvCodec::Bf16 => group.checked_mul(2),
            KvCodec::Fp8E4m3 | KvCodec::Int8 => group.checked_add(4),
        }
    }
}

impl fmt::Display for KvCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Adding and subtracting 1.5 * 2^23 rounds an f32 below 2^22 in
/// magnitude to the nearest integer, ties to even, in two vector adds
/// (`f32::round` is a libm call on baseline x86-64, and does not vectorize).
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `x` (|x| < 2^22) rounded to the nearest integer, ties to even.
#[inline]
fn round_even(x: f32) -> f32 {
    (x + ROUND_MAGIC) - ROUND_MAGIC
}

/// The OCP E4M3 byte nearest `x` (finite, |x| <= 448), ties to even.
///
/// Hand-written: float8's `F8E4M3::from_f32` (which the tests hold this to,
/// value by value) goes through f64 and a general converter, too slow for
/// the engine's offload path (`kvtier-lab codec_speed` times both); this
/// is the same rounding in integer steps the compiler vectorizes.
#[inline]
fn fp8_bits(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    // Normal (|x| >= 2^-6): keep 3 mantissa bits, rounding to nearest even
    // (a carry moves into the exponent), and rebias the exponent 127 -> 7.
    let kept = (abs + 0x7_FFFF + ((abs >> 20) & 1)) >> 20;
    let normal = kept.wrapping_sub(120 << 3);
    // Subnormal: multiples of 2^-9 (8 of them is 2^-6, the byte 0x08).
    let sub = round_even(f32::from_bits(abs) * 512.0) as u32;
    let code = if abs < 0x3C80_0000 { sub } else { normal };
    (sign | code) as u8
}

/// The value of an E4M3 byte: its fields moved into f32's in integer steps
/// (vectorizes, where a 256-entry table lookup does not). The NaN bytes
/// (0x7F, 0xFF) read as +-480; [`encode`] never writes them.
#[inline]
pub(crate) fn fp8_value(b: u8) -> f32 {
    let b = u32::from(b);
    let sign = (b & 0x80) << 24;
    let em = b & 0x7F;
    let normal = f32::from_bits(sign | ((em << 20) + (120 << 23)));
    let sub = f32::from_bits(sign | (em as f32 * (1.0 / 512.0)).to_bits());
    if em < 8 { sub } else { normal }
}

/// Largest finite E4M3 magnitude.
const FP8_MAX: f32 = 448.0;
/// Largest int8 magnitude used (symmetric: -127..=127).
const INT8_MAX: f32 = 127.0;

/// Reads element `i` of `dtype` from little-endian bytes.
#[inline]
fn load(dtype: KvDtype, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        KvDtype::F32 => {
            let b = &bytes[i * 4..i * 4 + 4];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
        KvDtype::F16 => f16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]]).to_f32(),
        KvDtype::Bf16 => bf16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]]).to_f32(),
        KvDtype::F8E4m3 => F8E4M3::from_bits(bytes[i]).to_f32(),
    }
}

/// Writes `v` as element `i` of `dtype` into little-endian bytes.
#[inline]
fn store(dtype: KvDtype, bytes: &mut [u8], i: usize, v: f32) {
    match dtype {
        KvDtype::F32 => bytes[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes()),
        KvDtype::F16 => bytes[i * 2..i * 2 + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
        KvDtype::Bf16 => {
            bytes[i * 2..i * 2 + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes());
        }
        KvDtype::F8E4m3 => bytes[i] = F8E4M3::from_f32(v).to_bits(),
    }
}

/// Codes `logical` (whole groups of `group` elements of `dtype`) into
/// `stored` (exactly their stored size).
pub fn encode(
    codec: KvCodec,
    dtype: KvDtype,
    group: usize,
    logical: &[u8],
    stored: &mut [u8],
) -> Result<(), CodecError> {
    let (in_group, out_group) = group_sizes(codec, dtype, group)?;
    whole_groups(logical.len(), in_group, stored.len(), out_group)?;
    if codec == KvCodec::None {
        stored.copy_from_slice(logical);
        return Ok(());
    }
    // One group as f32 at a time: read once, scanned for its scale, coded.
    let mut vals = vec![0f32; group];
    for (src, dst) in logical
        .chunks_exact(in_group)
        .zip(stored.chunks_exact_mut(out_group))
    {
        if dtype == KvDtype::F32 {
            for (v, b) in vals.iter_mut().zip(src.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        } else {
            for (i, v) in vals.iter_mut().enumerate() {
                *v = load(dtype, src, i);
            }
        }
        if codec == KvCodec::Bf16 {
            for (v, d) in vals.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
            continue;
        }
        // The largest magnitude as the largest sign-cleared bit pattern:
        // an integer max, which vectorizes (an f32 max chain does not);
        // Inf and NaN are the patterns from 0x7F80_0000 up.
        let top_bits = vals
            .iter()
            .map(|v| v.to_bits() & 0x7FFF_FFFF)
            .fold(0u32, u32::max);
        if top_bits >= 0x7F80_0000 {
            return Err(CodecError::NotFinite { codec });
        }
        let amax = f32::from_bits(top_bits);
        let top = if codec == KvCodec::Int8 {
            INT8_MAX
        } else {
            FP8_MAX
        };
        // A group of zeros (or of subnormals too small to scale) stores
        // scale 0 and decodes to zeros.
        let scale = amax / top;
        let (scale, inv) = if scale.is_normal() {
            (scale, 1.0 / scale)
        } else {
            (0.0, 0.0)
        };
        let (head, q) = dst.split_at_mut(4);
        head.copy_from_slice(&scale.to_le_bytes());
        if codec == KvCodec::Int8 {
            for (q, v) in q.iter_mut().zip(&vals) {
                *q = round_even((v * inv).clamp(-INT8_MAX, INT8_MAX)) as i8 as u8;
            }
        } else {
            for (q, v) in q.iter_mut().zip(&vals) {
                *q = fp8_bits((v * inv).clamp(-FP8_MAX, FP8_MAX));
            }
        }
    }
    Ok(())
}

/// Decodes `stored` (whole groups as [`encode`] wrote them) into
/// `logical` (exactly their logical size, elements of `dtype`).
pub fn decode(
    codec: KvCodec,
    dtype: KvDtype,
    group: usize,
    stored: &[u8],
    logical: &mut [u8],
) -> Result<(), CodecError> {
    let (out_group, in_group) = group_sizes(codec, dtype, group)?;
    whole_groups(logical.len(), out_group, stored.len(), in_group)?;
    // f32 destinations that are 4-byte aligned (a G1 page, a torch
    // tensor) are written as f32: with streaming stores where the CPU
    // allows (`codec_stream`), else in a loop that vectorizes.
    if dtype == KvDtype::F32
        && let Ok(out) = bytemuck::try_cast_slice_mut::<u8, f32>(logical)
        && crate::codec_stream::decode_f32(codec, group, stored, out)
    {
        return Ok(());
    }
    if codec == KvCodec::None {
        logical.copy_from_slice(stored);
        return Ok(());
    }
    if dtype == KvDtype::F32
        && let Ok(out) = bytemuck::try_cast_slice_mut::<u8, f32>(logical)
    {
        for (src, dst) in stored
            .chunks_exact(in_group)
            .zip(out.chunks_exact_mut(group))
        {
            decode_group_f32(codec, src, dst);
        }
        return Ok(());
    }
    let mut tmp = vec![0f32; group];
    for (src, dst) in stored
        .chunks_exact(in_group)
        .zip(logical.chunks_exact_mut(out_group))
    {
        decode_group_f32(codec, src, &mut tmp);
        for (i, &v) in tmp.iter().enumerate() {
            store(dtype, dst, i, v);
        }
    }
    Ok(())
}

/// Decodes one stored group (not `none`) into `out`.
#[inline]
fn decode_group_f32(codec: KvCodec, src: &[u8], out: &mut [f32]) {
    match codec {
        KvCodec::None => {}
        KvCodec::Bf16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        KvCodec::Fp8E4m3 | KvCodec::Int8 => {
            let scale = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
            let q = &src[4..];
            if codec == KvCodec::Int8 {
                for (o, &b) in out.iter_mut().zip(q) {
                    *o = f32::from(b as i8) * scale;
                }
            } else {
                for (o, &b) in out.iter_mut().zip(q) {
                    *o = fp8_value(b) * scale;
                }
            }
        }
    }
}

/// (logical, stored) bytes of one group; refuses an unsupported pair.
fn group_sizes(codec: KvCodec, dtype: KvDtype, group: usize) -> Result<(usize, usize), CodecError> {
    if !codec.supports(dtype) {
        return Err(CodecError::Shape(format!(
            "codec {codec} cannot store {dtype} KV"
        )));
    }
    let logical = group.checked_mul(dtype.size_bytes() as usize);
    let stored = codec
        .group_bytes(dtype, group as u64)
        .and_then(|b| usize::try_from(b).ok());
    match (logical, stored) {
        (Some(l), Some(s)) if group > 0 => Ok((l, s)),
        _ => Err(CodecError::Shape(format!("bad codec group of {group}"))),
    }
}

/// Checks that `logical_len` and `stored_len` bytes are the same whole
/// number of groups.
fn whole_groups(
    logical_len: usize,
    logical_group: usize,
    stored_len: usize,
    stored_group: usize,
) -> Result<(), CodecError> {
    let groups = logical_len / logical_group;
    if !logical_len.is_multiple_of(logical_group)
        || groups.checked_mul(stored_group) != Some(stored_len)
    {
        return Err(CodecError::Shape(format!(
            "{logical_len} logical bytes and {stored_len} stored bytes are not the same whole \
             number of {logical_group}-byte groups"
        )));
    }
    Ok(())
}

impl KvLayout {
    /// Payload bytes of one block as stored ([`KvLayout::payload_bytes`]
    /// coded by the layout's codec), or `None` on overflow or for a codec
    /// that cannot store the dtype.
    pub fn checked_stored_payload_bytes(&self) -> Option<u64> {
        if !self.codec.supports(self.dtype) {
            return None;
        }
        let groups = self.checked_payload_bytes()?
            / u64::from(self.dtype.size_bytes())
            / u64::from(self.head_dim.max(1));
        groups.checked_mul(
            self.codec
                .group_bytes(self.dtype, u64::from(self.head_dim))?,
        )
    }

    /// Payload bytes of one block as stored (saturates at `u64::MAX`; such
    /// a layout fails [`KvLayout::validate`]).
    pub fn stored_payload_bytes(&self) -> u64 {
        self.checked_stored_payload_bytes().unwrap_or(u64::MAX)
    }

    /// Bytes of one group (`head_dim` elements) in the logical payload.
    fn logical_group_bytes(&self) -> u64 {
        u64::from(self.head_dim) * u64::from(self.dtype.size_bytes())
    }

    /// Where the logical payload bytes `logical` sit in the stored payload;
    /// `None` unless both ends fall on group boundaries (multiples of
    /// `head_dim` elements) within the payload. For a valid layout.
    pub fn stored_range(&self, logical: Range<u64>) -> Option<Range<u64>> {
        let g = self.logical_group_bytes();
        if g == 0
            || logical.start > logical.end
            || logical.end > self.payload_bytes()
            || !logical.start.is_multiple_of(g)
            || !logical.end.is_multiple_of(g)
        {
            return None;
        }
        let s = self
            .codec
            .group_bytes(self.dtype, u64::from(self.head_dim))?;
        Some(logical.start / g * s..logical.end / g * s)
    }

    /// Codes `src`, the logical payload bytes from `offset` on, into their
    /// place in `stored` (a whole stored payload).
    pub fn encode_into(
        &self,
        offset: u64,
        src: &[u8],
        stored: &mut [u8],
    ) -> Result<(), CodecError> {
        let range = self.mapped(offset, src.len(), stored.len())?;
        encode(
            self.codec,
            self.dtype,
            self.head_dim as usize,
            src,
            &mut stored[range],
        )
    }

    /// Decodes the logical payload bytes from `offset` on out of `stored`
    /// (a whole stored payload) into `dst`.
    pub fn decode_into(
        &self,
        stored: &[u8],
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), CodecError> {
        let range = self.mapped(offset, dst.len(), stored.len())?;
        decode(
            self.codec,
            self.dtype,
            self.head_dim as usize,
            &stored[range],
            dst,
        )
    }

    /// The stored byte range of `len` logical bytes at `offset`, checked
    /// against a stored payload of `stored_len` bytes.
    fn mapped(
        &self,
        offset: u64,
        len: usize,
        stored_len: usize,
    ) -> Result<Range<usize>, CodecError> {
        if stored_len as u64 != self.stored_payload_bytes() {
            return Err(CodecError::Shape(format!(
                "stored payload of {stored_len} bytes, layout {self} stores {}",
                self.stored_payload_bytes()
            )));
        }
        offset
            .checked_add(len as u64)
            .and_then(|end| self.stored_range(offset..end))
            .map(|r| r.start as usize..r.end as usize)
            .ok_or_else(|| {
                CodecError::Shape(format!(
                    "payload bytes {offset}..+{len} do not fall on {}-element group boundaries \
                     of {self}",
                    self.head_dim
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::kv_layout::Arrangement;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn round_trip(codec: KvCodec, group: usize, v: &[f32]) -> Result<Vec<f32>, CodecError> {
        let src = f32_bytes(v);
        let stored_len =
            v.len() / group * codec.group_bytes(KvDtype::F32, group as u64).unwrap() as usize;
        let mut stored = vec![0u8; stored_len];
        encode(codec, KvDtype::F32, group, &src, &mut stored)?;
        let mut out = vec![0u8; src.len()];
        decode(codec, KvDtype::F32, group, &stored, &mut out)?;
        Ok(f32s(&out))
    }

    /// The per-element error each codec promises, for a group whose
    /// largest magnitude is `amax`.
    fn bound(codec: KvCodec, x: f32, amax: f32) -> f32 {
        match codec {
            KvCodec::None => 0.0,
            // bf16 keeps 8 significant bits: half an ulp is 2^-8 relative.
            KvCodec::Bf16 => x.abs() * (1.0 / 256.0),
            // E4M3 has 3 mantissa bits: half an ulp is 2^-4 relative, and
            // values under the smallest normal (2^-6 of the scale) are
            // spaced 2^-9 of the scale apart.
            KvCodec::Fp8E4m3 => x.abs() / 16.0 + amax / FP8_MAX * (1.0 / 1024.0) * 1.01,
            // Half a step of amax / 127.
            KvCodec::Int8 => amax / INT8_MAX * 0.5 * 1.0001,
        }
    }

    proptest! {
        #[test]
        fn every_codec_round_trips_within_its_bound(
            groups in prop::collection::vec(
                (prop::collection::vec(-1.0e4f32..1.0e4, 8), -20i32..20),
                1..6,
            ),
        ) {
            // Groups of 8 with magnitudes from 2^-20 to 2^20 apart.
            let v: Vec<f32> = groups
                .iter()
                .flat_map(|(g, e)| g.iter().map(move |x| x * 2f32.powi(*e)))
                .collect();
            for codec in KvCodec::ALL {
                let out = round_trip(codec, 8, &v).unwrap();
                for (gi, (ins, outs)) in v.chunks(8).zip(out.chunks(8)).enumerate() {
                    let amax = ins.iter().fold(0f32, |m, x| m.max(x.abs()));
                    for (x, y) in ins.iter().zip(outs) {
                        prop_assert!(
                            (x - y).abs() <= bound(codec, *x, amax),
                            "{codec} group {gi}: {x} came back as {y} (max {amax})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn zeros_extremes_and_non_finite_values() {
        for codec in KvCodec::ALL {
            // All-zero groups decode to zeros (scale 0, no division by it).
            assert_eq!(
                round_trip(codec, 4, &[0.0; 8]).unwrap(),
                vec![0.0; 8],
                "{codec}"
            );
            // The group's largest value is exact for the scaled codecs.
            let v = [3.0e38, -1.0, 0.5, -3.0e38];
            let out = round_trip(codec, 4, &v).unwrap();
            if codec != KvCodec::Bf16 {
                assert_eq!(out[0], 3.0e38, "{codec}");
                assert_eq!(out[3], -3.0e38, "{codec}");
            }
            // Subnormal-only groups do not blow up.
            let tiny = [f32::MIN_POSITIVE / 8.0; 4];
            let out = round_trip(codec, 4, &tiny).unwrap();
            assert!(
                out.iter().all(|x| x.is_finite() && x.abs() <= tiny[0]),
                "{codec}: {out:?}"
            );
        }
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let v = [1.0, bad, 2.0, 3.0];
            for codec in [KvCodec::Fp8E4m3, KvCodec::Int8] {
                assert_eq!(
                    round_trip(codec, 4, &v),
                    Err(CodecError::NotFinite { codec })
                );
            }
            let out = round_trip(KvCodec::Bf16, 4, &v).unwrap();
            assert_eq!(out[1].is_nan(), bad.is_nan());
            assert_eq!(out[1].is_infinite(), bad.is_infinite());
            let out = round_trip(KvCodec::None, 4, &v).unwrap();
            assert_eq!(out[1].to_bits(), bad.to_bits());
        }
    }

    #[test]
    fn fp8_is_float8s_ocp_e4m3_byte_for_byte() {
        // Every byte but the two NaNs decodes as float8 says.
        for b in 0..=255u8 {
            let want = F8E4M3::from_bits(b).to_f32();
            if want.is_nan() {
                assert_eq!(b & 0x7f, 0x7f);
                continue;
            }
            assert_eq!(fp8_value(b).to_bits(), want.to_bits(), "byte {b:#04x}");
        }
        assert_eq!(fp8_value(0x7e), 448.0);
        assert_eq!(fp8_value(0x01), 2f32.powi(-9));
        // Every f32 in -448..=448 (a dense sweep of bit patterns, every
        // tie included) codes to float8's byte.
        let ties = (0..=255u8).flat_map(|b| {
            let v = fp8_value(b);
            let next = fp8_value(b.wrapping_add(1));
            [v, (v + next) / 2.0]
        });
        let sweep = (0..0x43E0_0000u32).step_by(97).map(f32::from_bits);
        for x in sweep
            .chain(ties)
            .filter(|x| x.is_finite() && x.abs() <= 448.0)
        {
            for x in [x, -x] {
                assert_eq!(
                    fp8_bits(x),
                    F8E4M3::from_f32(x).to_bits(),
                    "{x} ({:#010x})",
                    x.to_bits()
                );
            }
        }
        assert_eq!(F8E4M3::from_f32(1.0e6).to_bits(), 0x7e, "float8 saturates");
    }

    #[test]
    fn half_precision_sources_and_unaligned_destinations() {
        let v: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) * 0.37).collect();
        for dtype in [KvDtype::F16, KvDtype::Bf16] {
            let src: Vec<u8> = (0..16)
                .flat_map(|i| {
                    let mut b = vec![0u8; 2];
                    store(dtype, &mut b, 0, v[i]);
                    b
                })
                .collect();
            for codec in [KvCodec::Fp8E4m3, KvCodec::Int8] {
                let mut stored = vec![0u8; 2 * (4 + 8)];
                encode(codec, dtype, 8, &src, &mut stored).unwrap();
                let mut out = vec![0u8; src.len()];
                decode(codec, dtype, 8, &stored, &mut out).unwrap();
                for i in 0..16 {
                    let (x, y) = (load(dtype, &src, i), load(dtype, &out, i));
                    assert!((x - y).abs() <= 0.1, "{dtype} {codec}: {x} vs {y}");
                }
            }
            assert!(matches!(
                encode(KvCodec::Bf16, dtype, 8, &src, &mut [0u8; 32]),
                Err(CodecError::Shape(_))
            ));
        }
        // An f32 destination off 4-byte alignment takes the element path.
        let src = f32_bytes(&v);
        let mut stored = vec![0u8; 2 * (4 + 8)];
        encode(KvCodec::Int8, KvDtype::F32, 8, &src, &mut stored).unwrap();
        let mut aligned = vec![0u8; 64];
        decode(KvCodec::Int8, KvDtype::F32, 8, &stored, &mut aligned).unwrap();
        let mut shifted = [0u8; 65];
        decode(KvCodec::Int8, KvDtype::F32, 8, &stored, &mut shifted[1..]).unwrap();
        assert_eq!(aligned, shifted[1..]);
    }

    #[test]
    fn lengths_that_are_not_whole_groups_are_refused() {
        let mut stored = [0u8; 24];
        assert!(encode(KvCodec::Int8, KvDtype::F32, 8, &[0u8; 36], &mut stored).is_err());
        assert!(
            encode(
                KvCodec::Int8,
                KvDtype::F32,
                8,
                &[0u8; 64],
                &mut stored[..23]
            )
            .is_err()
        );
        assert!(decode(KvCodec::Int8, KvDtype::F32, 0, &[], &mut []).is_err());
        assert!(decode(KvCodec::Fp8E4m3, KvDtype::F8E4m3, 8, &[0; 12], &mut [0; 8]).is_err());
    }

    #[test]
    fn names_bytes_and_stored_ranges() {
        for c in KvCodec::ALL {
            assert_eq!(KvCodec::from_u8(c as u8), Some(c));
            assert_eq!(KvCodec::from_name(c.name()), Some(c));
            assert_eq!(
                KvCodec::from_name(&c.name().replace('-', "_").to_uppercase()),
                Some(c)
            );
        }
        assert_eq!(KvCodec::from_u8(4), None);
        assert_eq!(KvCodec::from_name("fp4"), None);
        // 2 parts x 3 layers x 2 heads x 4 tokens = 48 groups of 8.
        let l = KvLayout {
            codec: KvCodec::Int8,
            ..KvLayout::kv_major(3, 2, 8, 4, KvDtype::F32)
        };
        assert_eq!(l.payload_bytes(), 48 * 32);
        assert_eq!(l.stored_payload_bytes(), 48 * 12);
        assert_eq!(l.stored_range(64..128), Some(24..48));
        assert_eq!(l.stored_range(64..100), None);
        assert_eq!(l.stored_range(0..48 * 32 + 32), None);
        let bf = KvLayout {
            codec: KvCodec::Bf16,
            ..l
        };
        assert_eq!(bf.stored_payload_bytes(), 48 * 16);
        let vllm = KvLayout {
            codec: KvCodec::Fp8E4m3,
            ..KvLayout::vllm_cpu(2, 2, 64, 128, KvDtype::Bf16)
        };
        assert_eq!(vllm.stored_payload_bytes(), 2 * 2 * 2 * 128 * 68);
        let whole = vllm.layer_range(1).unwrap();
        assert_eq!(
            vllm.stored_range(whole),
            Some(2 * 2 * 128 * 68..2 * 2 * 2 * 128 * 68)
        );
        let bad = KvLayout {
            codec: KvCodec::Bf16,
            arrangement: Arrangement::Latent,
            ..KvLayout::kv_major(1, 1, 8, 4, KvDtype::F16)
        };
        assert_eq!(bad.checked_stored_payload_bytes(), None);
    }

    #[test]
    fn layout_codes_and_decodes_a_region_in_place() {
        let l = KvLayout {
            codec: KvCodec::Fp8E4m3,
            ..KvLayout::kv_major(2, 1, 4, 2, KvDtype::F32)
        };
        let all: Vec<f32> = (0..l.payload_bytes() / 4).map(|i| i as f32 + 1.0).collect();
        let mut stored = vec![0u8; l.stored_payload_bytes() as usize];
        // Region by region, in any order, lands where the whole would.
        for (i, chunk) in f32_bytes(&all).chunks(32).enumerate().rev() {
            l.encode_into(i as u64 * 32, chunk, &mut stored).unwrap();
        }
        let mut whole = vec![0u8; stored.len()];
        encode(l.codec, l.dtype, 4, &f32_bytes(&all), &mut whole).unwrap();
        assert_eq!(stored, whole);
        let mut out = vec![0u8; 32];
        l.decode_into(&stored, 32, &mut out).unwrap();
        let got = f32s(&out);
        for (x, y) in all[8..16].iter().zip(&got) {
            assert!((x - y).abs() <= x / 16.0, "{x} vs {y}");
        }
        assert!(
            l.decode_into(&stored, 4, &mut out).is_err(),
            "off a group boundary"
        );
        assert!(
            l.decode_into(&stored[1..], 0, &mut out).is_err(),
            "short stored payload"
        );
    }
}
