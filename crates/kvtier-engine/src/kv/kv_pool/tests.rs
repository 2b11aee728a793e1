//! The pool's tests: page allocation, export and import (coded, short,
//! layer by layer, to a device's form).

use kvtier_store::{KvCodec, KvLayout};

use super::*;

/// K of one page of 2 heads x 3 tokens x 4 dims: 0, 1, ..., 23.
fn ramp() -> Tensor {
    Tensor::arange(0f32, 24., &Device::Cpu)
        .unwrap()
        .reshape((2, 3, 4))
        .unwrap()
}

#[test]
fn a_sequence_gets_the_page_after_its_last_when_free_else_the_lowest() {
    let mut pool = KvPool::new(1, 1, 2, 2, 6, &Device::Cpu).unwrap();
    let a = pool.alloc(None).unwrap();
    let b = pool.alloc(None).unwrap();
    assert_eq!((a, b), (0, 1));
    assert!(pool.release(a));
    pool.free(a);
    // 2 follows 1; 0 is free again but not next to anything asked for.
    assert_eq!(pool.alloc(Some(1)), Some(2));
    assert_eq!(pool.alloc(Some(2)), Some(3));
    // 4 would follow 3 but a new sequence takes the lowest free page.
    assert_eq!(pool.alloc(None), Some(0));
    assert_eq!(pool.alloc(Some(0)), Some(4), "1 is taken: the lowest free");
    assert_eq!(pool.alloc(Some(5)), Some(5));
    assert_eq!(pool.alloc(Some(5)), None, "all six in use");
    assert_eq!(pool.free_pages(), 0);
}

