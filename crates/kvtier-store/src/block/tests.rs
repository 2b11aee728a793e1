//! Tests of `block.rs`.

use kvtier_io::buffer::system_allocator;
use proptest::prelude::*;

use super::*;

fn tiny_layout() -> KvLayout {
    KvLayout {
        layers: 1,
        kv_heads: 1,
        head_dim: 4,
        block_tokens: 2,
        dtype: KvDtype::F32,
        codec: crate::KvCodec::None,
        arrangement: Arrangement::KvMajor,
        shard: None,
    }
}

fn payload_for(layout: &KvLayout, salt: u8) -> Vec<u8> {
    (0..layout.payload_bytes())
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
        .collect()
}

/// A payload of small finite values of the layout's dtype (any codec
/// takes it).
fn finite_payload(layout: &KvLayout, salt: u8) -> Vec<u8> {
    let n = (layout.payload_bytes() / u64::from(layout.dtype.size_bytes())) as usize;
    (0..n)
        .flat_map(|i| {
            let v = ((i * 31 + usize::from(salt)) % 17) as f32 * 0.25 - 2.0;
            match layout.dtype {
                KvDtype::F32 => v.to_le_bytes().to_vec(),
                KvDtype::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                KvDtype::Bf16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                KvDtype::F8E4m3 => vec![float8::F8E4M3::from_f32(v).to_bits()],
            }
        })
        .collect()
}

fn arb_layout() -> impl Strategy<Value = KvLayout> {
    (
        (1u32..5, 1u32..5, 1u32..33, 1u32..17),
        prop::sample::select(KvDtype::ALL.to_vec()),
        prop::sample::select(Arrangement::ALL.to_vec()),
        prop::option::of((2u16..9).prop_flat_map(|w| (0..w, Just(w)))),
        prop::sample::select(KvCodec::ALL.to_vec()),
    )
        .prop_map(
            |((layers, kv_heads, head_dim, block_tokens), dtype, arrangement, shard, codec)| {
                KvLayout {
                    layers,
                    kv_heads,
                    head_dim,
                    block_tokens,
                    dtype,
                    codec: if codec.supports(dtype) {
                        codec
                    } else {
                        KvCodec::None
                    },
                    arrangement,
                    shard: shard.map(|(rank, world)| TpShard { rank, world }),
                }
            },
        )
}

#[test]
fn header_layout_is_pinned() {
    let layout = tiny_layout();
    let h = BlockHeader {
        key: BlockKey([0x11; 16]),
        fingerprint: ModelFingerprint([0x22; 16]),
        layout,
        payload_len: layout.payload_bytes(),
        generation: 0x0102_0304_0506_0708,
        payload_crc32c: 0xdead_beef,
    };
    let b = h.encode();
    assert_eq!(&b[0..4], b"KVTB");
    assert_eq!(&b[4..6], &[1, 0]);
    assert_eq!(b[6], 0);
    assert_eq!(b[7], 0);
    assert_eq!(&b[8..24], &[0x11; 16]);
    assert_eq!(&b[24..40], &[0x22; 16]);
    assert_eq!(&b[40..44], &1u32.to_le_bytes());
    assert_eq!(&b[44..48], &1u32.to_le_bytes());
    assert_eq!(&b[48..52], &4u32.to_le_bytes());
    assert_eq!(&b[52..56], &2u32.to_le_bytes());
    assert_eq!(&b[56..64], &64u64.to_le_bytes());
    assert_eq!(&b[64..72], &[8, 7, 6, 5, 4, 3, 2, 1]);
    assert_eq!(&b[72..76], &[0xef, 0xbe, 0xad, 0xde]);
    assert!(b[76..124].iter().all(|&x| x == 0));
    assert_eq!(&b[124..128], &crc32c::crc32c(&b[..124]).to_le_bytes());
    assert_eq!(BlockHeader::decode(&b), Ok(h));
    assert_eq!(h.encoded_len(), 4096);
}

