//! The crash campaign: 20 rounds of `kill -9` of a `kvtier serve` at
//! varying moments while it answers prompts and writes KV back, each round
//! restarting on the same cache directory. After every restart:
//!
//! * every answer equals a fresh server's that never caches (greedy);
//! * every prompt answered more than ten write-back bounds before the kill
//!   is restored from G3 in full (all its full blocks);
//! * no block on disk failed verification (`corrupt_blocks` stays 0).
//!
//! The moments of the kills follow a fixed seed, so a failure reruns the
//! same campaign. The counts are printed (run with `--nocapture`).

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod serve_process;

use std::time::Duration;

use serde_json::{Value, json};
use serve_process::{Server, init_model, long_prompt};

const ROUNDS: usize = 20;
const PROMPTS: usize = 6;
const SYNC_MS: u64 = 100;

fn prompt(i: usize) -> String {
    format!("session {i}: {}", long_prompt(250 + 40 * i))
}

fn ask(s: &Server, i: usize) -> Value {
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt(i), "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn metric(s: &Server, line_start: &str) -> f64 {
    let text = s.get("/metrics").text();
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line_start} missing from\n{text}"))
}

#[test]
fn twenty_kill_9s_never_change_an_answer_or_lose_a_block_older_than_the_bound() {
    // The reference: a server that never caches.
    let reference_root = tempfile::tempdir().unwrap();
    init_model(&reference_root.path().join("tiny"), 5);
    let reference = Server::start_in(reference_root.path(), &["--no-prefix-reuse"]);
    let want: Vec<(String, u64)> = (0..PROMPTS)
        .map(|i| {
            let v = ask(&reference, i);
            let text = v["choices"][0]["text"].as_str().unwrap().to_string();
            (text, v["usage"]["prompt_tokens"].as_u64().unwrap())
        })
        .collect();
    drop(reference);

    let root = tempfile::tempdir().unwrap();
    init_model(&root.path().join("tiny"), 5);
    let sync = SYNC_MS.to_string();
    let extra = ["--g3-sync-ms", sync.as_str()];
    let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut answers, mut full_hits) = (0usize, 0usize);
    let mut settled: Option<usize> = None;
    for round in 0..ROUNDS {
        let mut s = Server::start_in(root.path(), &extra);
        // The prompt answered long before the last kill is on G3 in full.
        if let Some(i) = settled {
            let v = ask(&s, i);
            // Every prompt token but the last: full blocks and the tail.
            let full = want[i].1 - 1;
            assert_eq!(
                v["kvtier"]["cached_tokens"]["g3"].as_u64(),
                Some(full),
                "round {round}: prompt {i}, answered ten bounds before the kill, not restored in full: {v}"
            );
            assert_eq!(
                v["choices"][0]["text"].as_str(),
                Some(want[i].0.as_str()),
                "round {round}: restored prompt {i} answered differently from a fresh server: {v}"
            );
            answers += 1;
            full_hits += 1;
        }
        let a = (next() % PROMPTS as u64) as usize;
        let b = (a + 1 + (next() % (PROMPTS as u64 - 1)) as usize) % PROMPTS;
        for i in [a, b] {
            let v = ask(&s, i);
            assert_eq!(
                v["choices"][0]["text"].as_str(),
                Some(want[i].0.as_str()),
                "round {round}: prompt {i} answered differently from a fresh server: {v}"
            );
            answers += 1;
            if i == a {
                // Ten bounds: prompt `a`'s blocks must reach G3.
                std::thread::sleep(Duration::from_millis(10 * SYNC_MS));
            }
        }
        assert_eq!(
            metric(&s, "kvtier_store_corrupt_blocks_total{tier=\"g3\"}"),
            0.0,
            "round {round}: a block on disk failed verification"
        );
        // Kill while prompt b's blocks may be in flight to G3.
        std::thread::sleep(Duration::from_millis(next() % (2 * SYNC_MS)));
        s.signal("KILL");
        let status = s.wait();
        assert!(!status.success(), "round {round}: {status:?}");
        settled = Some(a);
    }
    println!(
        "crash campaign: {ROUNDS} kill -9 rounds, {answers} answers equal to a fresh server's, \
         {full_hits} prompts restored in full from G3 after a kill, 0 corrupt blocks"
    );
    assert_eq!(full_hits, ROUNDS - 1);
}
