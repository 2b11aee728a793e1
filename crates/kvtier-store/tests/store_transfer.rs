//! Loads and saves between the store and memory the caller owns
//! (`TieredStore::load` / `save`): every arrangement round-trips through
//! G2, G3 and a restart; corrupt, missing and unreachable blocks are each
//! reported as such and leave the caller's memory untouched; cancelled
//! blocks are never written; bad buffers are refused; every codec
//! round-trips within its bound, decoded straight into the caller's memory;
//! a layer-wise load has each layer in when it says so and ends as a whole
//! load does.

mod common;

use std::time::Duration;

use common::*;
use kvtier_store::{
    Arrangement, BlockError, BlockFailure, BlockKey, BlockRegions, BlockResult, KeyChain, KvCodec,
    KvDtype, KvLayout, Part, Refused, RemoteConfig, StoreConfig, Tier, TieredStore, Transfer,
};

/// An engine's KV cache for one layout: per layer a tensor of `blocks`
/// pages, each page one layer's bytes of one block (the shape of vLLM's
/// CPU cache, `[num_blocks, ...]` per layer).
struct Cache {
    layout: KvLayout,
    layers: Vec<Vec<u8>>,
}

impl Cache {
    fn new(layout: KvLayout, blocks: usize, fill: u8) -> Self {
        let page = layer_bytes(&layout);
        Self {
            layout,
            layers: (0..layout.layers)
                .map(|_| vec![fill; page * blocks])
                .collect(),
        }
    }

    /// Fills page `page` of every layer with bytes that are a function of
    /// `seed`, the layer and the position.
    fn fill_page(&mut self, page: usize, seed: u64) {
        let n = layer_bytes(&self.layout);
        for (l, t) in self.layers.iter_mut().enumerate() {
            let want = payload_for(&key(seed * 1000 + l as u64), n);
            t[page * n..(page + 1) * n].copy_from_slice(&want);
        }
    }

    fn page(&self, layer: usize, page: usize) -> &[u8] {
        let n = layer_bytes(&self.layout);
        &self.layers[layer][page * n..(page + 1) * n]
    }

    /// The regions of page `page`: one per layer where a layer is
    /// contiguous in the payload, else K and V of each layer (kv-major),
    /// each half of the page.
    fn regions(&mut self, page: usize) -> BlockRegions {
        let layout = self.layout;
        let n = layer_bytes(&layout);
        let mut pieces = Vec::new();
        for (l, t) in self.layers.iter_mut().enumerate() {
            let base = t[page * n..].as_mut_ptr();
            let l = l as u32;
            match layout.layer_range(l) {
                Some(r) => pieces.push((r.start, base, n)),
                None => {
                    let (k, v) = (
                        layout.part_range(l, Part::K).expect("K"),
                        layout.part_range(l, Part::V).expect("V"),
                    );
                    let half = n / 2;
                    pieces.push((k.start, base, half));
                    // SAFETY: `half` is within the page.
                    pieces.push((v.start, unsafe { base.add(half) }, half));
                }
            }
        }
        // SAFETY: the pages live in `self`, which every test keeps alive and
        // leaves alone until the transfer is waited for.
        unsafe { BlockRegions::from_raw(&layout, &pieces) }.expect("regions")
    }

    fn all_regions(&mut self, pages: std::ops::Range<usize>) -> Vec<BlockRegions> {
        pages.map(|p| self.regions(p)).collect()
    }
}

fn layer_bytes(l: &KvLayout) -> usize {
    l.layer_bytes() as usize
}

fn config(layout: KvLayout, dir: &std::path::Path, g2_blocks: u64) -> StoreConfig {
    let slot = layout.encoded_bytes();
    let mut c = StoreConfig::new(layout, fingerprint());
    c.memory_bytes = g2_blocks * slot;
    let mut dc = kvtier_store::DiskConfig::new(vec![dir.to_path_buf()], 256 * slot, layout);
    dc.segment_bytes = 64 * slot;
    c.disk = Some(dc);
    c
}

