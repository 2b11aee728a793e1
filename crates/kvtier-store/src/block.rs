//! The on-media block format shared by G2, G3 and G4.
//!
//! An encoded block is a fixed 128-byte little-endian header, the payload,
//! and zero padding up to a multiple of [`DIRECT_IO_ALIGN`]:
//!
//! | bytes    | field                                             |
//! |----------|---------------------------------------------------|
//! | 0..4     | magic `b"KVTB"`                                   |
//! | 4..6     | format version, `u16` (= [`FORMAT_VERSION`])      |
//! | 6        | dtype ([`KvDtype`] discriminant)                  |
//! | 7        | codec ([`KvCodec`] discriminant)                  |
//! | 8..24    | block key                                         |
//! | 24..40   | model fingerprint                                 |
//! | 40..44   | layers, `u32`                                     |
//! | 44..48   | kv heads, `u32`                                   |
//! | 48..52   | head dim, `u32`                                   |
//! | 52..56   | tokens in the block, `u32`                        |
//! | 56..64   | payload length, `u64`                             |
//! | 64..72   | generation, `u64` (writer-assigned sequence)      |
//! | 72..76   | CRC32C of the payload                             |
//! | 76       | v2: arrangement ([`Arrangement`]); v1: zero       |
//! | 77       | reserved, zero                                    |
//! | 78..80   | v2: tensor-parallel rank, `u16`; v1: zero         |
//! | 80..82   | v2: tensor-parallel world, `u16` (0: unsharded)   |
//! | 82..124  | reserved, zero                                    |
//! | 124..128 | CRC32C of bytes 0..124                            |
//!
//! A block that fails any check is a miss: callers delete it and never serve
//! it. docs/block-format.md is the full specification.

use std::sync::Arc;

use kvtier_io::buffer::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator};

use crate::codec::{CodecError, KvCodec};
use crate::key::{BlockKey, ModelFingerprint};
use crate::kv_layout::{Arrangement, KvDtype, KvLayout, LayoutError, TpShard};

/// The four bytes every encoded block starts with.
pub const MAGIC: [u8; 4] = *b"KVTB";
/// The newest format version, written for blocks that need it (an
/// arrangement other than KV-major, or a shard). Blocks without either are
/// written as version 1, byte for byte as before; both versions are read.
pub const FORMAT_VERSION: u16 = 2;
/// The oldest format version read.
pub const MIN_FORMAT_VERSION: u16 = 1;
/// Size of the fixed header that precedes the payload.
pub const HEADER_BYTES: usize = 128;
/// Byte range of the reserved header area, zero in every version (in
/// version 1, bytes 76..82 must be zero too).
pub const RESERVED_RANGE: std::ops::Range<usize> = 82..124;
/// Bytes version 2 assigned (arrangement, a reserved byte, the shard).
const V2_RANGE: std::ops::Range<usize> = 76..82;
/// Byte range covered by the header checksum.
pub const HEADER_CRC_COVERS: std::ops::Range<usize> = 0..124;

/// `HEADER_BYTES + payload`, rounded up to [`DIRECT_IO_ALIGN`]; saturates at
/// `u64::MAX`.
pub(crate) fn slot_bytes(payload: u64) -> u64 {
    let align = DIRECT_IO_ALIGN as u64;
    (HEADER_BYTES as u64)
        .checked_add(payload)
        .and_then(|n| n.checked_add(align - 1))
        .map_or(u64::MAX, |n| n & !(align - 1))
}

impl KvLayout {
    /// Bytes one encoded block occupies on disk (its slot size): header plus
    /// stored payload ([`KvLayout::stored_payload_bytes`]), rounded up to [`DIRECT_IO_ALIGN`].
    ///
    /// Saturates at `u64::MAX` for layouts that fail [`KvLayout::validate`].
    pub fn encoded_bytes(&self) -> u64 {
        slot_bytes(self.stored_payload_bytes())
    }
}

