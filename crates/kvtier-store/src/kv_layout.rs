//! The shape of one KV block: how many layers, heads, head dimensions and
//! tokens it holds, the element type, how its payload divides into
//! regions per layer ([`Arrangement`]) and, for tensor parallelism, whose
//! rank it is ([`TpShard`]).
//!
//! A [`KvLayout`] also names the codec the lower tiers store its payload
//! in ([`KvCodec`], `codec.rs`).
//!
//! A [`KvLayout`] fixes the payload size of every block of a model, and so the
//! size of its on-disk slot ([`KvLayout::encoded_bytes`], defined with the
//! block format in [`crate::block`]). It is also part of
//! the key-chain seed (see [`crate::key::KeyChain`]), so KV computed with one
//! layout or dtype can never be served to another.

use std::fmt;

use crate::codec::KvCodec;

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

/// How a block's payload is divided into regions: which bytes belong to
/// which layer, and to K or V. The store copies payloads as opaque bytes;
/// the arrangement tells a caller where a region sits, so it can save and
/// load layer by layer from its own tensors. The discriminant is the header
/// byte; it never changes for an existing variant.
///
/// In every arrangement one region of one layer and part holds
/// `kv_heads * block_tokens * head_dim` elements ([`KvLayout::region_bytes`]).
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arrangement {
    /// `[K|V][layer][kv_head][token][head_dim]`: all K regions, then all V.
    /// Addressed as (layer, K|V).
    KvMajor = 0,
    /// `[layer][K|V][kv_head][token][head_dim]`: each layer's K then its V,
    /// so a layer is contiguous (kvtier's own engine: a G1 page's order).
    /// Addressed as (layer, K|V) or (layer).
    LayerMajor = 1,
    /// `[layer][...]`: each layer one region holding K and V in the
    /// engine's own order, not split by the store. vLLM's CPU backend page
    /// (`[num_kv_heads, block_size, 2 * head_size]` per layer and block,
    /// K before V within each head) is this. Addressed as (layer).
    LayerFused = 2,
    /// `[layer][kv_head][token][head_dim]` with no K/V split: one latent
    /// region per layer (multi-head latent attention; `kv_heads` is usually
    /// 1 and `head_dim` the latent width). Addressed as (layer).
    Latent = 3,
}

impl Arrangement {
    /// Every arrangement, in discriminant order.
    pub const ALL: [Arrangement; 4] = [
        Arrangement::KvMajor,
        Arrangement::LayerMajor,
        Arrangement::LayerFused,
        Arrangement::Latent,
    ];

    /// The arrangement stored as byte `v` in a block header.
    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.get(usize::from(v)).copied()
    }

    /// Lower-case name used in configs, directory names and the Python API:
    /// `kv-major`, `layer-major`, `layer-fused`, `latent`.
    pub fn name(self) -> &'static str {
        match self {
            Arrangement::KvMajor => "kv-major",
            Arrangement::LayerMajor => "layer-major",
            Arrangement::LayerFused => "layer-fused",
            Arrangement::Latent => "latent",
        }
    }

    /// Parses a name as printed by [`Arrangement::name`] (ASCII
    /// case-insensitive; `_` is taken for `-`).
    pub fn from_name(name: &str) -> Option<Self> {
        let name = name.replace('_', "-");
        Self::ALL
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(&name))
    }

    /// Regions per layer: 2 (K and V) except [`Arrangement::Latent`] (1).
    pub fn parts(self) -> u32 {
        match self {
            Arrangement::Latent => 1,
            _ => 2,
        }
    }
}

/// One rank's share of a tensor-parallel model: its blocks hold only its
/// own KV heads (`KvLayout::kv_heads` counts the heads of one rank), and
/// the rank is part of the key seed, so ranks never read each other's
/// blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpShard {
    /// This rank, `0..world`.
    pub rank: u16,
    /// Ranks in all; at least 2 (one rank is no shard: `None`).
    pub world: u16,
}

/// Which part of a layer a region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The keys.
    K,
    /// The values.
    V,
}

/// The shape of one KV block: every layer's KV for `block_tokens` tokens,
/// as elements of `dtype`, divided into regions by `arrangement`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: u32,
    /// Key/value heads per layer (after grouped-query sharing; of one rank
    /// when sharded).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Element type (of the engine's memory: what is saved and loaded).
    pub dtype: KvDtype,
    /// How G2, G3 and G4 store the payload ([`KvCodec::None`]: as `dtype`).
    pub codec: KvCodec,
    /// Where each layer's regions sit in the payload.
    pub arrangement: Arrangement,
    /// The tensor-parallel rank these blocks belong to; `None` unsharded.
    pub shard: Option<TpShard>,
}

impl KvLayout {
    /// A [`Arrangement::KvMajor`] layout, unsharded and uncoded (the base
    /// the other constructors and struct updates start from).
    pub const fn kv_major(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_tokens: u32,
        dtype: KvDtype,
    ) -> Self {
        Self {
            layers,
            kv_heads,
            head_dim,
            block_tokens,
            dtype,
            codec: KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
        }
    }