fn chain_keys(layout: &KvLayout, n: u64) -> Vec<BlockKey> {
    let chain = KeyChain::new(&fingerprint(), layout, b"");
    (0..n).map(|i| chain.raw_key(&i.to_le_bytes())).collect()
}

fn wait(t: Transfer) -> Vec<BlockResult> {
    t.wait_timeout(Duration::from_secs(60))
        .expect("the transfer finishes")
}

#[test]
fn every_arrangement_round_trips_through_g2_g3_and_a_restart() {
    for arrangement in Arrangement::ALL {
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
            let layout = KvLayout {
                arrangement,
                ..KvLayout::kv_major(3, 2, 16, 8, dtype)
            };
            let dir = tempfile::tempdir().unwrap();
            let keys = chain_keys(&layout, 40);
            let mut src = Cache::new(layout, 40, 0);
            for p in 0..40 {
                src.fill_page(p, p as u64);
            }
            {
                let store = TieredStore::open(config(layout, dir.path(), 64)).unwrap();
                let saved = wait(
                    store
                        .save(keys.clone(), src.all_regions(0..40), None)
                        .unwrap(),
                );
                assert_eq!(saved, vec![BlockResult::Stored; 40], "{layout}");
                // Saving again finds them.
                let again = wait(
                    store
                        .save(keys[..3].to_vec(), src.all_regions(0..3), None)
                        .unwrap(),
                );
                assert_eq!(again, vec![BlockResult::Present; 3]);

                let mut dst = Cache::new(layout, 40, 0xAA);
                let got = wait(
                    store
                        .load(keys.clone(), dst.all_regions(0..40), None)
                        .unwrap(),
                );
                assert_eq!(got, vec![BlockResult::Hit(Tier::G2); 40], "{layout}");
                assert_eq!(dst.layers, src.layers, "{layout}: loaded bytes differ");

                // From G3: empty G2 first.
                store.evict_memory().unwrap();
                let mut dst = Cache::new(layout, 40, 0x55);
                let got = wait(
                    store
                        .load(keys.clone(), dst.all_regions(0..40), None)
                        .unwrap(),
                );
                assert_eq!(got, vec![BlockResult::Hit(Tier::G3); 40], "{layout}");
                assert_eq!(dst.layers, src.layers, "{layout}: bytes from G3 differ");
                store.close().unwrap();
            }
            // A new process (store) finds them on disk.
            let store = TieredStore::open(config(layout, dir.path(), 64)).unwrap();
            assert_eq!(store.lookup_prefix(&keys).hits_in(Tier::G3), 40);
            let mut dst = Cache::new(layout, 40, 0x11);
            // Load into other pages, in reverse: page p gets block 39 - p.
            let dests: Vec<BlockRegions> = (0..40).rev().map(|p| dst.regions(p)).collect();
            let got = wait(store.load(keys.clone(), dests, None).unwrap());
            assert!(
                got.iter().all(|r| *r == BlockResult::Hit(Tier::G3)),
                "{got:?}"
            );
            for p in 0..40 {
                for l in 0..layout.layers as usize {
                    assert_eq!(
                        dst.page(l, 39 - p),
                        src.page(l, p),
                        "{layout} page {p} layer {l}"
                    );
                }
            }
        }
    }
}

/// Element `i` of page `page`, layer `layer`: finite, signed, with rows
/// of very different magnitudes (what per-row scales are for).
fn kv_value(page: usize, layer: usize, i: usize) -> f32 {
    let row_scale = 10f32.powi((i / 64 % 7) as i32 - 3);
    ((page * 131 + layer * 17 + i) as f32 * 0.37).sin() * row_scale
}

fn to_dtype(dtype: KvDtype, v: f32) -> Vec<u8> {
    match dtype {
        KvDtype::F32 => v.to_le_bytes().to_vec(),
        KvDtype::Bf16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
        KvDtype::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
        KvDtype::F8E4m3 => unreachable!("no codec takes f8"),
    }
}