/// Why a block could not be encoded or was rejected on read. Every decode
/// error means "miss": the block is not served.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum BlockError {
    /// The buffer ends before the header or payload does.
    #[error("block truncated: need {needed} bytes, got {got}")]
    TooShort {
        /// Bytes required.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// The first four bytes are not `KVTB`.
    #[error("not a kvtier block (bad magic)")]
    BadMagic,
    /// A format version this reader does not understand.
    #[error(
        "unsupported block format version {0} (this reader supports {MIN_FORMAT_VERSION} to {FORMAT_VERSION})"
    )]
    UnsupportedVersion(u16),
    /// The dtype byte names no known [`KvDtype`].
    #[error("unknown KV dtype byte {0}")]
    UnknownDtype(u8),
    /// The arrangement byte names no known [`Arrangement`].
    #[error("unknown KV arrangement byte {0}")]
    UnknownArrangement(u8),
    /// The codec byte names no known [`KvCodec`] (a block from a newer
    /// kvtier): a miss like any other.
    #[error("unknown KV codec byte {0}")]
    UnknownCodec(u8),
    /// The payload could not be coded (fp8/int8 and a NaN or Inf value).
    #[error("{0}")]
    Codec(#[from] CodecError),
    /// Reserved header bytes are not zero.
    #[error("reserved header bytes are not zero")]
    ReservedNotZero,
    /// The header checksum does not match: the header is corrupt.
    #[error("block header checksum mismatch")]
    HeaderChecksum,
    /// The payload checksum does not match: the payload is corrupt.
    #[error("block payload checksum mismatch")]
    PayloadChecksum,
    /// The payload length disagrees with the layout.
    #[error("payload length {header} does not match the layout's {layout} bytes")]
    PayloadLength {
        /// Length stated by the header (or, on encode, of the given payload).
        header: u64,
        /// Length the layout implies.
        layout: u64,
    },
    /// The block is intact but holds another key than the one asked for.
    #[error("block key mismatch: expected {expected}, found {found}")]
    KeyMismatch {
        /// Key asked for.
        expected: BlockKey,
        /// Key in the header.
        found: BlockKey,
    },
    /// The layout is invalid (zero dimension, overflow, payload over 1 GiB).
    #[error("bad KV layout: {0}")]
    BadLayout(String),
    /// The block is intact but its header names another layout than the
    /// reader's.
    #[error("block has layout {found}, expected {expected}")]
    LayoutMismatch {
        /// The reader's layout.
        expected: KvLayout,
        /// The header's.
        found: KvLayout,
    },
    /// The block is intact but was computed by another model.
    #[error("block belongs to another model (fingerprint {found}, expected {expected})")]
    FingerprintMismatch {
        /// The reader's model.
        expected: ModelFingerprint,
        /// The header's.
        found: ModelFingerprint,
    },
    /// The output buffer could not be allocated.
    #[error("block buffer allocation failed: {0}")]
    Alloc(String),
    /// The block is intact but holds another number of token rows than the
    /// read asked for: a short block (a prompt's tail) never stands in for
    /// a whole one, nor a whole one for a short one.
    #[error("holds {held} token rows where {asked} were asked for")]
    WrongRows {
        /// Rows the block holds.
        held: u32,
        /// Rows the read asked for.
        asked: u32,
    },
}

impl BlockError {
    /// A stable snake-case name of the variant: the `cause` the Python API
    /// reports for a refused block.
    pub fn code(&self) -> &'static str {
        match self {
            BlockError::TooShort { .. } => "too_short",
            BlockError::BadMagic => "bad_magic",
            BlockError::UnsupportedVersion(_) => "unsupported_version",
            BlockError::UnknownDtype(_) => "unknown_dtype",
            BlockError::UnknownArrangement(_) => "unknown_arrangement",
            BlockError::UnknownCodec(_) => "unknown_codec",
            BlockError::Codec(_) => "codec",
            BlockError::ReservedNotZero => "reserved_not_zero",
            BlockError::HeaderChecksum => "header_checksum",
            BlockError::PayloadChecksum => "payload_checksum",
            BlockError::PayloadLength { .. } => "payload_length",
            BlockError::KeyMismatch { .. } => "key_mismatch",
            BlockError::BadLayout(_) => "bad_layout",
            BlockError::LayoutMismatch { .. } => "layout_mismatch",
            BlockError::FingerprintMismatch { .. } => "fingerprint_mismatch",
            BlockError::Alloc(_) => "alloc",
            BlockError::WrongRows { .. } => "wrong_rows",
        }
    }
}

impl From<LayoutError> for BlockError {
    fn from(e: LayoutError) -> Self {
        BlockError::BadLayout(e.0)
    }
}

