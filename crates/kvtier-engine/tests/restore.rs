//! Restored prefixes give the same logits as recompute: from G1, G2, G3, and
//! from G3 reopened in a new process; greedy output is identical with reuse on
//! and off; other models and tenants never hit.
//!
//! Layer-wise restore: a prefix restored layer by layer (the forward pass
//! waiting at each layer for that layer's pages) gives logits equal, bit
//! for bit, to the same prefix restored whole first, with every codec, for
//! a one-token suffix (the decode path) and a long one (the general path);
//! a block that fails its check after its layers were used is cut, and the
//! answer equals recompute.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]
use std::path::Path;

use kvtier_engine::serving::sampling::argmax;
use kvtier_engine::{Engine, EngineOptions, Preset, StoreOptions, write_preset};
use kvtier_store::KvCodec;
use kvtier_store::block::HEADER_BYTES;

const BT: usize = 16;

fn model(dir: &Path, seed: u64) {
    write_preset(Preset::Tiny, seed, dir).unwrap();
}

fn opts(reuse: bool) -> EngineOptions {
    EngineOptions {
        block_tokens: BT,
        pool_pages: 64,
        max_seq_tokens: 1024,
        prefix_reuse: reuse,
        ..Default::default()
    }
}

fn store_opts(cache: &Path) -> StoreOptions {
    store_opts_coded(cache, KvCodec::None)
}

fn store_opts_coded(cache: &Path, codec: KvCodec) -> StoreOptions {
    StoreOptions {
        codec,
        memory_bytes: 64 << 20,
        disk_dirs: vec![cache.to_path_buf()],
        disk_bytes: 64 << 20,
        remote: None,
        g3_sync: None,
        eviction: Default::default(),
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7 + salt * 13 + 3) % 256)
        .collect()
}