fn from_dtype(dtype: KvDtype, b: &[u8]) -> f32 {
    match dtype {
        KvDtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        KvDtype::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
    }
}

#[test]
fn every_codec_round_trips_within_its_bound_through_g2_g3_and_a_restart() {
    for (dtype, codec) in [
        (KvDtype::F32, KvCodec::Bf16),
        (KvDtype::F32, KvCodec::Fp8E4m3),
        (KvDtype::F32, KvCodec::Int8),
        (KvDtype::Bf16, KvCodec::Fp8E4m3),
        (KvDtype::F16, KvCodec::Int8),
    ] {
        // vLLM's CPU page: a 128-value row per (head, token), K then V.
        let layout = KvLayout::vllm_cpu(2, 2, 64, 16, dtype).with_codec(codec);
        let plain = layout.with_codec(KvCodec::None);
        assert!(layout.encoded_bytes() < plain.encoded_bytes(), "{layout}");
        let size = dtype.size_bytes() as usize;
        let n = layer_bytes(&layout);
        let mut src = Cache::new(layout, 6, 0);
        for (l, t) in src.layers.iter_mut().enumerate() {
            for (i, e) in t.chunks_exact_mut(size).enumerate() {
                e.copy_from_slice(&to_dtype(dtype, kv_value(i * size / n, l, i % (n / size))));
            }
        }
        let keys = chain_keys(&layout, 6);
        // Coded and uncoded KV of one model never share a key.
        assert!(chain_keys(&plain, 6).iter().all(|k| !keys.contains(k)));
        let dir = tempfile::tempdir().unwrap();
        let written = src.layers.clone();
        let check = |dst: &Cache, what: &str| {
            for (l, (a, b)) in written.iter().zip(&dst.layers).enumerate() {
                // Rows of 64 values (one head's K or V of one token).
                for (r, (ra, rb)) in a.chunks(64 * size).zip(b.chunks(64 * size)).enumerate() {
                    let want: Vec<f32> = ra.chunks(size).map(|e| from_dtype(dtype, e)).collect();
                    let got: Vec<f32> = rb.chunks(size).map(|e| from_dtype(dtype, e)).collect();
                    let amax = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                    for (x, y) in want.iter().zip(&got) {
                        // int8: half a step of amax/127; fp8: 1/16 relative
                        // plus its subnormal step; bf16: 1/256 relative;
                        // plus the dtype's own rounding of the result.
                        let bound = match codec {
                            KvCodec::Int8 => amax / 254.0,
                            KvCodec::Fp8E4m3 => x.abs() / 16.0 + amax / 448.0 / 1024.0,
                            _ => x.abs() / 256.0,
                        } + x.abs() / 128.0 * f32::from(dtype != KvDtype::F32);
                        assert!(
                            (x - y).abs() <= bound * 1.001,
                            "{layout} {what}: layer {l} row {r}: {x} came back as {y}"
                        );
                    }
                }
            }
        };
        {
            let store = TieredStore::open(config(layout, dir.path(), 64)).unwrap();
            let saved = wait(
                store
                    .save(keys.clone(), src.all_regions(0..6), None)
                    .unwrap(),
            );
            assert_eq!(saved, vec![BlockResult::Stored; 6], "{layout}");
            let mut dst = Cache::new(layout, 6, 0xAA);
            let got = wait(
                store
                    .load(keys.clone(), dst.all_regions(0..6), None)
                    .unwrap(),
            );
            assert_eq!(got, vec![BlockResult::Hit(Tier::G2); 6], "{layout}");
            check(&dst, "from G2");
            store.evict_memory().unwrap();
            let mut dst = Cache::new(layout, 6, 0x55);
            let got = wait(
                store
                    .load(keys.clone(), dst.all_regions(0..6), None)
                    .unwrap(),
            );
            assert_eq!(got, vec![BlockResult::Hit(Tier::G3); 6], "{layout}");
            check(&dst, "from G3");
            store.close().unwrap();
        }
        let store = TieredStore::open(config(layout, dir.path(), 64)).unwrap();
        let mut dst = Cache::new(layout, 6, 0x11);
        let got = wait(
            store
                .load(keys.clone(), dst.all_regions(0..6), None)
                .unwrap(),
        );
        assert_eq!(got, vec![BlockResult::Hit(Tier::G3); 6], "{layout}");
        check(&dst, "after a restart");
        // The same directory opened uncoded finds none of the coded blocks:
        // they live in a slot directory of their own.
        assert_ne!(
            kvtier_store::DiskTier::slot_dir(dir.path(), &layout),
            kvtier_store::DiskTier::slot_dir(dir.path(), &plain)
        );
        drop(store);
        let other = TieredStore::open(config(plain, dir.path(), 64)).unwrap();
        assert_eq!(other.lookup_prefix(&chain_keys(&plain, 6)).hits(), 0);
    }
}