    /// This layout with its payload stored by `codec`.
    pub const fn with_codec(self, codec: KvCodec) -> Self {
        Self { codec, ..self }
    }

    /// This layout for a block of `block_tokens` token rows: a short
    /// block, such as the partial block at the end of a prompt, stored with
    /// only the rows it holds (the tiers take any number of rows up to a
    /// layout's own: [`crate::verify::BlockSpec`]).
    pub const fn with_tokens(self, block_tokens: u32) -> Self {
        Self {
            block_tokens,
            ..self
        }
    }

    /// vLLM's CPU attention backend: per layer a tensor `[num_blocks,
    /// num_kv_heads, block_size, 2 * head_size]`, one vLLM block per kvtier
    /// block, each layer's page one opaque region ([`Arrangement::LayerFused`]).
    pub const fn vllm_cpu(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_tokens: u32,
        dtype: KvDtype,
    ) -> Self {
        Self {
            arrangement: Arrangement::LayerFused,
            ..Self::kv_major(layers, kv_heads, head_dim, block_tokens, dtype)
        }
    }

    /// Bytes of one region, one layer's K or V (or its latent, or half of a
    /// fused layer): `kv_heads * head_dim * block_tokens * dtype size`;
    /// `None` on overflow.
    pub fn checked_region_bytes(&self) -> Option<u64> {
        u64::from(self.kv_heads)
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.block_tokens))?
            .checked_mul(u64::from(self.dtype.size_bytes()))
    }

    /// Bytes of one layer: its regions together.
    fn checked_layer_bytes(&self) -> Option<u64> {
        self.checked_region_bytes()?
            .checked_mul(u64::from(self.arrangement.parts()))
    }

    /// Payload bytes of one block, or `None` if the product overflows `u64`:
    /// `parts (2, or 1 for Latent) * layers * kv_heads * head_dim *
    /// block_tokens * dtype size`.
    pub fn checked_payload_bytes(&self) -> Option<u64> {
        self.checked_layer_bytes()?
            .checked_mul(u64::from(self.layers))
    }

    /// Bytes of one region ([`checked_region_bytes`](Self::checked_region_bytes));
    /// saturates at `u64::MAX` (such a layout fails [`KvLayout::validate`]).
    pub fn region_bytes(&self) -> u64 {
        self.checked_region_bytes().unwrap_or(u64::MAX)
    }

    /// Where layer `layer`'s `part` sits in the payload (byte range), for
    /// the arrangements that split K and V (KvMajor, LayerMajor); `None`
    /// otherwise or past the last layer. For a valid layout only.
    pub fn part_range(&self, layer: u32, part: Part) -> Option<std::ops::Range<u64>> {
        if layer >= self.layers {
            return None;
        }
        let r = self.region_bytes();
        let (l, p) = (u64::from(layer), u64::from(part == Part::V));
        let index = match self.arrangement {
            Arrangement::KvMajor => p * u64::from(self.layers) + l,
            Arrangement::LayerMajor => 2 * l + p,
            Arrangement::LayerFused | Arrangement::Latent => return None,
        };
        Some(index * r..(index + 1) * r)
    }

    /// Bytes of one layer of one block: its regions together (for a valid
    /// layout).
    pub fn layer_bytes(&self) -> u64 {
        self.checked_layer_bytes().unwrap_or(u64::MAX)
    }

    /// The byte ranges of a block's regions in payload order: per layer
    /// where a layer is contiguous (layer-major, layer-fused, latent), per
    /// layer and part, all K then all V, for kv-major. For a valid layout.
    pub fn regions(&self) -> Vec<std::ops::Range<u64>> {
        match self.arrangement {
            Arrangement::KvMajor => [Part::K, Part::V]
                .into_iter()
                .flat_map(|p| (0..self.layers).filter_map(move |l| self.part_range(l, p)))
                .collect(),
            _ => (0..self.layers)
                .filter_map(|l| self.layer_range(l))
                .collect(),
        }
    }

    /// Where all of layer `layer` sits in the payload (byte range), for the
    /// arrangements that keep a layer contiguous (LayerMajor, LayerFused,
    /// Latent); `None` for KvMajor or past the last layer. For a valid
    /// layout only.
    pub fn layer_range(&self, layer: u32) -> Option<std::ops::Range<u64>> {
        if layer >= self.layers || self.arrangement == Arrangement::KvMajor {
            return None;
        }
        let n = self.layer_bytes();
        let l = u64::from(layer);
        Some(l * n..(l + 1) * n)
    }

    /// Payload bytes of one block
    /// ([`checked_payload_bytes`](Self::checked_payload_bytes)).
    ///
    /// Saturates at `u64::MAX` on overflow (such a layout fails
    /// [`KvLayout::validate`]).
    pub fn payload_bytes(&self) -> u64 {
        self.checked_payload_bytes().unwrap_or(u64::MAX)
    }

    /// Checks that every dimension is at least 1, that a shard's rank is
    /// below its world of at least 2, that the codec can store the dtype,
    /// and that the payload fits in [`MAX_PAYLOAD_BYTES`] without overflow.
    pub fn validate(&self) -> Result<(), LayoutError> {
        if !self.codec.supports(self.dtype) {
            return Err(LayoutError(format!(
                "the {} codec cannot store {} KV",
                self.codec, self.dtype
            )));
        }
        if let Some(TpShard { rank, world }) = self.shard
            && (world < 2 || rank >= world)
        {
            return Err(LayoutError(format!(
                "tensor-parallel rank {rank} of {world}: need world >= 2 and rank < world"
            )));
        }
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
            Some(n) if n.max(self.stored_payload_bytes()) > MAX_PAYLOAD_BYTES => {
                Err(LayoutError(format!(
                    "payload of {n} bytes for {self} exceeds the {MAX_PAYLOAD_BYTES}-byte limit"
                )))
            }
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
        )?;
        if self.codec != KvCodec::None {
            write!(f, " as {}", self.codec)?;
        }
        if self.arrangement != Arrangement::KvMajor {
            write!(f, ", {}", self.arrangement.name())?;
        }
        if let Some(s) = self.shard {
            write!(f, ", rank {} of {}", s.rank, s.world)?;
        }
        Ok(())
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
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
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
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
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
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
        };
        assert_eq!(exact.encoded_bytes(), 4096);
        let over = KvLayout {
            block_tokens: exact.block_tokens + 1,
            ..exact
        };
        assert_eq!(over.encoded_bytes(), 8192);
    }

    #[test]
    fn regions_tile_the_payload_in_every_arrangement() {
        let base = KvLayout::kv_major(3, 2, 8, 4, KvDtype::Bf16);
        let r = base.region_bytes();
        assert_eq!(r, 2 * 8 * 4 * 2);
        for a in Arrangement::ALL {
            assert_eq!(Arrangement::from_u8(a as u8), Some(a));
            assert_eq!(Arrangement::from_name(a.name()), Some(a));
            assert_eq!(
                Arrangement::from_name(&a.name().replace('-', "_").to_uppercase()),
                Some(a)
            );
            let l = KvLayout {
                arrangement: a,
                ..base
            };
            assert_eq!(l.payload_bytes(), r * 3 * u64::from(a.parts()));
            // The addressable regions cover every payload byte exactly once.
            let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
            for layer in 0..3 {
                match (
                    l.layer_range(layer),
                    l.part_range(layer, Part::K),
                    l.part_range(layer, Part::V),
                ) {
                    (_, Some(k), Some(v)) => {
                        assert_eq!(k.end - k.start, r);
                        ranges.extend([k, v]);
                    }
                    (Some(whole), None, None) => ranges.push(whole),
                    other => panic!("{a:?} layer {layer}: {other:?}"),
                }
                if let (Some(whole), Some(k), Some(v)) = (
                    l.layer_range(layer),
                    l.part_range(layer, Part::K),
                    l.part_range(layer, Part::V),
                ) {
                    assert_eq!((whole.start, whole.end), (k.start, v.end));
                }
            }
            ranges.sort_by_key(|r| r.start);
            let mut at = 0;
            for range in ranges {
                assert_eq!(range.start, at, "{a:?}");
                at = range.end;
            }
            assert_eq!(at, l.payload_bytes(), "{a:?}");
            assert_eq!(l.layer_range(3), None);
            assert_eq!(l.part_range(3, Part::K), None);
        }
        assert_eq!(Arrangement::from_u8(4), None);
        assert_eq!(Arrangement::from_name("planar"), None);
        // KvMajor: all K first, then all V.
        assert_eq!(base.part_range(1, Part::K), Some(r..2 * r));
        assert_eq!(base.part_range(0, Part::V), Some(3 * r..4 * r));
        // LayerMajor: each layer's K then V.
        let lm = KvLayout {
            arrangement: Arrangement::LayerMajor,
            ..base
        };
        assert_eq!(lm.part_range(1, Part::V), Some(3 * r..4 * r));
        // vLLM's CPU page: one region per layer, of kv_heads x block x 2 x head bytes.
        let v = KvLayout::vllm_cpu(2, 2, 64, 128, KvDtype::F32);
        assert_eq!(
            v.layer_range(1),
            Some(2 * 128 * 2 * 64 * 4..2 * 2 * 128 * 2 * 64 * 4)
        );
        assert_eq!(v.part_range(0, Part::K), None);
    }

    #[test]
    fn shards_must_name_a_rank_below_a_world_of_two_or_more() {
        let l = small();
        for (rank, world, ok) in [
            (0, 2, true),
            (1, 2, true),
            (7, 8, true),
            (2, 2, false),
            (0, 1, false),
            (0, 0, false),
        ] {
            let s = KvLayout {
                shard: Some(TpShard { rank, world }),
                ..l
            };
            assert_eq!(s.validate().is_ok(), ok, "rank {rank} of {world}");
        }
        let s = KvLayout {
            shard: Some(TpShard { rank: 1, world: 4 }),
            arrangement: Arrangement::Latent,
            ..l
        };
        assert_eq!(
            s.to_string(),
            "2 layers x 2 kv heads x 8 head dim x 4 tokens, f32, latent, rank 1 of 4"
        );
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
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
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
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
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