#[test]
fn a_page_exported_into_a_buffer_imports_into_another_page_unchanged() {
    let pool = KvPool::new(2, 2, 4, 3, 4, &Device::Cpu).unwrap();
    let k = ramp();
    let v = (&k * -1.0).unwrap();
    for layer in 0..2 {
        pool.write(layer, &[1], 0, &k, &v).unwrap();
    }
    let plain = pool.store_layout(KvCodec::None);
    let mut block = vec![0xAAu8; pool.page_bytes()];
    pool.export_into(1, &plain, &mut block).unwrap();
    assert_eq!(block, pool.export(1).unwrap());
    let first: Vec<f32> = bytemuck::cast_slice(&block[..96]).to_vec();
    assert_eq!(
        first,
        (0..24).map(|x| x as f32).collect::<Vec<_>>(),
        "layer 0 K first"
    );
    pool.import(3, &plain, &block).unwrap();
    for layer in 0..2 {
        let got = pool.page_k(layer, 3).unwrap().flatten_all().unwrap();
        let want = k.flatten_all().unwrap();
        assert_eq!(
            got.to_vec1::<f32>().unwrap(),
            want.to_vec1::<f32>().unwrap()
        );
        let got = pool.page_v(layer, 3).unwrap().flatten_all().unwrap();
        assert_eq!(
            got.to_vec1::<f32>().unwrap(),
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
    assert!(
        pool.import(0, &plain, &block[1..]).is_err(),
        "a short payload"
    );
    let other = KvLayout {
        block_tokens: 4,
        ..plain
    };
    assert!(pool.import(0, &other, &block).is_err(), "another page size");
    // The first two token rows of page 3 into page 0: those rows equal,
    // the third row untouched (zero).
    pool.copy_rows(3, 0, 2).unwrap();
    for layer in 0..2 {
        let got: Vec<f32> = pool
            .page_k(layer, 0)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let src: Vec<f32> = pool
            .page_k(layer, 3)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for h in 0..2 {
            let at = |r: usize| h * 12 + r * 4;
            assert_eq!(
                got[at(0)..at(2)],
                src[at(0)..at(2)],
                "layer {layer} head {h}"
            );
            assert_eq!(got[at(2)..at(3)], [0.0; 4], "row 2 not copied");
        }
    }
    assert!(pool.copy_rows(3, 0, 4).is_err(), "more rows than a page");
    assert!(pool.export_into(0, &plain, &mut block[..8]).is_err());
}

#[test]
fn a_coded_page_comes_back_within_its_codec_bound() {
    let pool = KvPool::new(2, 2, 4, 3, 4, &Device::Cpu).unwrap();
    let k = ramp();
    let k = ((k - 11.5).unwrap() * 0.3).unwrap();
    let v = (&k * -2.0).unwrap();
    for layer in 0..2 {
        pool.write(layer, &[1], 0, &k, &v).unwrap();
    }
    let want = pool.export(1).unwrap();
    let want: &[f32] = bytemuck::cast_slice(&want);
    for codec in [KvCodec::Bf16, KvCodec::Fp8E4m3, KvCodec::Int8] {
        let layout = pool.store_layout(codec);
        let mut stored = vec![0u8; layout.stored_payload_bytes() as usize];
        assert!(
            stored.len() < pool.page_bytes(),
            "{codec} stores fewer bytes"
        );
        pool.export_into(1, &layout, &mut stored).unwrap();
        pool.import(2, &layout, &stored).unwrap();
        let got = pool.export(2).unwrap();
        let got: &[f32] = bytemuck::cast_slice(&got);
        // Each 4-value row's scale is its own largest magnitude.
        for (w, g) in want.chunks(4).zip(got.chunks(4)) {
            let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (x, y) in w.iter().zip(g) {
                let bound = match codec {
                    KvCodec::Bf16 => x.abs() / 256.0,
                    KvCodec::Fp8E4m3 => x.abs() / 16.0 + amax / 448.0 / 1024.0,
                    _ => amax / 127.0 / 2.0 * 1.001,
                };
                assert!((x - y).abs() <= bound, "{codec}: {x} came back as {y}");
            }
        }
        assert!(
            pool.import(2, &layout, &stored[..stored.len() - 1])
                .is_err()
        );
    }
}

/// A pool of 3 layers, 2 heads, 3-row pages of 4 dims, page 1 written
/// with a different ramp in each layer.
fn three_layers_in_page_1() -> KvPool {
    let pool = KvPool::new(3, 2, 4, 3, 4, &Device::Cpu).unwrap();
    let k = ramp();
    for layer in 0..3 {
        let kl = ((&k - 7.0).unwrap() * (0.25 + layer as f64)).unwrap();
        pool.write(layer, &[1], 0, &kl, &(&kl * -0.5).unwrap())
            .unwrap();
    }
    pool
}

#[test]
fn the_device_import_places_every_head_as_the_in_place_one_does() {
    // The path a GPU pool takes (one host buffer, one copy, heads
    // placed by slice_set), run on CPU tensors against the in-place
    // path, with and without a codec, one layer and a run of layers,
    // a whole block and a tail of fewer rows.
    let pool = three_layers_in_page_1();
    let w = pool.page_writer();
    let zeros = pool.export(0).unwrap();
    let plain = pool.store_layout(KvCodec::None);
    for codec in [KvCodec::None, KvCodec::Int8] {
        let layout = pool.store_layout(codec);
        let mut stored = vec![0u8; layout.stored_payload_bytes() as usize];
        pool.export_into(1, &layout, &mut stored).unwrap();
        let per = stored.len() / 3;
        let one = KvLayout {
            layers: 1,
            ..layout
        };
        w.import_layers(2, &layout, 0..3, &stored, 3).unwrap();
        let whole = pool.export(2).unwrap();
        assert_ne!(whole, zeros, "{codec}");
        for rows in [3, 1, 0] {
            for page in [2, 3] {
                pool.import(page, &plain, &zeros).unwrap();
            }
            w.import_layers(2, &layout, 0..3, &stored, rows).unwrap();
            w.import_to_device(3, &one, (0..1, rows), &stored[..per])
                .unwrap();
            w.import_to_device(3, &one, (1..3, rows), &stored[per..])
                .unwrap();
            let got = pool.export(2).unwrap();
            assert_eq!(got, pool.export(3).unwrap(), "{codec}, {rows} rows");
            // Each part (a layer's K or V of one head: 3 rows of 4 f32)
            // holds the whole import's first rows, then what was there.
            for (part, (g, w)) in got.chunks(48).zip(whole.chunks(48)).enumerate() {
                assert_eq!(g[..rows * 16], w[..rows * 16], "{codec}, part {part}");
                assert!(
                    g[rows * 16..].iter().all(|&b| b == 0),
                    "{codec}, part {part}"
                );
            }
        }
        assert!(
            w.import_layers(2, &layout, 0..3, &stored, 4).is_err(),
            "more rows than a page"
        );
    }
}

#[test]
fn a_short_block_holds_a_pages_first_rows_and_fills_only_those() {
    // A prompt's tail is stored as a short block: the page's first
    // rows only, every codec; it comes back into those rows and leaves
    // the rest of the page alone.
    let pool = three_layers_in_page_1();
    let plain = pool.store_layout(KvCodec::None);
    let zeros = pool.export(0).unwrap();
    for codec in [
        KvCodec::None,
        KvCodec::Bf16,
        KvCodec::Fp8E4m3,
        KvCodec::Int8,
    ] {
        let full = pool.store_layout(codec);
        let mut whole = vec![0u8; full.stored_payload_bytes() as usize];
        pool.export_into(1, &full, &mut whole).unwrap();
        pool.import(3, &full, &whole).unwrap();
        let restored_whole = pool.export(3).unwrap();
        for rows in [1u32, 2] {
            let short = full.with_tokens(rows);
            let mut stored = vec![0u8; short.stored_payload_bytes() as usize];
            assert!(stored.len() < whole.len(), "{codec}");
            pool.export_into(1, &short, &mut stored).unwrap();
            pool.import(2, &plain, &zeros).unwrap();
            pool.import(2, &short, &stored).unwrap();
            let got = pool.export(2).unwrap();
            // Each part: 3 rows of 4 f32; the first `rows` as a whole
            // block's restore gives them, the rest untouched.
            let used = rows as usize * 16;
            for (part, (g, w)) in got.chunks(48).zip(restored_whole.chunks(48)).enumerate() {
                assert_eq!(g[..used], w[..used], "{codec}, {rows} rows, part {part}");
                assert!(g[used..].iter().all(|&b| b == 0), "{codec}, part {part}");
            }
            assert!(pool.import(2, &short, &stored[1..]).is_err());
            assert!(pool.import(2, &full, &stored).is_err());
        }
        assert!(
            pool.export_into(1, &full.with_tokens(4), &mut whole)
                .is_err(),
            "more rows than a page"
        );
    }
}