#[test]
fn a_codec_refuses_non_finite_kv_and_pieces_off_its_groups() {
    let layout = KvLayout::vllm_cpu(1, 1, 64, 16, KvDtype::F32).with_codec(KvCodec::Int8);
    let n = layer_bytes(&layout);
    let dir = tempfile::tempdir().unwrap();
    let store = TieredStore::open(config(layout, dir.path(), 8)).unwrap();
    let mut mem: Vec<u8> = (0..n / 4).flat_map(|i| (i as f32).to_le_bytes()).collect();
    mem[400..404].copy_from_slice(&f32::NAN.to_le_bytes());
    let p = mem.as_mut_ptr();
    // SAFETY: `mem` outlives the transfer, which is waited for.
    let one = unsafe { BlockRegions::from_raw(&layout, &[(0, p, n)]) }.unwrap();
    let keys = chain_keys(&layout, 1);
    let got = wait(store.save(keys.clone(), vec![one], None).unwrap());
    assert!(
        matches!(&got[0], BlockResult::Error(why @ BlockFailure::Block(BlockError::Codec(_)))
            if why.to_string().contains("non-finite")),
        "{got:?}"
    );
    assert_eq!(store.lookup_prefix(&keys).hits(), 0, "nothing stored");
    // A piece that splits a 64-value group cannot be decoded into.
    let pieces = [
        (0, p, 4 * 32),
        (4 * 32, unsafe { p.add(4 * 32) }, n - 4 * 32),
    ];
    // SAFETY: refused before use.
    let r = unsafe { BlockRegions::from_raw(&layout, &pieces) };
    assert!(
        r.is_err_and(|e| e.to_string().contains("64-element boundary")),
        "a split group was accepted"
    );
}

