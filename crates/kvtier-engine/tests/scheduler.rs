//! The scheduler serves concurrent requests with continuous batching and
//! gives each the same tokens it would get alone.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::sync::mpsc;
use std::time::Duration;

use kvtier_engine::serving::sampling::SamplingParams;
use kvtier_engine::serving::scheduler::{
    BatchConfig, FinishReason, GenerateEvent, GenerateRequest, Scheduler,
};
use kvtier_engine::{Engine, EngineOptions, Preset, write_preset};

fn engine(dir: &std::path::Path) -> Engine {
    let opts = EngineOptions {
        block_tokens: 16,
        pool_pages: 128,
        max_seq_tokens: 512,
        ..Default::default()
    };
    Engine::load(dir, opts, None).unwrap()
}

fn run_one(s: &Scheduler, prompt: Vec<u32>, max_tokens: usize) -> mpsc::Receiver<GenerateEvent> {
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

fn collect(rx: mpsc::Receiver<GenerateEvent>) -> (Vec<u32>, FinishReason) {
    let mut tokens = Vec::new();
    let first = rx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert!(matches!(first, GenerateEvent::Started { .. }), "{first:?}");
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            GenerateEvent::Token(t) => tokens.push(t.token),
            GenerateEvent::Finished {
                reason,
                completion_tokens,
            } => {
                assert_eq!(completion_tokens, tokens.len());
                return (tokens, reason);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn concurrent_requests_get_the_tokens_they_would_get_alone() {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 5, dir.path()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|s| (0..(20 + 7 * s)).map(|i| (i * 5 + s * 17) % 256).collect())
        .collect();
    let alone: Vec<Vec<u32>> = {
        let s = Scheduler::start(engine(dir.path()), BatchConfig::default()).unwrap();
        prompts
            .iter()
            .map(|p| collect(run_one(&s, p.clone(), 10)).0)
            .collect()
    };
    let s = Scheduler::start(
        engine(dir.path()),
        BatchConfig {
            max_batch: 4,
            max_wait: Duration::from_millis(20),
        },
    )
    .unwrap();
    let rxs: Vec<_> = prompts.iter().map(|p| run_one(&s, p.clone(), 10)).collect();
    for (rx, want) in rxs.into_iter().zip(&alone) {
        let (got, reason) = collect(rx);
        assert_eq!(&got, want);
        assert_eq!(reason, FinishReason::Length);
    }
    assert!(s.shutdown().is_some());
}

#[test]
fn stop_tokens_end_generation_and_bad_prompts_fail_alone() {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 6, dir.path()).unwrap();
    let s = Scheduler::start(engine(dir.path()), BatchConfig::default()).unwrap();
    let prompt: Vec<u32> = (0..30).collect();
    let (free, _) = collect(run_one(&s, prompt.clone(), 8));
    // Stop on the third generated token: only two are emitted.
    let (tx, rx) = mpsc::channel();
    s.submit(GenerateRequest {
        salt: Vec::new(),
        prompt: prompt.clone(),
        max_tokens: 8,
        sampling: SamplingParams::default(),
        stop_tokens: vec![free[2]],
        events: tx.into(),
    });
    let (stopped, reason) = collect(rx);
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(stopped, free[..stopped.len()].to_vec());
    assert!(stopped.len() <= 2);
    // An out-of-vocabulary prompt fails; the next request is served.
    let rx = run_one(&s, vec![100_000], 4);
    assert!(matches!(rx.recv().unwrap(), GenerateEvent::Failed(_)));
    let (ok, _) = collect(run_one(&s, prompt, 3));
    assert_eq!(ok, free[..3].to_vec());
}

#[test]
fn a_failed_decode_batch_leaves_every_sequence_retryable() {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, 7, dir.path()).unwrap();
    // 4 pages of 16 tokens: two 30-token prompts take 2 pages each, so the
    // next token of either needs a page the pool does not have.
    let opts = EngineOptions {
        block_tokens: 16,
        pool_pages: 4,
        max_seq_tokens: 512,
        prefix_reuse: false,
        ..Default::default()
    };
    let mut e = Engine::load(dir.path(), opts, None).unwrap();
    let a = e.prefill(&(0..32).collect::<Vec<u32>>()).unwrap();
    let b = e.prefill(&(40..72).collect::<Vec<u32>>()).unwrap();
    assert!(
        e.decode(&[(a.seq, 1), (b.seq, 2)]).is_err(),
        "no page left for position 32"
    );
    // Freeing one sequence makes room: the other decodes as if nothing failed.
    e.finish(b.seq);
    let l = e.decode(&[(a.seq, 1)]).unwrap();
    assert_eq!(l.len(), 1);
    let mut fresh = Engine::load(
        dir.path(),
        EngineOptions {
            block_tokens: 16,
            pool_pages: 8,
            max_seq_tokens: 512,
            prefix_reuse: false,
            ..Default::default()
        },
        None,
    )
    .unwrap();
    let fa = fresh.prefill(&(0..32).collect::<Vec<u32>>()).unwrap();
    let want = fresh.decode(&[(fa.seq, 1)]).unwrap();
    assert_eq!(l, want, "the failed batch left no trace in sequence a");
}