/// The decoded fixed header of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    /// Key of the block.
    pub key: BlockKey,
    /// Model the KV came from.
    pub fingerprint: ModelFingerprint,
    /// Shape, dtype and codec of the payload (`block_tokens` = tokens in
    /// the block).
    pub layout: KvLayout,
    /// Payload bytes following the header.
    pub payload_len: u64,
    /// Writer-assigned sequence number: G3 keeps the highest generation of a
    /// key when it rebuilds its index after a crash; 0 where unused.
    pub generation: u64,
    /// CRC32C of the payload.
    pub payload_crc32c: u32,
}

fn le_u16(b: &[u8; HEADER_BYTES], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le_u32(b: &[u8; HEADER_BYTES], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le_u64(b: &[u8; HEADER_BYTES], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

fn bytes16(b: &[u8; HEADER_BYTES], at: usize) -> [u8; 16] {
    let mut v = [0u8; 16];
    v.copy_from_slice(&b[at..at + 16]);
    v
}

impl BlockHeader {
    /// The 128 header bytes, header checksum included.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        let v2 = self.layout.arrangement != Arrangement::KvMajor || self.layout.shard.is_some();
        let version: u16 = if v2 { 2 } else { 1 };
        b[4..6].copy_from_slice(&version.to_le_bytes());
        b[6] = self.layout.dtype as u8;
        b[7] = self.layout.codec as u8;
        b[8..24].copy_from_slice(&self.key.0);
        b[24..40].copy_from_slice(&self.fingerprint.0);
        b[40..44].copy_from_slice(&self.layout.layers.to_le_bytes());
        b[44..48].copy_from_slice(&self.layout.kv_heads.to_le_bytes());
        b[48..52].copy_from_slice(&self.layout.head_dim.to_le_bytes());
        b[52..56].copy_from_slice(&self.layout.block_tokens.to_le_bytes());
        b[56..64].copy_from_slice(&self.payload_len.to_le_bytes());
        b[64..72].copy_from_slice(&self.generation.to_le_bytes());
        b[72..76].copy_from_slice(&self.payload_crc32c.to_le_bytes());
        b[76] = self.layout.arrangement as u8;
        // 77 reserved: already zero.
        if let Some(shard) = self.layout.shard {
            b[78..80].copy_from_slice(&shard.rank.to_le_bytes());
            b[80..82].copy_from_slice(&shard.world.to_le_bytes());
        }
        // 82..124 reserved: already zero.
        let crc = crc32c::crc32c(&b[HEADER_CRC_COVERS]);
        b[124..128].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses and validates the header at the start of `bytes` (extra bytes
    /// after the first 128 are ignored).
    ///
    /// Checks, in order: length, magic, version, dtype, codec,
    /// arrangement, reserved bytes zero (and no rank without a world), header checksum, [`KvLayout::validate`], and
    /// `payload_len == layout.stored_payload_bytes()`. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<BlockHeader, BlockError> {
        let b: &[u8; HEADER_BYTES] = bytes
            .get(..HEADER_BYTES)
            .and_then(|h| h.try_into().ok())
            .ok_or(BlockError::TooShort {
                needed: HEADER_BYTES,
                got: bytes.len(),
            })?;
        if b[0..4] != MAGIC {
            return Err(BlockError::BadMagic);
        }
        let version = le_u16(b, 4);
        if !(MIN_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(BlockError::UnsupportedVersion(version));
        }
        let dtype = KvDtype::from_u8(b[6]).ok_or(BlockError::UnknownDtype(b[6]))?;
        let codec = KvCodec::from_u8(b[7]).ok_or(BlockError::UnknownCodec(b[7]))?;
        let arrangement =
            Arrangement::from_u8(b[76]).ok_or(BlockError::UnknownArrangement(b[76]))?;
        let v1_extended = version == 1 && b[V2_RANGE].iter().any(|&x| x != 0);
        if v1_extended || b[77] != 0 || b[RESERVED_RANGE].iter().any(|&x| x != 0) {
            return Err(BlockError::ReservedNotZero);
        }
        if crc32c::crc32c(&b[HEADER_CRC_COVERS]) != le_u32(b, 124) {
            return Err(BlockError::HeaderChecksum);
        }
        let world = le_u16(b, 80);
        let rank = le_u16(b, 78);
        let shard = match world {
            0 if rank == 0 => None,
            0 => return Err(BlockError::ReservedNotZero),
            _ => Some(TpShard { rank, world }),
        };
        let layout = KvLayout {
            layers: le_u32(b, 40),
            kv_heads: le_u32(b, 44),
            head_dim: le_u32(b, 48),
            block_tokens: le_u32(b, 52),
            dtype,
            codec,
            arrangement,
            shard,
        };
        layout.validate()?;
        let payload_len = le_u64(b, 56);
        let expected = layout.stored_payload_bytes();
        if payload_len != expected {
            return Err(BlockError::PayloadLength {
                header: payload_len,
                layout: expected,
            });
        }
        Ok(BlockHeader {
            key: BlockKey(bytes16(b, 8)),
            fingerprint: ModelFingerprint(bytes16(b, 24)),
            layout,
            payload_len,
            generation: le_u64(b, 64),
            payload_crc32c: le_u32(b, 72),
        })
    }

    /// Bytes the whole encoded block occupies: `HEADER_BYTES + payload_len`
    /// rounded up to [`DIRECT_IO_ALIGN`] (saturates at `usize::MAX` for
    /// lengths no valid header has).
    pub fn encoded_len(&self) -> usize {
        usize::try_from(slot_bytes(self.payload_len)).unwrap_or(usize::MAX)
    }
}

/// A block being encoded in place: one slot-sized buffer from the store's
/// allocator whose payload the producer writes straight into
/// ([`payload_mut`](Self::payload_mut)), then [`seal`](Self::seal)s with the
/// header and the payload checksum. Filling it saves the copy that encoding
/// a separately held payload ([`encode_block`]) costs: the engine exports a
/// G1 page directly into one.
///
/// The payload is the *stored* form ([`KvLayout::stored_payload_bytes`]):
/// with a codec, the producer codes into it
/// ([`KvLayout::encode_into`], region by region from its own memory);
/// without one it is the engine's bytes as they are.
///
/// The buffer may be recycled memory holding an older block's bytes: the
/// producer must write every payload byte before sealing (the padding after
/// the payload is zeroed here, since it reaches disk).
pub struct BlockBuf {
    buf: AlignedBuf,
    layout: KvLayout,
}

impl std::fmt::Debug for BlockBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockBuf")
            .field("layout", &self.layout)
            .field("bytes", &self.buf.len())
            .finish()
    }
}

impl BlockBuf {
    /// A buffer for one block of `layout` from `alloc`.
    pub fn new(layout: KvLayout, alloc: &Arc<dyn HostAllocator>) -> Result<Self, BlockError> {
        Self::in_slot_of(layout, layout, alloc)
    }

    /// A buffer of a slot of `slot`'s layout holding a block of `layout`
    /// (`slot`'s, or a short block of it), padding zeroed.
    fn in_slot_of(
        slot: KvLayout,
        layout: KvLayout,
        alloc: &Arc<dyn HostAllocator>,
    ) -> Result<Self, BlockError> {
        slot.validate()?;
        let len = usize::try_from(slot.encoded_bytes())
            .map_err(|_| BlockError::Alloc(format!("a block of {slot} does not fit memory")))?;
        let mut buf = AlignedBuf::for_overwrite_in(alloc, len, DIRECT_IO_ALIGN)
            .map_err(|e| BlockError::Alloc(e.to_string()))?;
        if buf.len() != len {
            return Err(BlockError::Alloc(format!(
                "allocator returned {} bytes, wanted {len}",
                buf.len()
            )));
        }
        let end = HEADER_BYTES + layout.stored_payload_bytes() as usize;
        buf[end..].fill(0);
        Ok(Self { buf, layout })
    }

    /// A buffer for a short block of `rows` token rows (1 up to `layout`'s
    /// `block_tokens`: a prompt's partial last block) of `layout`'s slot
    /// size, so every tier holds and moves it as it does any block; its
    /// payload and its header are those of `rows` rows
    /// ([`KvLayout::with_tokens`]).
    pub fn new_short(
        layout: KvLayout,
        rows: u32,
        alloc: &Arc<dyn HostAllocator>,
    ) -> Result<Self, BlockError> {
        if rows == 0 || rows > layout.block_tokens {
            return Err(BlockError::BadLayout(format!(
                "a short block of {rows} rows in blocks of {} tokens",
                layout.block_tokens
            )));
        }
        Self::in_slot_of(layout, layout.with_tokens(rows), alloc)
    }

    /// The layout the payload has.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The stored payload, to be written in full by the producer.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let end = HEADER_BYTES + self.layout.stored_payload_bytes() as usize;
        &mut self.buf[HEADER_BYTES..end]
    }

    /// Writes the header (with the payload's checksum) and returns the
    /// encoded block: [`BlockHeader::encoded_len`] bytes, aligned to
    /// [`DIRECT_IO_ALIGN`].
    pub fn seal(
        mut self,
        key: BlockKey,
        fingerprint: ModelFingerprint,
        generation: u64,
    ) -> AlignedBuf {
        let payload_len = self.layout.stored_payload_bytes();
        let header = BlockHeader {
            key,
            fingerprint,
            layout: self.layout,
            payload_len,
            generation,
            payload_crc32c: crc32c::crc32c(self.payload_mut()),
        };
        self.buf[..HEADER_BYTES].copy_from_slice(&header.encode());
        self.buf
    }
}