#[test]
fn encode_block_is_aligned_padded_and_round_trips() {
    let alloc = system_allocator();
    for layout in [
        tiny_layout(),
        KvLayout {
            layers: 3,
            kv_heads: 2,
            head_dim: 64,
            block_tokens: 16,
            dtype: KvDtype::Bf16,
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
        },
        // header + payload exactly 4096: no padding
        KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 1,
            block_tokens: (4096 - 128) / 2,
            dtype: KvDtype::F8E4m3,
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
        },
    ] {
        let payload = payload_for(&layout, 5);
        let key = BlockKey([9; 16]);
        let buf =
            encode_block(key, ModelFingerprint([4; 16]), layout, 7, &payload, &alloc).unwrap();
        assert_eq!(buf.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
        assert_eq!(buf.len() % DIRECT_IO_ALIGN, 0);
        assert_eq!(buf.len() as u64, layout.encoded_bytes());
        let end = HEADER_BYTES + payload.len();
        assert!(buf.len() >= end && buf.len() - end < DIRECT_IO_ALIGN);
        assert!(buf[end..].iter().all(|&b| b == 0), "padding not zero");
        assert_eq!(&buf[HEADER_BYTES..end], &payload[..]);

        let (h, p) = decode_block(&buf, Some(&key)).unwrap();
        assert_eq!(p, &payload[..]);
        assert_eq!(h.key, key);
        assert_eq!(h.fingerprint, ModelFingerprint([4; 16]));
        assert_eq!(h.layout, layout);
        assert_eq!(h.generation, 7);
        assert_eq!(h.payload_crc32c, crc32c::crc32c(&payload));
        assert_eq!(h.encoded_len(), buf.len());
        // The exact header+payload prefix (no padding) also decodes.
        assert!(decode_block(&buf[..end], Some(&key)).is_ok());
    }
}

#[test]
fn encode_block_rejects_bad_input() {
    let alloc = system_allocator();
    let layout = tiny_layout();
    let k = BlockKey([0; 16]);
    let fp = ModelFingerprint([0; 16]);
    assert_eq!(
        encode_block(k, fp, layout, 0, &[0; 63], &alloc).unwrap_err(),
        BlockError::PayloadLength {
            header: 63,
            layout: 64
        }
    );
    assert!(matches!(
        encode_block(
            k,
            fp,
            KvLayout {
                layers: 0,
                ..layout
            },
            0,
            &[],
            &alloc
        ),
        Err(BlockError::BadLayout(_))
    ));
}

