//! The KV layout the store bench uses for a given block (slot) size.
//!
//! A G3 slot holds one encoded block: a 128-byte header, the payload, and
//! zero padding up to a multiple of 4 KiB. The bench wants the slot to be
//! exactly the block size asked for, so it picks a layout whose payload is
//! `block_bytes - 4096` bytes: with the header that rounds up to exactly
//! `block_bytes`.
//!
//! The shape is one layer of a Llama-3-8B-like model: 8 KV heads of 128
//! dimensions in bf16, i.e. `2 (K and V) * 8 * 128 * 2 bytes = 4096` bytes
//! per token, and `block_bytes / 4096 - 1` tokens per block (511 tokens for
//! a 2 MiB block, 63 for 256 KiB, 4095 for 16 MiB). The smallest block is
//! therefore 8 KiB (one token); the largest 1 GiB.

use kvtier_io::DIRECT_IO_ALIGN;
use kvtier_store::{Arrangement, KvDtype, KvLayout};

/// Smallest block the bench accepts (one token of the bench layout).
pub const MIN_BLOCK_BYTES: u64 = 8 << 10;
/// Largest block the bench accepts (the store caps payloads at 1 GiB).
pub const MAX_BLOCK_BYTES: u64 = 1 << 30;
/// Payload bytes per token of the bench layout.
pub const BYTES_PER_TOKEN: u64 = 2 * 8 * 128 * 2;

/// Checks that `block_bytes` can be a bench block: a multiple of 4 KiB,
/// between [`MIN_BLOCK_BYTES`] and [`MAX_BLOCK_BYTES`].
pub fn check_block_bytes(block_bytes: u64) -> Result<(), String> {
    let align = DIRECT_IO_ALIGN as u64;
    if !block_bytes.is_multiple_of(align) {
        return Err(format!(
            "block size {block_bytes} bytes is not a multiple of {align} (4 KiB)"
        ));
    }
    if block_bytes < MIN_BLOCK_BYTES {
        return Err(format!(
            "block size {block_bytes} bytes is below the minimum of {MIN_BLOCK_BYTES} (8 KiB)"
        ));
    }
    if block_bytes > MAX_BLOCK_BYTES {
        return Err(format!(
            "block size {block_bytes} bytes is above the maximum of {MAX_BLOCK_BYTES} (1 GiB)"
        ));
    }
    Ok(())
}

/// The bench layout of `tokens` tokens per block: one layer, 8 KV heads of
/// 128 in bf16, [`BYTES_PER_TOKEN`] per token.
pub fn bench_layout(tokens: u64) -> Result<KvLayout, String> {
    let layout = KvLayout {
        layers: 1,
        kv_heads: 8,
        head_dim: 128,
        block_tokens: u32::try_from(tokens)
            .map_err(|_| format!("{tokens} tokens per block is too many"))?,
        dtype: KvDtype::Bf16,
        codec: kvtier_store::KvCodec::None,
        arrangement: Arrangement::KvMajor,
        shard: None,
    };
    layout.validate().map_err(|e| e.to_string())?;
    Ok(layout)
}

/// The bench layout whose encoded block (slot) is exactly `block_bytes`.
pub fn layout_for_block_bytes(block_bytes: u64) -> Result<KvLayout, String> {
    check_block_bytes(block_bytes)?;
    let layout = bench_layout((block_bytes - DIRECT_IO_ALIGN as u64) / BYTES_PER_TOKEN)?;
    if layout.encoded_bytes() != block_bytes {
        return Err(format!(
            "internal error: layout {layout} encodes to {} bytes, not {block_bytes}",
            layout.encoded_bytes()
        ));
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typical_sizes_fill_the_slot_exactly() {
        for (bytes, tokens) in [
            (8u64 << 10, 1u32),
            (256 << 10, 63),
            (2 << 20, 511),
            (16 << 20, 4095),
            (1 << 30, (1 << 18) - 1),
        ] {
            let l = layout_for_block_bytes(bytes).unwrap();
            assert_eq!(l.block_tokens, tokens, "{bytes}");
            assert_eq!(l.encoded_bytes(), bytes);
            assert_eq!(l.payload_bytes(), bytes - 4096);
            assert_eq!(
                (l.layers, l.kv_heads, l.head_dim, l.dtype),
                (1, 8, 128, KvDtype::Bf16)
            );
        }
    }

    #[test]
    fn every_multiple_of_4k_in_range_works() {
        for pages in 2..=1024u64 {
            let bytes = pages * 4096;
            assert_eq!(
                layout_for_block_bytes(bytes).unwrap().encoded_bytes(),
                bytes
            );
        }
    }

    #[test]
    fn rejects_unaligned_small_and_huge() {
        for bad in [
            0u64,
            1000,
            4096,
            4097,
            8191,
            8193,
            (2 << 20) + 512,
            (1 << 30) + 4096,
        ] {
            assert!(layout_for_block_bytes(bad).is_err(), "{bad}");
        }
        assert!(
            check_block_bytes(1000)
                .unwrap_err()
                .contains("multiple of 4096")
        );
        assert!(check_block_bytes(4096).unwrap_err().contains("minimum"));
        assert!(check_block_bytes(2 << 30).unwrap_err().contains("maximum"));
    }
}