/// Encodes header and payload (the engine's bytes, coded here by the
/// layout's codec) into one zero-padded [`AlignedBuf`] from `alloc`, of
/// length [`BlockHeader::encoded_len`] (a multiple of [`DIRECT_IO_ALIGN`],
/// aligned to it), computing the payload checksum.
///
/// Fails if the layout is invalid, `payload.len() != layout.payload_bytes()`,
/// the codec refuses a value ([`CodecError::NotFinite`]) or allocation
/// fails.
pub fn encode_block(
    key: BlockKey,
    fingerprint: ModelFingerprint,
    layout: KvLayout,
    generation: u64,
    payload: &[u8],
    alloc: &Arc<dyn HostAllocator>,
) -> Result<AlignedBuf, BlockError> {
    layout.validate()?;
    let expected = layout.payload_bytes();
    if payload.len() as u64 != expected {
        return Err(BlockError::PayloadLength {
            header: payload.len() as u64,
            layout: expected,
        });
    }
    let mut block = BlockBuf::new(layout, alloc)?;
    layout.encode_into(0, payload, block.payload_mut())?;
    Ok(block.seal(key, fingerprint, generation))
}

/// Decodes and fully verifies an encoded block: every header check of
/// [`BlockHeader::decode`], the buffer holds the whole payload, the key equals
/// `expect_key` when given, and the payload checksum. Returns the header and
/// the payload (padding after it is ignored). Never panics.
pub fn decode_block<'a>(
    bytes: &'a [u8],
    expect_key: Option<&BlockKey>,
) -> Result<(BlockHeader, &'a [u8]), BlockError> {
    decode_block_summed(bytes, expect_key, None)
}