#[test]
fn corrupt_and_missing_blocks_are_reported_and_never_copied() {
    let layout = KvLayout::vllm_cpu(2, 2, 64, 16, KvDtype::F32);
    let dir = tempfile::tempdir().unwrap();
    let keys = chain_keys(&layout, 8);
    let mut src = Cache::new(layout, 8, 0);
    for p in 0..8 {
        src.fill_page(p, p as u64 + 7);
    }
    let store = TieredStore::open(config(layout, dir.path(), 64)).unwrap();
    wait(
        store
            .save(keys.clone(), src.all_regions(0..8), None)
            .unwrap(),
    );
    store.evict_memory().unwrap();
    // Flip a payload byte of block 3 on disk.
    let (path, off) = store
        .disk()
        .unwrap()
        .locate_key(&keys[3])
        .expect("block 3 on disk");
    flip_byte(&path, off + 128 + 1000);

    let mut want = keys.clone();
    let unknown = KeyChain::new(&fingerprint(), &layout, b"").raw_key(b"never saved");
    want.push(unknown);
    let mut dst = Cache::new(layout, 9, 0xEE);
    let got = wait(store.load(want, dst.all_regions(0..9), None).unwrap());
    for (i, r) in got.iter().enumerate() {
        match i {
            3 => assert!(
                matches!(
                    r,
                    BlockResult::Corrupt(Refused {
                        tier: Tier::G3,
                        reason: BlockError::PayloadChecksum
                    })
                ),
                "block 3: {r:?}"
            ),
            8 => assert_eq!(*r, BlockResult::Miss),
            _ => assert_eq!(*r, BlockResult::Hit(Tier::G3), "block {i}"),
        }
    }
    for l in 0..2 {
        assert!(
            dst.page(l, 3).iter().all(|&b| b == 0xEE),
            "the corrupt block was copied"
        );
        assert!(
            dst.page(l, 8).iter().all(|&b| b == 0xEE),
            "a miss wrote memory"
        );
        for p in [0, 2, 4, 7] {
            assert_eq!(dst.page(l, p), src.page(l, p));
        }
    }
    // The corrupt block was deleted: now a miss.
    let mut again = Cache::new(layout, 1, 0);
    let got = wait(
        store
            .load(vec![keys[3]], again.all_regions(0..1), None)
            .unwrap(),
    );
    assert_eq!(got, vec![BlockResult::Miss]);
}

#[test]
fn a_cancelled_load_writes_only_the_blocks_it_reports() {
    let layout = KvLayout::vllm_cpu(2, 2, 64, 16, KvDtype::F32);
    let dir = tempfile::tempdir().unwrap();
    let n = 200;
    let keys = chain_keys(&layout, n as u64);
    let mut src = Cache::new(layout, n, 0);
    for p in 0..n {
        src.fill_page(p, p as u64);
    }
    let store = TieredStore::open(config(layout, dir.path(), 256)).unwrap();
    wait(
        store
            .save(keys.clone(), src.all_regions(0..n), None)
            .unwrap(),
    );
    store.evict_memory().unwrap();

    let mut dst = Cache::new(layout, n, 0xCC);
    let t = store
        .load(keys.clone(), dst.all_regions(0..n), None)
        .unwrap();
    t.cancel();
    let got = wait(t);
    assert_eq!(got.len(), n);
    let cancelled = got.iter().filter(|r| **r == BlockResult::Cancelled).count();
    for (p, r) in got.iter().enumerate() {
        for l in 0..2 {
            match r {
                BlockResult::Hit(_) => assert_eq!(dst.page(l, p), src.page(l, p), "page {p}"),
                BlockResult::Cancelled => assert!(
                    dst.page(l, p).iter().all(|&b| b == 0xCC),
                    "cancelled page {p} was written"
                ),
                other => panic!("page {p}: {other:?}"),
            }
        }
    }
    // 13 chunks on two threads: the cancel lands before the last ones run.
    assert!(cancelled > 0, "nothing was cancelled: {got:?}");
}

#[test]
fn a_dropped_transfer_is_waited_for_and_an_empty_one_is_done() {
    let layout = KvLayout::vllm_cpu(1, 1, 64, 16, KvDtype::F32);
    let dir = tempfile::tempdir().unwrap();
    let store = TieredStore::open(config(layout, dir.path(), 64)).unwrap();
    let empty = store.load(Vec::new(), Vec::new(), None).unwrap();
    assert!(empty.is_done() && empty.is_empty());
    assert!(empty.wait().is_empty());

    let keys = chain_keys(&layout, 50);
    let mut src = Cache::new(layout, 50, 3);
    let (tx, rx) = std::sync::mpsc::channel();
    let t = store
        .save(
            keys.clone(),
            src.all_regions(0..50),
            Some(Box::new(move || tx.send(()).unwrap())),
        )
        .unwrap();
    drop(t);
    // The callback ran (the drop waited for the transfer to finish) and
    // whatever was stored is whole.
    rx.recv_timeout(Duration::from_secs(30))
        .expect("callback ran");
    let stored = store.get_many(&keys);
    for b in stored.into_iter().flatten() {
        assert!(b.payload().iter().all(|&x| x == 3));
    }
}