#[test]
fn decode_errors_are_specific() {
    let alloc = system_allocator();
    let layout = tiny_layout();
    let key = BlockKey([1; 16]);
    let payload = payload_for(&layout, 0);
    let good = encode_block(key, ModelFingerprint([2; 16]), layout, 0, &payload, &alloc)
        .unwrap()
        .to_vec();
    // Re-seal a modified header with a valid header checksum.
    let reseal = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        let crc = crc32c::crc32c(&b[..124]);
        b[124..128].copy_from_slice(&crc.to_le_bytes());
        b
    };

    assert_eq!(
        BlockHeader::decode(&good[..127]),
        Err(BlockError::TooShort {
            needed: 128,
            got: 127
        })
    );
    assert_eq!(
        BlockHeader::decode(&[]),
        Err(BlockError::TooShort {
            needed: 128,
            got: 0
        })
    );
    let b = reseal(&|b| b[0] = b'X');
    assert_eq!(decode_block(&b, None), Err(BlockError::BadMagic));
    let b = reseal(&|b| b[4] = 3);
    assert_eq!(
        decode_block(&b, None),
        Err(BlockError::UnsupportedVersion(3))
    );
    // Version 1 has no arrangement or shard: those bytes must be zero.
    let b = reseal(&|b| b[76] = 1);
    assert_eq!(decode_block(&b, None), Err(BlockError::ReservedNotZero));
    let b = reseal(&|b| b[80] = 2);
    assert_eq!(decode_block(&b, None), Err(BlockError::ReservedNotZero));
    let b = reseal(&|b| {
        b[4] = 2;
        b[76] = 9;
    });
    assert_eq!(
        decode_block(&b, None),
        Err(BlockError::UnknownArrangement(9))
    );
    // Version 2: a rank without a world, or the reserved byte 77.
    let b = reseal(&|b| {
        b[4] = 2;
        b[78] = 1;
    });
    assert_eq!(decode_block(&b, None), Err(BlockError::ReservedNotZero));
    let b = reseal(&|b| {
        b[4] = 2;
        b[77] = 1;
    });
    assert_eq!(decode_block(&b, None), Err(BlockError::ReservedNotZero));
    let b = reseal(&|b| b[6] = 9);
    assert_eq!(decode_block(&b, None), Err(BlockError::UnknownDtype(9)));
    // A codec from a newer kvtier is a miss, never a crash.
    let b = reseal(&|b| b[7] = 9);
    assert_eq!(decode_block(&b, None), Err(BlockError::UnknownCodec(9)));
    // A known codec with the uncoded payload's length is a miss too.
    let b = reseal(&|b| b[7] = KvCodec::Int8 as u8);
    assert!(matches!(
        decode_block(&b, None),
        Err(BlockError::PayloadLength { .. })
    ));
    let b = reseal(&|b| b[100] = 1);
    assert_eq!(decode_block(&b, None), Err(BlockError::ReservedNotZero));
    let mut b = good.clone();
    b[9] ^= 0x80;
    assert_eq!(decode_block(&b, None), Err(BlockError::HeaderChecksum));
    let b = reseal(&|b| b[40..44].copy_from_slice(&0u32.to_le_bytes()));
    assert!(matches!(
        decode_block(&b, None),
        Err(BlockError::BadLayout(_))
    ));
    let b = reseal(&|b| b[56..64].copy_from_slice(&65u64.to_le_bytes()));
    assert_eq!(
        decode_block(&b, None),
        Err(BlockError::PayloadLength {
            header: 65,
            layout: 64
        })
    );
    // A huge claimed layout is rejected before any length is trusted.
    let b = reseal(&|b| {
        b[40..56].copy_from_slice(&[0xff; 16]);
        b[56..64].copy_from_slice(&u64::MAX.to_le_bytes());
    });
    assert!(matches!(
        decode_block(&b, None),
        Err(BlockError::BadLayout(_))
    ));
    let mut b = good.clone();
    b[HEADER_BYTES + 3] ^= 1;
    assert_eq!(decode_block(&b, None), Err(BlockError::PayloadChecksum));
    let other = BlockKey([3; 16]);
    assert_eq!(
        decode_block(&good, Some(&other)),
        Err(BlockError::KeyMismatch {
            expected: other,
            found: key
        })
    );
    // Error messages are readable.
    let msg = BlockError::KeyMismatch {
        expected: other,
        found: key,
    }
    .to_string();
    assert!(
        msg.contains(&other.to_hex()) && msg.contains(&key.to_hex()),
        "{msg}"
    );
}

#[test]
fn truncation_is_too_short() {
    let alloc = system_allocator();
    let layout = tiny_layout();
    let payload = payload_for(&layout, 1);
    let buf = encode_block(
        BlockKey([5; 16]),
        ModelFingerprint([6; 16]),
        layout,
        0,
        &payload,
        &alloc,
    )
    .unwrap();
    let end = HEADER_BYTES + payload.len();
    for cut in 0..end {
        let needed = if cut < HEADER_BYTES {
            HEADER_BYTES
        } else {
            end
        };
        assert_eq!(
            decode_block(&buf[..cut], None),
            Err(BlockError::TooShort { needed, got: cut }),
            "cut at {cut}"
        );
    }
}

#[test]
fn every_single_bit_flip_is_detected() {
    let alloc = system_allocator();
    let layout = tiny_layout();
    let payload = payload_for(&layout, 2);
    let key = BlockKey([7; 16]);
    let good = encode_block(key, ModelFingerprint([8; 16]), layout, 3, &payload, &alloc)
        .unwrap()
        .to_vec();
    let end = HEADER_BYTES + payload.len();
    for bit in 0..end * 8 {
        let mut b = good.clone();
        b[bit / 8] ^= 1 << (bit % 8);
        assert!(
            decode_block(&b, None).is_err(),
            "bit {bit} flip not detected"
        );
        assert!(decode_block(&b, Some(&key)).is_err(), "bit {bit}");
    }
}