/// [`decode_block`], with the payload's CRC32C already computed by the
/// caller (`payload_crc`, e.g. summed part by part as a read landed) in
/// place of a pass over the payload here; `None` computes it.
pub fn decode_block_summed<'a>(
    bytes: &'a [u8],
    expect_key: Option<&BlockKey>,
    payload_crc: Option<u32>,
) -> Result<(BlockHeader, &'a [u8]), BlockError> {
    let header = BlockHeader::decode(bytes)?;
    // payload_len <= MAX_PAYLOAD_BYTES (1 GiB) after decode, so this fits.
    let payload_len = usize::try_from(header.payload_len).map_err(|_| BlockError::TooShort {
        needed: usize::MAX,
        got: bytes.len(),
    })?;
    let needed = HEADER_BYTES.saturating_add(payload_len);
    let payload = bytes
        .get(HEADER_BYTES..needed)
        .ok_or(BlockError::TooShort {
            needed,
            got: bytes.len(),
        })?;
    if let Some(expected) = expect_key
        && *expected != header.key
    {
        return Err(BlockError::KeyMismatch {
            expected: *expected,
            found: header.key,
        });
    }
    if payload_crc.unwrap_or_else(|| crc32c::crc32c(payload)) != header.payload_crc32c {
        return Err(BlockError::PayloadChecksum);
    }
    Ok((header, payload))
}

#[cfg(test)]
mod tests;
