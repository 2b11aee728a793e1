//! Restored prefixes give the same logits as recompute: from G1, G2, G3, and
//! from G3 reopened in a new process; greedy output is identical with reuse on
//! and off; other models and tenants never hit.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]
use std::path::Path;

use kvtier_engine::sampling::argmax;
use kvtier_engine::{Engine, EngineOptions, Preset, StoreOptions, write_preset};

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
    StoreOptions {
        codec: kvtier_store::KvCodec::None,
        memory_bytes: 64 << 20,
        disk_dirs: vec![cache.to_path_buf()],
        disk_bytes: 64 << 20,
        remote: None,
        g3_sync: None,
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
        assert!(g2.restored_bytes > 0);
        let d = max_diff(&g2.logits, &want);
        assert!(d <= 1e-4, "G2 restore differs by {d}");
        e.finish(g2.seq);
        // G3: G1 and G2 evicted.
        e.evict_g1();
        e.store().unwrap().evict_memory().unwrap();
        let g3 = e.prefill(&p).unwrap();
        assert_eq!(g3.cached.g3, p.len() - 1, "G3 reuse for len {}", p.len());
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