#[test]
fn a_layer_wise_load_has_each_layer_in_when_it_says_so_and_ends_as_a_whole_load() {
    for arrangement in [Arrangement::LayerFused, Arrangement::KvMajor] {
        for codec in [KvCodec::None, KvCodec::Int8] {
            let layout = KvLayout {
                arrangement,
                ..KvLayout::vllm_cpu(4, 2, 64, 16, KvDtype::F32)
            }
            .with_codec(codec);
            let (n, layers) = (12, layout.layers as usize);
            let size = layer_bytes(&layout);
            let keys = chain_keys(&layout, n as u64);
            let mut src = Cache::new(layout, n, 0);
            for (l, t) in src.layers.iter_mut().enumerate() {
                for (i, e) in t.chunks_exact_mut(4).enumerate() {
                    e.copy_from_slice(&kv_value(i * 4 / size, l, i % (size / 4)).to_le_bytes());
                }
            }
            let dir = tempfile::tempdir().unwrap();
            let store = TieredStore::open(config(layout, dir.path(), 64)).unwrap();
            let saved = wait(
                store
                    .save(keys.clone(), src.all_regions(0..n), None)
                    .unwrap(),
            );
            assert_eq!(saved, vec![BlockResult::Stored; n], "{layout}");
            // What a whole load decodes: a layer-wise one must end the same.
            let mut whole = Cache::new(layout, n, 0);
            wait(
                store
                    .load(keys.clone(), whole.all_regions(0..n), None)
                    .unwrap(),
            );

            let unknown = KeyChain::new(&fingerprint(), &layout, b"").raw_key(b"never saved");
            let mut asked = keys.clone();
            asked.push(unknown);
            for tier in [Tier::G2, Tier::G3] {
                if tier == Tier::G3 {
                    store.evict_memory().unwrap();
                }
                let mut dst = Cache::new(layout, n + 1, 0xEE);
                let t = store
                    .load_layers(asked.clone(), dst.all_regions(0..n + 1), None)
                    .unwrap();
                for l in 0..layers {
                    assert!(t.wait_layer(l as u32, Some(Duration::from_secs(60))));
                    // Layer `l` is in now, whatever the later layers do.
                    for p in 0..n {
                        assert_eq!(
                            dst.page(l, p),
                            whole.page(l, p),
                            "{layout} {tier:?} {l} {p}"
                        );
                    }
                }
                let mut want = vec![BlockResult::Hit(tier); n];
                want.push(BlockResult::Miss);
                assert_eq!(wait(t), want, "{layout}");
                for l in 0..layers {
                    assert!(
                        dst.page(l, n).iter().all(|&b| b == 0xEE),
                        "a miss was written"
                    );
                }
            }

            // A block whose layer 2 is corrupt on disk is reported so; the
            // others come back whole.
            store.evict_memory().unwrap();
            let (path, off) = store.disk().unwrap().locate_key(&keys[3]).expect("on disk");
            let stored_layer = layout.stored_payload_bytes() / layout.layers as u64;
            flip_byte(&path, off + 128 + 2 * stored_layer + 10);
            let mut dst = Cache::new(layout, n, 0xEE);
            let t = store
                .load_layers(keys.clone(), dst.all_regions(0..n), None)
                .unwrap();
            assert!(t.wait_layer(layout.layers - 1, Some(Duration::from_secs(60))));
            let got = wait(t);
            for (p, r) in got.iter().enumerate() {
                if p == 3 {
                    assert!(matches!(r, BlockResult::Corrupt(_)), "{layout}: {r:?}");
                    continue;
                }
                assert_eq!(*r, BlockResult::Hit(Tier::G3), "{layout} block {p}");
                for l in 0..layers {
                    assert_eq!(dst.page(l, p), whole.page(l, p));
                }
            }
        }
    }
}