fn recompute_logits(model_dir: &Path, p: &[u32]) -> Vec<f32> {
    let mut e = Engine::load(model_dir, opts(false), None).unwrap();
    let out = e.prefill(p).unwrap();
    assert_eq!(out.cached.total(), 0);
    assert_eq!(out.computed_tokens, p.len());
    out.logits
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Prompts sharing the first 48 tokens of `base`, split inside a block, on a
/// block boundary, and everything but one token; with the tokens each
/// shares with `base`.
fn split_cases(base: &[u32]) -> Vec<(Vec<u32>, usize)> {
    let mut inside = base[..40].to_vec();
    inside.extend(prompt(9, 5));
    let mut boundary = base[..32].to_vec();
    boundary.extend(prompt(7, 6));
    let mut but_one = base[..48].to_vec();
    but_one.push(11);
    vec![(inside, 40), (boundary, 32), (but_one, 48)]
}

/// Reuse is token-granular: from G1 a prompt reuses every token it shares
/// with a cached one (here `base`: its full pages and its last, partial
/// one), inside a block too; once computed, the prompt itself comes back
/// from G2 and from G3 with only its last token recomputed. Logits equal
/// recompute every time.
#[test]
fn restored_prefix_logits_equal_recompute_from_g1_g2_and_g3() {
    let m = tempfile::tempdir().unwrap();
    model(m.path(), 1);
    let base = prompt(53, 1);
    let base_logits = recompute_logits(m.path(), &base);
    for (p, shared) in split_cases(&base) {
        let cache = tempfile::tempdir().unwrap();
        let mut e = Engine::load(m.path(), opts(true), Some(store_opts(cache.path()))).unwrap();
        let first = e.prefill(&base).unwrap();
        assert_eq!(first.cached.total(), 0);
        let diff = max_diff(&first.logits, &base_logits);
        assert!(diff <= 1e-4, "first pass differs from recompute by {diff}");
        e.finish(first.seq);
        e.flush_offload().unwrap();

        let want = recompute_logits(m.path(), &p);
        let g1 = e.prefill(&p).unwrap();
        assert_eq!(
            g1.cached.g1,
            shared.min(p.len() - 1),
            "G1 reuse for len {}",
            p.len()
        );
        assert_eq!(g1.cached.total(), g1.cached.g1);
        assert!(max_diff(&g1.logits, &want) <= 1e-4);
        e.finish(g1.seq);
        e.flush_offload().unwrap();
        // G2: G1 evicted, blocks come from host memory.
        e.evict_g1();
        let g2 = e.prefill(&p).unwrap();
        assert_eq!(g2.cached.g2, p.len() - 1, "G2 reuse for len {}", p.len());
        assert_eq!(g2.computed_tokens, 1);
        // Whole blocks, and the tail stored with only its rows.
        let layout = e.store().unwrap().layout();
        let (full, tail) = ((p.len() - 1) / BT, (p.len() - 1) % BT);
        let mut want_bytes = full as u64 * layout.stored_payload_bytes();
        if tail > 0 {
            want_bytes += layout.with_tokens(tail as u32).stored_payload_bytes();
        }
        assert_eq!(g2.restored_bytes, want_bytes, "len {}", p.len());
        let d = max_diff(&g2.logits, &want);
        assert!(d <= 1e-4, "G2 restore differs by {d}");
        e.finish(g2.seq);
        // G3: G1 and G2 evicted.
        e.evict_g1();
        e.store().unwrap().evict_memory().unwrap();
        let g3 = e.prefill(&p).unwrap();
        assert_eq!(g3.cached.g3, p.len() - 1, "G3 reuse for len {}", p.len());
        assert_eq!(g3.restored_bytes, want_bytes, "len {}", p.len());
        let d = max_diff(&g3.logits, &want);
        assert!(d <= 1e-4, "G3 restore differs by {d}");
        e.finish(g3.seq);
        // And again from G1: the whole prompt but its last token.
        let again = e.prefill(&p).unwrap();
        assert_eq!(again.cached.g1, p.len() - 1);
        assert!(max_diff(&again.logits, &want) <= 1e-4);
        e.finish(again.seq);
    }
}

const CHILD_ENV: &str = "KVTIER_TEST_REOPEN_CHILD";

#[test]
fn restore_from_g3_in_a_new_process() {
    if let Ok(dirs) = std::env::var(CHILD_ENV) {
        // Child: reopen the cache written by the parent, restore, compare.
        let (model_dir, cache_dir) = dirs.split_once('|').unwrap();
        let (m, c) = (Path::new(model_dir), Path::new(cache_dir));
        let base = prompt(53, 1);
        let mut p = base[..48].to_vec();
        p.push(99);
        let mut e = Engine::load(m, opts(true), Some(store_opts(c))).unwrap();
        let out = e.prefill(&p).unwrap();
        assert_eq!(out.cached.g3, 48, "child must restore from G3");
        let d = max_diff(&out.logits, &recompute_logits(m, &p));
        assert!(d <= 1e-4, "restore in a new process differs by {d}");
        return;
    }
    let m = tempfile::tempdir().unwrap();
    model(m.path(), 1);
    let cache = tempfile::tempdir().unwrap();
    {
        let mut e = Engine::load(m.path(), opts(true), Some(store_opts(cache.path()))).unwrap();
        let out = e.prefill(&prompt(53, 1)).unwrap();
        e.finish(out.seq);
        e.flush_offload().unwrap();
        // Dropping the engine and its store persists G2 to G3.
    }
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "restore_from_g3_in_a_new_process", "--nocapture"])
        .env(
            CHILD_ENV,
            format!("{}|{}", m.path().display(), cache.path().display()),
        )
        .status()
        .unwrap();
    assert!(status.success(), "child process failed: {status}");
}

fn greedy(e: &mut Engine, p: &[u32], n: usize) -> Vec<u32> {
    let first = e.prefill(p).unwrap();
    let mut out = vec![argmax(&first.logits)];
    while out.len() < n {
        let last = *out.last().unwrap();
        let logits = e.decode(&[(first.seq, last)]).unwrap();
        out.push(argmax(&logits[0]));
    }
    e.finish(first.seq);
    out
}

#[test]
fn greedy_generation_is_identical_with_reuse_on_and_off() {
    let m = tempfile::tempdir().unwrap();
    model(m.path(), 3);
    let cache = tempfile::tempdir().unwrap();
    let p = prompt(70, 2);
    let mut off = Engine::load(m.path(), opts(false), None).unwrap();
    let want = greedy(&mut off, &p, 40);
    let mut on = Engine::load(m.path(), opts(true), Some(store_opts(cache.path()))).unwrap();
    assert_eq!(greedy(&mut on, &p, 40), want, "first pass");
    on.evict_g1();
    on.store().unwrap().evict_memory().unwrap();
    assert_eq!(greedy(&mut on, &p, 40), want, "restored from G3");
}

