//! The shape of one KV block: how many layers, heads, head dimensions and
//! tokens it holds, and the element type.
//!
//! A [`KvLayout`] fixes the payload size of every block of a model, and so the
//! size of its on-disk slot ([`KvLayout::encoded_bytes`], defined with the
//! block format in [`crate::block`]). It is also part of
//! the key-chain seed (see [`crate::key::KeyChain`]), so KV computed with one
//! layout or dtype can never be served to another.

use std::fmt;

/// Largest payload a single block may carry (1 GiB). Layouts above it are
/// rejected by [`KvLayout::validate`], which also bounds what a corrupt
/// header can make a reader allocate.
pub const MAX_PAYLOAD_BYTES: u64 = 1 << 30;

/// Element type of the cached K and V tensors. The discriminant is the byte
/// stored in the block header; it never changes for an existing variant.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE 754 single precision (4 bytes).
    F32 = 0,
    /// IEEE 754 half precision (2 bytes).
    F16 = 1,
    /// bfloat16 (2 bytes).
    Bf16 = 2,
    /// 8-bit float, 4 exponent and 3 mantissa bits (1 byte).
    F8E4m3 = 3,
}

impl KvDtype {
    /// Every dtype, in discriminant order.
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::F8E4m3];

    /// Bytes per element.
    pub fn size_bytes(self) -> u32 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::F8E4m3 => 1,
        }
    }

    /// The dtype stored as byte `v` in a block header; `None` for unknown bytes.
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(KvDtype::F32),
            1 => Some(KvDtype::F16),
            2 => Some(KvDtype::Bf16),
            3 => Some(KvDtype::F8E4m3),
            _ => None,
        }
    }

    /// Lower-case name used in configs, logs and metrics: `f32`, `f16`,
    /// `bf16`, `f8e4m3`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::F8E4m3 => "f8e4m3",
        }
    }

    /// Parses a name as printed by [`KvDtype::name`] (ASCII case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(name))
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The shape of one KV block: K and V of every layer for `block_tokens`
/// tokens, stored as `[K|V][layer][kv_head][token][head_dim]` elements of
/// `dtype` (the store treats the payload as opaque bytes; the order is the
/// engine's convention).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: u32,
    /// Key/value heads per layer (after grouped-query sharing).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Payload bytes of one block, or `None` if the product overflows `u64`:
    /// `2 (K and V) * layers * kv_heads * head_dim * block_tokens * dtype size`.
    pub fn checked_payload_bytes(&self) -> Option<u64> {
        2u64.checked_mul(u64::from(self.layers))?
            .checked_mul(u64::from(self.kv_heads))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.block_tokens))?
            .checked_mul(u64::from(self.dtype.size_bytes()))
    }

    /// Payload bytes of one block:
    /// `2 (K and V) * layers * kv_heads * head_dim * block_tokens * dtype size`.
    ///
    /// Saturates at `u64::MAX` on overflow (such a layout fails
    /// [`KvLayout::validate`]).
    pub fn payload_bytes(&self) -> u64 {
        self.checked_payload_bytes().unwrap_or(u64::MAX)
    }

    /// Checks that every dimension is at least 1 and that the payload fits in
    /// [`MAX_PAYLOAD_BYTES`] without overflow.
    pub fn validate(&self) -> Result<(), LayoutError> {
        for (name, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("block_tokens", self.block_tokens),
        ] {
            if v == 0 {
                return Err(LayoutError(format!("{name} must be at least 1")));
            }
        }
        match self.checked_payload_bytes() {
            None => Err(LayoutError(format!("payload size of {self} overflows u64"))),
            Some(n) if n > MAX_PAYLOAD_BYTES => Err(LayoutError(format!(
                "payload of {n} bytes for {self} exceeds the {MAX_PAYLOAD_BYTES}-byte limit"
            ))),
            Some(_) => Ok(()),
        }
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers x {} kv heads x {} head dim x {} tokens, {}",
            self.layers, self.kv_heads, self.head_dim, self.block_tokens, self.dtype
        )
    }
}

/// A layout that cannot work: a zero dimension, an overflowing size, or a
/// payload over [`MAX_PAYLOAD_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            block_tokens: 4,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn dtype_bytes_round_trip_and_names() {
        for d in KvDtype::ALL {
            assert_eq!(KvDtype::from_u8(d as u8), Some(d));
            assert_eq!(KvDtype::from_name(d.name()), Some(d));
            assert_eq!(KvDtype::from_name(&d.name().to_uppercase()), Some(d));
            assert_eq!(d.to_string(), d.name());
        }
        assert_eq!(KvDtype::from_u8(4), None);
        assert_eq!(KvDtype::from_u8(255), None);
        assert_eq!(KvDtype::from_name("f64"), None);
        let sizes: Vec<u32> = KvDtype::ALL.iter().map(|d| d.size_bytes()).collect();
        assert_eq!(sizes, [4, 2, 2, 1]);
    }

    #[test]
    fn payload_and_slot_sizes() {
        let l = small();
        assert_eq!(l.payload_bytes(), 2 * 2 * 2 * 8 * 4 * 4);
        assert_eq!(l.encoded_bytes(), 4096);
        l.validate().unwrap();

        // A Llama-3-8B-like block: 32 layers, 8 kv heads, 128 dim, 256 tokens, bf16.
        let big = KvLayout {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            block_tokens: 256,
            dtype: KvDtype::Bf16,
        };
        assert_eq!(big.payload_bytes(), 32 << 20);
        assert_eq!(big.encoded_bytes(), (32 << 20) + 4096);
        big.validate().unwrap();

        // Exactly fills a 4 KiB slot with the header.
        let exact = KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 1,
            block_tokens: (4096 - 128) / 2,
            dtype: KvDtype::F8E4m3,
        };
        assert_eq!(exact.encoded_bytes(), 4096);
        let over = KvLayout {
            block_tokens: exact.block_tokens + 1,
            ..exact
        };
        assert_eq!(over.encoded_bytes(), 8192);
    }

    #[test]
    fn validate_rejects_zero_dims_overflow_and_huge_payloads() {
        let l = small();
        for bad in [
            KvLayout { layers: 0, ..l },
            KvLayout { kv_heads: 0, ..l },
            KvLayout { head_dim: 0, ..l },
            KvLayout {
                block_tokens: 0,
                ..l
            },
        ] {
            assert!(matches!(bad.validate(), Err(LayoutError(_))));
        }
        let huge = KvLayout {
            layers: u32::MAX,
            kv_heads: u32::MAX,
            head_dim: u32::MAX,
            block_tokens: u32::MAX,
            dtype: KvDtype::F32,
        };
        assert_eq!(huge.checked_payload_bytes(), None);
        assert_eq!(huge.payload_bytes(), u64::MAX);
        assert_eq!(huge.encoded_bytes(), u64::MAX);
        assert!(matches!(huge.validate(), Err(LayoutError(_))));

        // 1 GiB exactly is allowed; one more token's worth is not.
        let at_limit = KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 1,
            block_tokens: 1 << 29,
            dtype: KvDtype::F8E4m3,
        };
        assert_eq!(at_limit.payload_bytes(), MAX_PAYLOAD_BYTES);
        at_limit.validate().unwrap();
        let past = KvLayout {
            block_tokens: (1 << 29) + 1,
            ..at_limit
        };
        assert!(matches!(past.validate(), Err(LayoutError(_))));
    }
}