#[test]
fn a_load_that_is_not_layer_wise_has_a_layer_in_once_it_is_done() {
    let layout = KvLayout::vllm_cpu(2, 1, 64, 16, KvDtype::F32);
    let dir = tempfile::tempdir().unwrap();
    let store = TieredStore::open(config(layout, dir.path(), 8)).unwrap();
    let keys = chain_keys(&layout, 3);
    let mut src = Cache::new(layout, 3, 0);
    for p in 0..3 {
        src.fill_page(p, p as u64);
    }
    wait(
        store
            .save(keys.clone(), src.all_regions(0..3), None)
            .unwrap(),
    );
    let mut dst = Cache::new(layout, 3, 0);
    let t = store.load(keys, dst.all_regions(0..3), None).unwrap();
    assert!(t.wait_layer(0, None));
    assert!(
        t.is_done(),
        "a plain load's layer is in only once all of it is"
    );
    assert!(t.wait_layer(7, Some(Duration::ZERO)), "past the last layer");
    assert_eq!(wait(t), vec![BlockResult::Hit(Tier::G2); 3]);
    assert_eq!(dst.page(1, 2), src.page(1, 2));
}

#[test]
fn bad_buffers_are_refused_before_any_work() {
    let layout = KvLayout::vllm_cpu(2, 1, 64, 16, KvDtype::F32);
    let n = layer_bytes(&layout);
    let mut mem = vec![0u8; 4 * n];
    let p = mem.as_mut_ptr();
    type Pieces = Vec<(u64, *mut u8, usize)>;
    let cases: Vec<(&str, Pieces)> = vec![
        ("a gap", vec![(0, p, n)]),
        ("an overlap", vec![(0, p, n), (n as u64 - 1, p, n + 1)]),
        ("past the end", vec![(0, p, n), (n as u64, p, n + 1)]),
        ("null", vec![(0, std::ptr::null_mut(), 2 * n)]),
        ("an offset overflow", vec![(u64::MAX, p, 2)]),
    ];
    for (what, pieces) in cases {
        // SAFETY: refused before use; `mem` outlives it either way.
        let r = unsafe { BlockRegions::from_raw(&layout, &pieces) };
        assert!(r.is_err(), "{what} was accepted");
    }
    let dir = tempfile::tempdir().unwrap();
    let store = TieredStore::open(config(layout, dir.path(), 8)).unwrap();
    // SAFETY: `mem` outlives the transfer, which is refused anyway.
    let one = unsafe { BlockRegions::from_raw(&layout, &[(0, p, 2 * n)]) }.unwrap();
    let err = store
        .load(chain_keys(&layout, 2), vec![one], None)
        .unwrap_err();
    assert!(
        err.to_string().contains("2 keys but 1 block buffers"),
        "{err}"
    );
}

#[test]
fn an_unreachable_pool_is_an_error_not_a_miss() {
    let layout = KvLayout::vllm_cpu(1, 1, 64, 16, KvDtype::F32);
    let port = kvtier_testkit::free_port().unwrap();
    let mut c = StoreConfig::new(layout, fingerprint());
    let mut r = RemoteConfig::new(format!("redis://127.0.0.1:{port}"));
    r.timeout = Duration::from_millis(500);
    r.connect_timeout = Duration::from_millis(200);
    c.remote = Some(r);
    let store = TieredStore::open(c).unwrap();
    let mut dst = Cache::new(layout, 2, 9);
    let got = wait(
        store
            .load(chain_keys(&layout, 2), dst.all_regions(0..2), None)
            .unwrap(),
    );
    for r in &got {
        assert!(
            matches!(r, BlockResult::Error(why @ BlockFailure::Pool(_)) if why.to_string().contains("G4")),
            "{r:?}"
        );
    }
    assert!(dst.layers[0].iter().all(|&b| b == 9));
}