#[test]
fn batched_decode_matches_single_sequence_decode() {
    let m = tempfile::tempdir().unwrap();
    model(m.path(), 4);
    let mut e = Engine::load(m.path(), opts(false), None).unwrap();
    let (a, b) = (prompt(21, 7), prompt(40, 8));
    let want_a = greedy(&mut e, &a, 12);
    let want_b = greedy(&mut e, &b, 12);
    let pa = e.prefill(&a).unwrap();
    let pb = e.prefill(&b).unwrap();
    let (mut ga, mut gb) = (vec![argmax(&pa.logits)], vec![argmax(&pb.logits)]);
    while ga.len() < 12 {
        let l = e
            .decode(&[(pa.seq, *ga.last().unwrap()), (pb.seq, *gb.last().unwrap())])
            .unwrap();
        ga.push(argmax(&l[0]));
        gb.push(argmax(&l[1]));
    }
    assert_eq!(ga, want_a);
    assert_eq!(gb, want_b);
}

#[test]
fn other_models_and_tenants_never_hit() {
    let m1 = tempfile::tempdir().unwrap();
    let m2 = tempfile::tempdir().unwrap();
    model(m1.path(), 1);
    model(m2.path(), 2);
    let cache = tempfile::tempdir().unwrap();
    let p = prompt(64, 1);
    {
        let mut e = Engine::load(m1.path(), opts(true), Some(store_opts(cache.path()))).unwrap();
        let out = e.prefill(&p).unwrap();
        e.finish(out.seq);
        e.flush_offload().unwrap();
        let again = e.prefill(&p).unwrap();
        assert!(again.cached.total() > 0, "same model and tenant must hit");
    }
    let mut other_model =
        Engine::load(m2.path(), opts(true), Some(store_opts(cache.path()))).unwrap();
    assert_eq!(
        other_model.prefill(&p).unwrap().cached.total(),
        0,
        "another seed must not hit"
    );
    // One store per cache directory at a time (the owner lock).
    drop(other_model);
    let tenant = EngineOptions {
        tenant_salt: b"tenant-b".to_vec(),
        ..opts(true)
    };
    let mut other_tenant = Engine::load(m1.path(), tenant, Some(store_opts(cache.path()))).unwrap();
    assert_eq!(
        other_tenant.prefill(&p).unwrap().cached.total(),
        0,
        "another tenant must not hit"
    );
}

/// Empties G1 and G2: what the store holds is then on disk only.
fn on_disk_only(e: &mut Engine) {
    e.evict_g1();
    e.store().unwrap().evict_memory().unwrap();
}

/// Prefills `p` (the store gets its blocks) and ends it.
fn prefill_and_store(e: &mut Engine, p: &[u32]) -> kvtier_engine::Prefill {
    let out = e.prefill(p).unwrap();
    e.finish(out.seq);
    e.flush_offload().unwrap();
    out
}

