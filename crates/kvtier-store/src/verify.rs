//! The one check every block passes before any tier serves it: both
//! checksums and the header's own rules
//! ([`decode_block`](crate::block::decode_block)), the key asked for, the
//! reader's layout and, where the reader knows it, its model.
//!
//! G3 runs it as each read completes, G4 where each value lands; a block
//! that fails is a miss, deleted from its tier, never served. G2 holds only
//! blocks that were encoded here or passed this check on their way in.

use crate::block::{BlockError, BlockHeader, decode_block_summed};
use crate::key::{BlockKey, ModelFingerprint};
use crate::kv_layout::KvLayout;

/// What a reader expects of the blocks it reads: the layout, or the same
/// layout with fewer token rows (a short block, [`KvLayout::with_tokens`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpec {
    /// The layout every block must have.
    pub layout: KvLayout,
    /// The model every block must come from; `None` accepts any model
    /// (a G3 shared by several models of one layout: keys are seeded by the
    /// fingerprint, so another model's block never has the key asked for).
    pub fingerprint: Option<ModelFingerprint>,
}

impl BlockSpec {
    /// True for a block of `layout`: this spec's, or a short block of it
    /// (fewer token rows, [`KvLayout::with_tokens`]: a prompt's tail). The
    /// reader who asked for a block checks its rows (`TieredStore`'s reads
    /// do), so a short block never stands in for a whole one.
    pub fn takes(&self, layout: &KvLayout) -> bool {
        layout.block_tokens <= self.layout.block_tokens
            && layout.with_tokens(self.layout.block_tokens) == self.layout
    }

    /// Checks `bytes` (an encoded block, padding allowed) as the block
    /// stored under `key`; returns its header.
    pub fn verify(&self, bytes: &[u8], key: &BlockKey) -> Result<BlockHeader, BlockError> {
        self.verify_summed(bytes, key, None)
    }

    /// [`verify`](Self::verify), with the payload's CRC32C already summed
    /// by the caller (`None`: summed here).
    pub fn verify_summed(
        &self,
        bytes: &[u8],
        key: &BlockKey,
        payload_crc: Option<u32>,
    ) -> Result<BlockHeader, BlockError> {
        let (header, _) = decode_block_summed(bytes, Some(key), payload_crc)?;
        if !self.takes(&header.layout) {
            return Err(BlockError::LayoutMismatch {
                expected: self.layout,
                found: header.layout,
            });
        }
        if let Some(fp) = self.fingerprint
            && header.fingerprint != fp
        {
            return Err(BlockError::FingerprintMismatch {
                expected: fp,
                found: header.fingerprint,
            });
        }
        Ok(header)
    }
}

#[cfg(test)]
mod tests {
    use kvtier_io::system_allocator;

    use super::*;
    use crate::block::encode_block;
    use crate::kv_layout::{Arrangement, KvDtype};

    fn layout() -> KvLayout {
        KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 8,
            block_tokens: 4,
            dtype: KvDtype::F32,
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
        }
    }

    #[test]
    fn key_layout_model_and_checksums_are_each_checked() {
        let fp = ModelFingerprint::of_bytes(b"m");
        let key = BlockKey([7; 16]);
        let payload = vec![3u8; layout().payload_bytes() as usize];
        let block = encode_block(key, fp, layout(), 0, &payload, &system_allocator()).unwrap();
        let spec = BlockSpec {
            layout: layout(),
            fingerprint: Some(fp),
        };
        assert_eq!(spec.verify(&block, &key).unwrap().key, key);
        assert!(matches!(
            spec.verify(&block, &BlockKey([8; 16])),
            Err(BlockError::KeyMismatch { .. })
        ));
        let other_model = BlockSpec {
            fingerprint: Some(ModelFingerprint::of_bytes(b"n")),
            ..spec
        };
        assert!(matches!(
            other_model.verify(&block, &key),
            Err(BlockError::FingerprintMismatch { .. })
        ));
        let any_model = BlockSpec {
            fingerprint: None,
            ..spec
        };
        assert!(any_model.verify(&block, &key).is_ok());
        let other_layout = BlockSpec {
            layout: KvLayout {
                head_dim: 4,
                block_tokens: 8,
                ..layout()
            },
            ..spec
        };
        assert!(matches!(
            other_layout.verify(&block, &key),
            Err(BlockError::LayoutMismatch { .. })
        ));
        let mut flipped = block.to_vec();
        flipped[200] ^= 1;
        assert_eq!(
            spec.verify(&flipped, &key).unwrap_err(),
            BlockError::PayloadChecksum
        );
        assert!(matches!(
            spec.verify(&block[..150], &key),
            Err(BlockError::TooShort { .. })
        ));
    }

    #[test]
    fn a_short_block_of_the_layout_passes_and_nothing_longer_or_else() {
        let fp = ModelFingerprint::of_bytes(b"m");
        let key = BlockKey([7; 16]);
        let spec = BlockSpec {
            layout: layout(),
            fingerprint: Some(fp),
        };
        let encoded = |l: KvLayout| {
            let payload = vec![5u8; l.payload_bytes() as usize];
            encode_block(key, fp, l, 0, &payload, &system_allocator()).unwrap()
        };
        for rows in 1..=4 {
            let header = spec.verify(&encoded(layout().with_tokens(rows)), &key);
            assert_eq!(header.unwrap().layout.block_tokens, rows);
        }
        for other in [
            layout().with_tokens(5),
            KvLayout {
                head_dim: 4,
                ..layout().with_tokens(2)
            },
            layout().with_tokens(2).with_codec(crate::KvCodec::Bf16),
        ] {
            assert!(
                matches!(
                    spec.verify(&encoded(other), &key),
                    Err(BlockError::LayoutMismatch { .. })
                ),
                "{other}"
            );
        }
        let alloc = system_allocator();
        assert!(crate::block::BlockBuf::new_short(layout(), 0, &alloc).is_err());
        assert!(crate::block::BlockBuf::new_short(layout(), 5, &alloc).is_err());
        let short = crate::block::BlockBuf::new_short(layout(), 3, &alloc).unwrap();
        assert_eq!(short.layout(), layout().with_tokens(3));
        let sealed = short.seal(key, fp, 0);
        assert_eq!(sealed.len() as u64, layout().encoded_bytes(), "a slot");
        assert_eq!(spec.verify(&sealed, &key).unwrap().layout.block_tokens, 3);
    }
}
