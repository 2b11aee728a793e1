//! G4 across nodes: two servers with their own G2/G3 and one real
//! redis-server; a prefill on one node, decode on another; Redis killed in
//! the middle of a load.

#![allow(clippy::unwrap_used)]

mod server_support;

use std::time::{Duration, Instant};

use kvtier_server::{PrefillOptions, prefill};
use kvtier_store::RemoteConfig;
use kvtier_testkit::RedisServer;
use serde_json::{Value, json};
use server_support::*;

fn complete(s: &Server, prompt: &str) -> Value {
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn cached(v: &Value) -> (u64, u64) {
    (
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        v["kvtier"]["cached_tokens"]["g4"].as_u64().unwrap(),
    )
}

fn metric(s: &Server, name: &str) -> f64 {
    let text = s.get("/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
}

#[test]
fn a_prompt_served_by_one_server_is_restored_by_another_from_g4() {
    let redis = RedisServer::start().unwrap();
    let url = redis.url();
    let a = Server::start(|o| o.remote = remote(&url));
    let b_cache = a.root.join("cache-b");
    let b = Server::start_in(&a.root, |o| {
        o.remote = remote(&url);
        o.cache_dir = b_cache.clone();
    });

    let prompt = long_prompt(400);
    let from_a = complete(&a, &prompt);
    assert_eq!(cached(&from_a), (0, 0), "A computes it");
    // A writes its blocks through to G4 after the tokens went out; give
    // the background writers a moment, polling B's view through Redis.
    let deadline = Instant::now() + STEP;
    // 25 full blocks (prompt and output) and the prompt's tail.
    while redis.command(&[b"DBSIZE"]).unwrap().as_integer().unwrap() < 26 {
        assert!(Instant::now() < deadline, "A never wrote its blocks to G4");
        std::thread::sleep(Duration::from_millis(50));
    }
    let from_b = complete(&b, &prompt);
    let (total, g4) = cached(&from_b);
    // 400 tokens in 16-token blocks: 24 full blocks and the 15-token tail
    // before the last token.
    assert_eq!(g4, 399, "{from_b}");
    assert_eq!(total, g4);
    assert_eq!(text_of(&from_b), text_of(&from_a), "same greedy output");
    assert_eq!(metric(&b, "kvtier_store_hits_total{tier=\"g4\"}"), 25.0);
    assert_eq!(
        metric(&b, "kvtier_server_cached_prompt_tokens_total{tier=\"g4\"}"),
        399.0
    );
    // No password or URL trouble in the logs.
    assert!(a.log().contains(&url), "{}", a.log());
}

#[test]
fn prefill_on_one_node_leaves_the_kv_in_g4_for_the_decode_node() {
    let redis = RedisServer::start().unwrap();
    let url = redis.url();
    let dec = Server::start(|o| o.remote = remote(&url));
    let prompt = long_prompt(300);
    let mut opts = PrefillOptions::new(dec.root.join("tiny"), &prompt, RemoteConfig::new(&url));
    opts.block_tokens = 16;
    let report = serde_json::to_value(prefill(&opts).unwrap()).unwrap();
    assert_eq!(report["prompt_tokens"], 300);
    assert_eq!(report["computed_tokens"], 300);
    // 18 full 16-token blocks and the 11-token tail before the last token.
    assert_eq!(report["blocks"], 19);
    assert!(
        report["g4_blocks_written"].as_u64().unwrap() >= 19,
        "{report}"
    );
    assert_eq!(report["g4_dropped_blocks"], 0);

    let v = complete(&dec, &prompt);
    assert_eq!(cached(&v), (299, 299), "all but the last token: {v}");

    // The same prompt through the chat template is another token sequence.
    opts.chat = true;
    let report = prefill(&opts).unwrap();
    assert_eq!(report.g4_dropped_blocks, 0);
    let r = dec.post(
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(cached(&r.json()).1 > 0, "{}", r.text());
}

#[test]
fn a_coded_prefill_serves_a_decode_node_with_the_same_codec_only() {
    let redis = RedisServer::start().unwrap();
    let url = redis.url();
    let plain = Server::start(|o| o.remote = remote(&url));
    let coded_cache = plain.root.join("cache-int8");
    let coded = Server::start_in(&plain.root, |o| {
        o.remote = remote(&url);
        o.cache_dir = coded_cache.clone();
        o.kv_offload_codec = kvtier_store::KvCodec::Int8;
    });
    let prompt = long_prompt(300);
    let mut opts = PrefillOptions::new(plain.root.join("tiny"), &prompt, RemoteConfig::new(&url));
    opts.block_tokens = 16;
    opts.kv_offload_codec = kvtier_store::KvCodec::Int8;
    let report = prefill(&opts).unwrap();
    assert_eq!(report.g4_dropped_blocks, 0);
    // Coded KV is keyed apart: the uncoded node finds none of it.
    assert_eq!(cached(&complete(&plain, &prompt)), (0, 0));
    let v = complete(&coded, &prompt);
    assert_eq!(cached(&v), (299, 299), "all but the last token: {v}");
}

#[test]
fn killing_redis_mid_load_costs_hits_never_requests_and_hits_resume_after_restart() {
    let mut redis = RedisServer::start().unwrap();
    let url = redis.url();
    let pool = || {
        let mut rc = RemoteConfig::new(&url);
        rc.timeout = Duration::from_millis(500);
        Some(rc)
    };
    let a = Server::start(|o| o.remote = pool());
    let b_cache = a.root.join("cache-b");
    let b = Server::start_in(&a.root, |o| {
        o.remote = pool();
        o.cache_dir = b_cache.clone();
        o.g2_bytes = 0;
        o.g3_bytes = 0;
    });

    // A load of distinct long prompts against both servers; Redis dies in
    // the middle of it. Every request must still complete (recompute).
    let prompts: Vec<String> = (0..12)
        .map(|i| format!("session {i}: {}", long_prompt(200 + 8 * i)))
        .collect();
    let reference: Vec<String> = prompts.iter().map(|p| text_of(&complete(&a, p))).collect();
    for (i, p) in prompts.iter().enumerate() {
        if i == 4 {
            redis.kill();
        }
        let v = complete(&b, p);
        assert_eq!(text_of(&v), reference[i], "request {i} gave other tokens");
    }
    assert!(
        metric(&b, "kvtier_store_remote_errors_total")
            + metric(&b, "kvtier_store_remote_timeouts_total")
            > 0.0
    );
    assert_eq!(metric(&b, "kvtier_store_remote_breaker_open"), 1.0);

    // Redis comes back (empty): within a few breaker periods, blocks A
    // writes through are hits for B again.
    redis.restart().unwrap();
    let deadline = Instant::now() + STEP;
    let mut round = 0;
    loop {
        round += 1;
        let p = format!("after restart {round}: {}", long_prompt(300));
        complete(&a, &p);
        std::thread::sleep(Duration::from_millis(300));
        if cached(&complete(&b, &p)).1 > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "G4 hits never resumed");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(metric(&b, "kvtier_store_remote_breaker_open"), 0.0);
}