/// Restores `p`'s prefix from G3 (G1 and G2 emptied first), layer-wise or
/// not; the logits and what the restore reported.
fn restore_from_g3(
    e: &mut Engine,
    p: &[u32],
    layer_wise: bool,
) -> (Vec<f32>, kvtier_engine::Prefill) {
    on_disk_only(e);
    e.set_layerwise_restore(layer_wise);
    let out = prefill_and_store(e, p);
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
        let mut e = Engine::load(
            m.path(),
            opts(true),
            Some(store_opts_coded(cache.path(), codec)),
        )
        .unwrap();
        prefill_and_store(&mut e, &base);
        // A one-token suffix (the whole prompt but its last token is
        // cached), and a 40-token one computed as a chunk.
        let mut long = base.clone();
        long.extend(prompt(40, 9));
        for p in [base.clone(), long] {
            // Once so that the store holds all of `p` but its last token.
            restore_from_g3(&mut e, &p, false);
            let (whole, w) = restore_from_g3(&mut e, &p, false);
            let t = std::time::Instant::now();
            let (layered, l) = restore_from_g3(&mut e, &p, true);
            let took = t.elapsed().as_secs_f64();
            // Whole first, the forward pass starts once the read is done:
            // it never waits on a layer. Layer by layer it may, for at
            // most the call's own time.
            assert_eq!(w.layer_wait_seconds, 0.0, "{codec:?}");
            assert!(
                (0.0..=took).contains(&l.layer_wait_seconds),
                "{codec:?}: waited {} s of {took} s",
                l.layer_wait_seconds
            );
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

/// An engine (and its model and cache directories) whose store holds a
/// 50-token prompt, which it returns, on disk only: 3 blocks and a 1-token
/// tail to restore.
fn a_50_token_prompt_on_disk_only() -> ([tempfile::TempDir; 2], Engine, Vec<u32>) {
    let m = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 4, m.path()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut e = Engine::load(m.path(), opts(true), Some(store_opts(cache.path()))).unwrap();
    let p = prompt(50, 2);
    prefill_and_store(&mut e, &p);
    on_disk_only(&mut e);
    ([m, cache], e, p)
}

#[test]
fn the_layered_path_is_taken_and_reported_only_when_the_engine_is_idle() {
    let (_dirs, mut e, p) = a_50_token_prompt_on_disk_only();
    let id = e.begin(&p, || {}).unwrap();
    let a = e.attach(id).unwrap();
    assert!(a.layer_wise, "alone: layer by layer");
    assert_eq!(a.cached.g3, 49, "3 blocks and the 1-token tail");
    e.finish(id);
    // Beside another sequence the forward pass does not start before the
    // read is done.
    on_disk_only(&mut e);
    let other = e.begin(&prompt(20, 7), || {}).unwrap();
    let id = e.begin(&p, || {}).unwrap();
    let a = e.attach(id).unwrap();
    assert!(!a.layer_wise, "beside another sequence: whole blocks");
    assert_eq!(a.cached.g3, 49, "3 blocks and the 1-token tail");
    e.finish(id);
    e.finish(other);
    // Finishing a sequence whose layer-wise read is in flight frees its
    // pages once the read is done.
    on_disk_only(&mut e);
    let free = e.free_pages();
    let id = e.begin(&p, || {}).unwrap();
    e.finish(id);
    e.evict_g1();
    assert_eq!(e.free_pages(), free, "no page lost");
}

#[test]
fn a_layer_wise_restore_tells_its_caller_when_it_can_start_and_when_it_is_done() {
    let (_dirs, mut e, p) = a_50_token_prompt_on_disk_only();
    // A caller that sleeps between its checks (the scheduler) is woken
    // once the plan is known, so it attaches the sequence while the read
    // is still going, and again once the read is done.
    let (tx, rx) = std::sync::mpsc::channel();
    let id = e
        .begin(&p, move || {
            let _ = tx.send(());
        })
        .unwrap();
    let wait = std::time::Duration::from_secs(30);
    rx.recv_timeout(wait).expect("woken once the plan is known");
    assert!(e.restore_started(id), "the forward pass can start");
    rx.recv_timeout(wait)
        .expect("woken again once the read is done");
    assert!(e.restore_done(id));
    let a = e.attach(id).unwrap();
    assert!(a.layer_wise);
    assert_eq!(a.cached.g3, 49);
    e.finish(id);
}

/// Beside another sequence the store's thread yields the CPU after each
/// piece it decodes into G1 (`EngineOptions::restore_yield`): the KV that
/// lands is the same however much it yields, and equals recompute.
#[test]
fn a_restore_beside_another_sequence_lands_the_same_kv_however_much_it_yields() {
    let m = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 5, m.path()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut e = Engine::load(m.path(), opts(true), Some(store_opts(cache.path()))).unwrap();
    let p = prompt(90, 3);
    prefill_and_store(&mut e, &p);
    let reference = recompute_logits(m.path(), &p);
    let mut seen: Option<Vec<f32>> = None;
    for k in [0.0, 3.0, 50.0, f64::NAN, -1.0] {
        on_disk_only(&mut e);
        e.set_restore_yield(k);
        let other = e.begin(&prompt(20, 7), || {}).unwrap();
        let id = e.begin(&p, || {}).unwrap();
        let a = e.attach(id).unwrap();
        assert_eq!(a.cached.g3, 89, "yield {k}: 5 blocks and the 9-token tail");
        let logits = loop {
            let step = e.step(&[], &[id]).unwrap();
            if let Some(Some(l)) = step.prefilled.into_iter().next() {
                break l;
            }
        };
        e.finish(id);
        e.finish(other);
        assert!(
            max_diff(&logits, &reference) < 1e-4,
            "yield {k}: restored logits equal recompute"
        );
        match &seen {
            Some(first) => assert_eq!(first, &logits, "yield {k}: bit for bit as yield 0"),
            None => seen = Some(logits),
        }
    }
}

#[test]
fn a_block_failing_its_check_after_its_layers_were_used_is_recomputed() {
    let m = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 5, m.path()).unwrap();
    let p = prompt(70, 3);
    let want = recompute_logits(m.path(), &p);
    let cache = tempfile::tempdir().unwrap();
    let mut e = Engine::load(m.path(), opts(true), Some(store_opts(cache.path()))).unwrap();
    prefill_and_store(&mut e, &p);
    on_disk_only(&mut e);
    let store = e.store().unwrap().clone();
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
    let diff = max_diff(&out.logits, &want);
    assert!(diff <= 1e-4, "answer equals recompute (max diff {diff})");
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 1);
}
