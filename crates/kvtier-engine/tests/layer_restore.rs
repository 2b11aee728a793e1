//! Layer-wise restore: a prefix restored layer by layer (the forward pass
//! waiting at each layer for that layer's pages) gives logits equal, bit
//! for bit, to the same prefix restored whole first, with every codec, for
//! a one-token suffix (the decode path) and a long one (the general path);
//! a block that fails its check after its layers were used is cut, and the
//! answer equals recompute.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]
use std::path::Path;

use kvtier_engine::{Engine, EngineOptions, Preset, StoreOptions, write_preset};
use kvtier_store::KvCodec;
use kvtier_store::block::HEADER_BYTES;

const BT: usize = 16;

fn opts(reuse: bool) -> EngineOptions {
    EngineOptions {
        block_tokens: BT,
        pool_pages: 64,
        max_seq_tokens: 1024,
        prefix_reuse: reuse,
        ..Default::default()
    }
}

fn store_opts(cache: &Path, codec: KvCodec) -> StoreOptions {
    StoreOptions {
        codec,
        memory_bytes: 64 << 20,
        disk_dirs: vec![cache.to_path_buf()],
        disk_bytes: 64 << 20,
        remote: None,
        g3_sync: None,
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 11 + salt * 17 + 5) % 256)
        .collect()
}

/// Stores `p`'s prefix, drops it from G1 and G2, and restores it from G3
/// layer-wise or not; the logits and what the restore reported.
fn restore_from_g3(
    e: &mut Engine,
    p: &[u32],
    layer_wise: bool,
) -> (Vec<f32>, kvtier_engine::Prefill) {
    e.evict_g1();
    e.store().unwrap().evict_memory().unwrap();
    e.set_layerwise_restore(layer_wise);
    let out = e.prefill(p).unwrap();
    e.finish(out.seq);
    e.flush_offload().unwrap();
    (out.logits.clone(), out)
}

#[test]
fn layer_wise_logits_equal_a_whole_prefix_restore_with_every_codec() {
    let m = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 3, m.path()).unwrap();
    let base = prompt(64, 1);
    for codec in [
        KvCodec::None,
        KvCodec::Bf16,
        KvCodec::Fp8E4m3,
        KvCodec::Int8,
    ] {
        let cache = tempfile::tempdir().unwrap();
        let mut e =
            Engine::load(m.path(), opts(true), Some(store_opts(cache.path(), codec))).unwrap();
        let first = e.prefill(&base).unwrap();
        e.finish(first.seq);
        e.flush_offload().unwrap();
        // A one-token suffix (the whole prompt but its last token is
        // cached), and a 40-token one computed as a chunk.
        let mut long = base.clone();
        long.extend(prompt(40, 9));
        for p in [base.clone(), long] {
            // Once so that the store holds all of `p` but its last token.
            restore_from_g3(&mut e, &p, false);
            let (whole, w) = restore_from_g3(&mut e, &p, false);
            let (layered, l) = restore_from_g3(&mut e, &p, true);
            assert_eq!(l.cached.g3, w.cached.g3, "{codec:?}: same blocks restored");
            assert_eq!(l.cached.g3, p.len() - 1, "{codec:?}: restored from G3");
            assert_eq!(l.restored_bytes, w.restored_bytes);
            assert_eq!(
                whole,
                layered,
                "{codec:?}, {} tokens: logits bit for bit",
                p.len()
            );
        }
    }
}

#[test]
fn the_layered_path_is_taken_and_reported_only_when_the_engine_is_idle() {
    let m = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 4, m.path()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut e = Engine::load(
        m.path(),
        opts(true),
        Some(store_opts(cache.path(), KvCodec::None)),
    )
    .unwrap();
    let p = prompt(50, 2);
    let first = e.prefill(&p).unwrap();
    e.finish(first.seq);
    e.flush_offload().unwrap();
    e.evict_g1();
    e.store().unwrap().evict_memory().unwrap();
    let id = e.begin(&p, || {}).unwrap();
    let a = e.attach(id).unwrap();
    assert!(a.layer_wise, "alone: layer by layer");
    assert_eq!(a.cached.g3, 49, "3 blocks and the 1-token tail");
    e.finish(id);
    // Beside another sequence the prefix is read whole first.
    e.evict_g1();
    e.store().unwrap().evict_memory().unwrap();
    let other = e.begin(&prompt(20, 7), || {}).unwrap();
    let id = e.begin(&p, || {}).unwrap();
    let a = e.attach(id).unwrap();
    assert!(!a.layer_wise, "beside another sequence: whole blocks");
    assert_eq!(a.cached.g3, 49, "3 blocks and the 1-token tail");
    e.finish(id);
    e.finish(other);
    // Finishing a sequence whose layer-wise read is in flight frees its
    // pages once the read is done.
    e.evict_g1();
    e.store().unwrap().evict_memory().unwrap();
    let free = e.free_pages();
    let id = e.begin(&p, || {}).unwrap();
    e.finish(id);
    e.evict_g1();
    assert_eq!(e.free_pages(), free, "no page lost");
}

#[test]
fn a_block_failing_its_check_after_its_layers_were_used_is_recomputed() {
    let m = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 5, m.path()).unwrap();
    let p = prompt(70, 3);
    let want = {
        let mut e = Engine::load(m.path(), opts(false), None).unwrap();
        e.prefill(&p).unwrap().logits
    };
    let cache = tempfile::tempdir().unwrap();
    let mut e = Engine::load(
        m.path(),
        opts(true),
        Some(store_opts(cache.path(), KvCodec::None)),
    )
    .unwrap();
    let first = e.prefill(&p).unwrap();
    e.finish(first.seq);
    e.flush_offload().unwrap();
    e.evict_g1();
    let store = e.store().unwrap().clone();
    store.evict_memory().unwrap();
    let keys = e.block_keys(&p);
    let (path, off) = store.disk().unwrap().locate_key(&keys[2]).unwrap();
    let at = off + HEADER_BYTES as u64 + 64;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at as usize] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();

    let out = e.prefill(&p).unwrap();
    assert_eq!(
        out.cached.g3,
        2 * BT,
        "blocks 0 and 1; block 2 failed its check"
    );
    assert_eq!(out.computed_tokens, p.len() - 2 * BT);
    let diff = out
        .logits
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(diff <= 1e-4, "answer equals recompute (max diff {diff})");
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 1);
}