proptest! {
    #[test]
    fn prop_header_round_trip(
        layout in arb_layout(),
        key in any::<[u8; 16]>(),
        fp in any::<[u8; 16]>(),
        generation in any::<u64>(),
        crc in any::<u32>(),
    ) {
        let h = BlockHeader {
            key: BlockKey(key),
            fingerprint: ModelFingerprint(fp),
            layout,
            payload_len: layout.stored_payload_bytes(),
            generation,
            payload_crc32c: crc,
        };
        let enc = h.encode();
        prop_assert_eq!(BlockHeader::decode(&enc), Ok(h));
        // Only what version 1 cannot say is written as version 2.
        let v1 = layout.arrangement == Arrangement::KvMajor && layout.shard.is_none();
        prop_assert_eq!(le_u16(&enc, 4), if v1 { 1 } else { 2 });
        prop_assert_eq!(h.encoded_len() as u64, layout.encoded_bytes());
        prop_assert_eq!(h.encoded_len() % DIRECT_IO_ALIGN, 0);
    }

    #[test]
    fn prop_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let h = BlockHeader::decode(&bytes);
        let d = decode_block(&bytes, None);
        let dk = decode_block(&bytes, Some(&BlockKey([0; 16])));
        if bytes.len() < HEADER_BYTES {
            let too_short = BlockError::TooShort { needed: HEADER_BYTES, got: bytes.len() };
            prop_assert_eq!(h, Err(too_short.clone()));
            prop_assert_eq!(d.err(), Some(too_short));
            prop_assert!(dk.is_err());
        } else if let Ok((hd, p)) = d {
            prop_assert_eq!(p.len() as u64, hd.payload_len);
        }
    }

    #[test]
    fn prop_magic_prefixed_garbage_never_panics(
        rest in proptest::collection::vec(any::<u8>(), 0..508),
        reseal in any::<bool>(),
    ) {
        // Get past the magic/version checks so deeper paths are exercised.
        let mut bytes = b"KVTB\x01\x00".to_vec();
        bytes.extend_from_slice(&rest);
        if reseal && bytes.len() >= HEADER_BYTES {
            bytes[76..124].fill(0);
            bytes[6] %= 4;
            bytes[7] = 0;
            let crc = crc32c::crc32c(&bytes[..124]);
            bytes[124..128].copy_from_slice(&crc.to_le_bytes());
            // With a valid header crc, only layout/length/payload checks remain.
            prop_assert!(!matches!(
                BlockHeader::decode(&bytes),
                Err(BlockError::HeaderChecksum | BlockError::ReservedNotZero | BlockError::BadMagic)
            ));
        }
        let _ = BlockHeader::decode(&bytes);
        let _ = decode_block(&bytes, None);
    }

    #[test]
    fn prop_block_round_trip_and_bit_flip(
        layout in arb_layout(),
        key in any::<[u8; 16]>(),
        generation in any::<u64>(),
        salt in any::<u8>(),
        flip in any::<prop::sample::Index>(),
    ) {
        let alloc = system_allocator();
        let payload = finite_payload(&layout, salt);
        let key = BlockKey(key);
        let buf = encode_block(key, ModelFingerprint([1; 16]), layout, generation, &payload, &alloc)
            .unwrap();
        prop_assert_eq!(buf.len() % DIRECT_IO_ALIGN, 0);
        let (h, p) = decode_block(&buf, Some(&key)).unwrap();
        prop_assert_eq!(p.len() as u64, layout.stored_payload_bytes());
        let mut back = vec![0u8; payload.len()];
        layout.decode_into(p, 0, &mut back).unwrap();
        if layout.codec == KvCodec::None {
            prop_assert_eq!(&back, &payload);
        }
        prop_assert_eq!(h.generation, generation);

        let end = HEADER_BYTES + p.len();
        let bit = flip.index(end * 8);
        let mut b = buf.to_vec();
        b[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(decode_block(&b, None).is_err(), "bit {} flip not detected", bit);
    }
}
