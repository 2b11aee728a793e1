//! A request whose prefix is read from the store never stalls the others:
//! while its G4 read is held up (the pool paused with `CLIENT PAUSE`), a
//! sequence already decoding keeps getting tokens, and the restore still
//! lands (the paused GETs answer) with the same first token as a recompute.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_engine::serving::sampling::SamplingParams;
use kvtier_engine::serving::scheduler::{BatchConfig, GenerateEvent, GenerateRequest, Scheduler};
use kvtier_engine::{Engine, EngineOptions, Preset, StoreOptions, write_preset};
use kvtier_store::RemoteConfig;
use kvtier_testkit::RedisServer;

const BT: usize = 16;

/// Longest sequence (the tiny preset's positions): the decoding sequence
/// may fill it during the pause (the tiny model decodes thousands of tokens
/// a second), and the pool has room for that and the long prompt.
const MAX_SEQ: usize = 8192;

fn engine(model: &Path, remote: Option<&str>) -> Engine {
    let opts = EngineOptions {
        block_tokens: BT,
        // The decoder's whole context and the long prompt's pages.
        pool_pages: MAX_SEQ / BT + 64,
        max_seq_tokens: MAX_SEQ,
        ..Default::default()
    };
    let store = remote.map(|url| {
        let mut r = RemoteConfig::new(url);
        r.timeout = Duration::from_secs(20);
        StoreOptions {
            codec: kvtier_store::KvCodec::None,
            eviction: Default::default(),
            memory_bytes: 64 << 20,
            disk_dirs: vec![],
            disk_bytes: 0,
            remote: Some(r),
            g3_sync: None,
        }
    });
    Engine::load(model, opts, store).unwrap()
}

fn submit(s: &Scheduler, prompt: Vec<u32>, max_tokens: usize) -> mpsc::Receiver<GenerateEvent> {
    let (tx, rx) = mpsc::channel();
    assert!(s.submit(GenerateRequest {
        salt: Vec::new(),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        events: tx.into(),
    }));
    rx
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7 + salt * 13 + 3) % 256)
        .collect()
}

#[test]
fn a_sequence_keeps_decoding_while_another_restores_from_g4() {
    let m = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 3, m.path()).unwrap();
    let redis = RedisServer::start().unwrap();
    let long = prompt(40 * BT + 1, 1);

    // Node A computes the long prompt's KV; it is written through to G4.
    let mut a = engine(m.path(), Some(&redis.url()));
    let computed = a.prefill(&long).unwrap();
    a.flush_offload().unwrap();
    a.store().unwrap().flush().unwrap();
    let want_first = kvtier_engine::serving::sampling::argmax(&computed.logits);
    drop(a);

    // Node B: one sequence decoding, then the long prompt arrives while the
    // pool is paused.
    let b = engine(m.path(), Some(&redis.url()));
    let sched = Scheduler::start(
        b,
        BatchConfig {
            max_batch: 4,
            max_wait: Duration::from_millis(1),
        },
    )
    .unwrap();
    let decoding = submit(&sched, prompt(20, 2), MAX_SEQ - 64);
    let started = decoding.recv_timeout(Duration::from_secs(60)).unwrap();
    assert!(
        matches!(started, GenerateEvent::Started { .. }),
        "{started:?}"
    );
    for _ in 0..5 {
        let t = decoding.recv_timeout(Duration::from_secs(60)).unwrap();
        assert!(matches!(t, GenerateEvent::Token(_)), "{t:?}");
    }

    let pause_ms = 1500u64;
    redis
        .command(&[b"CLIENT", b"PAUSE", pause_ms.to_string().as_bytes(), b"ALL"])
        .unwrap();
    let paused_at = Instant::now();
    let restoring = submit(&sched, long.clone(), 1);

    // Tokens of the decoding sequence while the restore waits on the pool
    // (it may reach its context limit meanwhile: then it has decoded all
    // along).
    let mut during = 0;
    let mut decoder_done = false;
    let first = loop {
        if let Ok(ev) = restoring.try_recv() {
            break ev;
        }
        if decoder_done {
            break restoring.recv_timeout(Duration::from_secs(60)).unwrap();
        }
        match decoding.recv_timeout(Duration::from_secs(60)).unwrap() {
            GenerateEvent::Token(_) => during += 1,
            GenerateEvent::Finished { .. } => decoder_done = true,
            other => panic!("the decoding sequence failed: {other:?}"),
        }
    };
    let waited = paused_at.elapsed();
    let GenerateEvent::Started { cached, .. } = first else {
        panic!("restoring request: {first:?}");
    };
    assert!(
        waited >= Duration::from_millis(pause_ms * 8 / 10),
        "the restore waited for the paused pool ({waited:?})"
    );
    assert_eq!(cached.g4, 40 * BT, "the whole prefix came from G4");
    assert!(
        during >= 20,
        "only {during} tokens decoded in {waited:?} while the other request restored"
    );
    match restoring.recv_timeout(Duration::from_secs(60)).unwrap() {
        GenerateEvent::Token(t) => assert_eq!(t.token, want_first, "same first token as computed"),
        other => panic!("{other:?}"),
    }
    drop(decoding);
    drop(sched);
}