#[test]
fn namespaces_share_one_g2_budget_and_keep_their_own_g3() {
    // Two models of different layouts, G2 for 16 blocks of the larger in all.
    let a_layout = KvLayout::vllm_cpu(2, 2, 64, 16, KvDtype::F32);
    let b_layout = KvLayout::kv_major(1, 1, 64, 16, KvDtype::Bf16);
    let shared = kvtier_store::SharedMemory::new(16 * a_layout.encoded_bytes());
    let dir = tempfile::tempdir().unwrap();
    let open_ns = |layout: KvLayout, name: &str| {
        let mut c = config(layout, &dir.path().join(name), 0);
        c.shared_memory = Some(shared.clone());
        TieredStore::open(c).unwrap()
    };
    let a = open_ns(a_layout, "a");
    let b = open_ns(b_layout, "b");

    let a_keys = chain_keys(&a_layout, 12);
    let mut a_src = Cache::new(a_layout, 12, 0);
    for p in 0..12 {
        a_src.fill_page(p, p as u64 + 100);
    }
    wait(
        a.save(a_keys.clone(), a_src.all_regions(0..12), None)
            .unwrap(),
    );
    assert_eq!(a.lookup_prefix(&a_keys).hits_in(Tier::G2), 12);

    // B's blocks need room: A's oldest leave G2 for A's G3, not B's.
    let b_keys = chain_keys(&b_layout, 40);
    let mut b_src = Cache::new(b_layout, 40, 0);
    for p in 0..40 {
        b_src.fill_page(p, p as u64 + 500);
    }
    wait(
        b.save(b_keys.clone(), b_src.all_regions(0..40), None)
            .unwrap(),
    );
    assert!(shared.memory().used_bytes() <= 16 * a_layout.encoded_bytes());
    a.flush().unwrap();
    b.flush().unwrap();
    let a_in_g2 = a
        .lookup_prefix(&a_keys)
        .tiers
        .iter()
        .filter(|t| **t == Tier::G2)
        .count();
    assert!(a_in_g2 < 12, "B's saves evicted none of A's blocks");
    assert!(
        a.disk().unwrap().len() >= 12 - a_in_g2,
        "A's evicted blocks are not on A's disk"
    );
    assert!(
        b.disk()
            .unwrap()
            .contains_many(&a_keys)
            .iter()
            .all(|held| !held),
        "A's blocks went to B's disk"
    );

    // Every block of both still loads, whole and right.
    let mut a_dst = Cache::new(a_layout, 12, 0xAB);
    let got = wait(
        a.load(a_keys.clone(), a_dst.all_regions(0..12), None)
            .unwrap(),
    );
    assert!(
        got.iter().all(|r| matches!(r, BlockResult::Hit(_))),
        "{got:?}"
    );
    assert_eq!(a_dst.layers, a_src.layers);
    let mut b_dst = Cache::new(b_layout, 40, 0xAB);
    let got = wait(
        b.load(b_keys.clone(), b_dst.all_regions(0..40), None)
            .unwrap(),
    );
    assert!(
        got.iter().all(|r| matches!(r, BlockResult::Hit(_))),
        "{got:?}"
    );
    assert_eq!(b_dst.layers, b_src.layers);

    // Emptying one namespace's G2 leaves the other's; closing one takes its
    // blocks out of the budget.
    let b_in_g2 = b.lookup_prefix(&b_keys).hits_in(Tier::G2);
    assert!(b_in_g2 > 0);
    a.evict_memory().unwrap();
    assert_eq!(a.lookup_prefix(&a_keys).hits_in(Tier::G2), 0);
    assert_eq!(b.lookup_prefix(&b_keys).hits_in(Tier::G2), b_in_g2);
    b.close().unwrap();
    assert_eq!(
        shared.memory().len(),
        0,
        "a closed namespace's blocks stay in G2"
    );
}
