//! The OpenAI API over real HTTP on 127.0.0.1: completions and chat,
//! streamed and not, usage with cached tokens, metrics, models, stop
//! strings, seeds, greedy determinism, log probabilities, sampling fields,
//! `/tokenize` and `/detokenize`.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod server_support;

use serde_json::{Value, json};
use server_support::{Server, long_prompt, streamed_text, text_of};

fn complete(s: &Server, body: Value) -> Value {
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn chat(s: &Server, body: Value) -> Value {
    let r = s.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn completion_returns_text_and_usage() {
    let s = Server::start(|_| ());
    let v = complete(
        &s,
        json!({"model": "tiny", "prompt": "Hello, kvtier", "max_tokens": 7, "temperature": 0}),
    );
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "tiny");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert!(v["created"].as_u64().unwrap() > 0);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert!(c["text"].is_string());
    assert!(
        c["finish_reason"] == "length" || c["finish_reason"] == "stop",
        "{v}"
    );
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], 13, "one token per byte: {v}");
    let done = u["completion_tokens"].as_u64().unwrap();
    assert!((1..=7).contains(&done), "{v}");
    if c["finish_reason"] == "length" {
        assert_eq!(done, 7);
    }
    assert_eq!(u["total_tokens"].as_u64().unwrap(), 13 + done);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    let k = &v["kvtier"];
    assert!(k["ttft_seconds"].as_f64().unwrap() > 0.0, "{v}");
    for tier in ["g1", "g2", "g3"] {
        assert_eq!(k["cached_tokens"][tier], 0, "{v}");
    }
    // A prompt of token ids and a one-element list work too.
    let ids: Vec<u32> = "Hello, kvtier".bytes().map(u32::from).collect();
    let by_ids = complete(
        &s,
        json!({"model": "tiny", "prompt": ids, "max_tokens": 7, "temperature": 0}),
    );
    let by_list = complete(
        &s,
        json!({"model": "tiny", "prompt": ["Hello, kvtier"], "max_tokens": 7, "temperature": 0}),
    );
    assert_eq!(text_of(&by_ids), text_of(&v));
    assert_eq!(text_of(&by_list), text_of(&v));
    // No model field: the served one.
    let anon = complete(
        &s,
        json!({"prompt": "Hello, kvtier", "max_tokens": 7, "temperature": 0}),
    );
    assert_eq!(text_of(&anon), text_of(&v));
}

#[test]
fn chat_stream_matches_the_non_streamed_reply() {
    let s = Server::start(|_| ());
    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say something."}]}
    ]);
    let whole = chat(
        &s,
        json!({"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(whole["object"], "chat.completion");
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let r = s.post(
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0,
                "stream": true, "stream_options": {"include_usage": true}}),
    );
    let chunks = r.sse_data();
    assert!(chunks.len() >= 3, "{chunks:?}");
    let id = chunks[0]["id"].clone();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert_eq!(c["id"], id, "one id per stream");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"].as_array().unwrap().len(), 0);
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(
            usage_chunk["usage"][field], whole["usage"][field],
            "{usage_chunk}"
        );
    }
    assert_eq!(
        usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"],
        whole["usage"]["prompt_tokens"].as_u64().unwrap() - 1,
        "the second request reuses all of the first one's prompt but its last token: {usage_chunk}"
    );
    assert!(usage_chunk["kvtier"]["ttft_seconds"].as_f64().unwrap() > 0.0);
    let last = &chunks[chunks.len() - 2];
    assert_eq!(
        last["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    for c in &chunks[..chunks.len() - 2] {
        assert!(c["choices"][0]["finish_reason"].is_null(), "{c}");
    }
    assert_eq!(streamed_text(&chunks), text_of(&whole));
}

#[test]
fn completion_stream_parses_as_sse() {
    let s = Server::start(|_| ());
    let body = json!({"model": "tiny", "prompt": "Stream me", "max_tokens": 12, "temperature": 0});
    let whole = complete(&s, body.clone());
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let chunks = s.post("/v1/completions", &sbody).sse_data();
    for c in &chunks {
        assert_eq!(c["object"], "text_completion", "{c}");
        assert!(c.get("usage").is_none(), "no usage unless asked: {c}");
    }
    let last = chunks.last().unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert_eq!(streamed_text(&chunks), text_of(&whole));
}

#[test]
fn repeated_long_prompt_reports_cached_tokens() {
    let s = Server::start(|_| ());
    let prompt = long_prompt(200);
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0});
    let first = complete(&s, body.clone());
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = complete(&s, body.clone());
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Token-granular reuse: every prompt token but the last, whose logits
    // must be computed (12 full 16-token blocks and 7 tokens of the 13th).
    assert_eq!(cached, 199, "{second}");
    assert_eq!(second["kvtier"]["cached_tokens"]["g1"], 199, "{second}");
    assert_eq!(text_of(&first), text_of(&second), "restored = recomputed");

    // Chat too, streamed, with the usage chunk.
    let messages = json!([{"role": "user", "content": long_prompt(150)}]);
    let req = json!({"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0,
                     "stream": true, "stream_options": {"include_usage": true}});
    s.post("/v1/chat/completions", &req).sse_data();
    let chunks = s.post("/v1/chat/completions", &req).sse_data();
    let usage = &chunks.last().unwrap()["usage"];
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 144,
        "{usage}"
    );

    let metrics = s.get("/metrics").text();
    let g1_line = metrics
        .lines()
        .find(|l| l.starts_with("kvtier_server_cached_prompt_tokens_total{tier=\"g1\"}"))
        .unwrap();
    let g1: u64 = g1_line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(g1 >= 192 + 144, "{g1_line}");
}

#[test]
fn metrics_show_ttft_histogram_and_store_series() {
    let s = Server::start(|_| ());
    complete(
        &s,
        json!({"model": "tiny", "prompt": "measure me", "max_tokens": 5, "temperature": 0}),
    );
    let r = s.get("/metrics");
    assert_eq!(r.status, 200);
    let text = r.text();
    for want in [
        "# TYPE kvtier_server_ttft_seconds histogram",
        "kvtier_server_ttft_seconds_bucket{le=",
        "kvtier_server_ttft_seconds_count 1",
        "kvtier_server_inter_token_seconds_count 4",
        "kvtier_server_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1",
        "kvtier_server_prompt_tokens_total 10",
        "kvtier_server_generated_tokens_total 5",
        "kvtier_server_cached_prompt_tokens_total{tier=\"g3\"} 0",
        "kvtier_store_hits_total{tier=\"g2\"}",
        "kvtier_store_capacity_bytes{tier=\"g3\"}",
        "kvtier_store_io_mode{tier=\"g3\"",
    ] {
        assert!(text.contains(want), "{want} missing from\n{text}");
    }
    // Prometheus text by default; OpenMetrics (ending in `# EOF`) when asked.
    assert!(!text.contains("# EOF"), "{text}");
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/plain; version=0.0.4")),
        "{:?}",
        r.headers
    );
}

#[test]
fn metrics_say_what_the_kv_cache_tiers_are() {
    // One tiny block of 16 tokens is 8 KiB of f32 KV: with its header, a
    // 12 KiB slot; G3's odd bytes are not a slot.
    let s = Server::start(|o| {
        o.pool_pages = Some(12);
        o.g2_bytes = 10 * 12288;
        o.g3_bytes = 20 * 12288 + 100;
        o.g3_sync = std::time::Duration::ZERO;
        o.eviction = kvtier_store::eviction::EvictionKind::Lru;
    });
    let text = s.get("/metrics").text();
    let info = |text: &str| {
        let lines: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with("kvtier_server_kv_cache_info{"))
            .map(str::to_string)
            .collect();
        assert_eq!(lines.len(), 1, "{text}");
        assert!(lines[0].ends_with("} 1"), "{}", lines[0]);
        lines[0].clone()
    };
    let line = info(&text);
    for want in [
        "block_tokens=\"16\"",
        "g1_pages=\"12\"",
        "prefix_reuse=\"true\"",
        "layerwise_restore=\"true\"",
        "store=\"true\"",
        "g2_bytes=\"122880\"",
        "block_bytes=\"12288\"",
        "g3_bytes=\"245760\"",
        "g3_slots=\"20\"",
        "g3_slot_bytes=\"12288\"",
        "g3_sync_ms=\"0\"",
        "eviction=\"lru\"",
        "admission=\"off\"",
        "writeback_max_bytes=\"268435456\"",
        "codec=\"none\"",
        "g4=\"none\"",
    ] {
        assert!(line.contains(want), "{want} missing from {line}");
    }
    drop(s);
    // No reuse: no store, whatever its sizes say.
    let s = Server::start(|o| {
        o.prefix_reuse = false;
        o.layerwise_restore = false;
    });
    let line = info(&s.get("/metrics").text());
    for want in [
        "prefix_reuse=\"false\"",
        "layerwise_restore=\"false\"",
        "store=\"false\"",
        "g2_bytes=\"0\"",
        "g3_slots=\"0\"",
    ] {
        assert!(line.contains(want), "{want} missing from {line}");
    }
}

#[test]
fn metrics_show_the_scheduler_queues_g1_pages_and_end_to_end_latency() {
    let s = Server::start(|o| o.pool_pages = Some(64));
    // Three blocks of 16 tokens and more: their pages stay cached in G1.
    complete(
        &s,
        json!({"model": "tiny", "prompt": long_prompt(60), "max_tokens": 3, "temperature": 0}),
    );
    complete(
        &s,
        json!({"model": "tiny", "prompt": "short", "max_tokens": 2, "temperature": 0}),
    );
    // The scheduler publishes its gauges at the top of each round, which
    // may come just after the client has its last token: wait (boundedly)
    // for the round that finds it idle.
    let idle = |t: &str| {
        ["queued", "restoring", "running"]
            .iter()
            .all(|st| metric(t, &format!("kvtier_server_sequences{{state=\"{st}\"}}")) == 0.0)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut text = s.get("/metrics").text();
    while !idle(&text) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        text = s.get("/metrics").text();
    }
    assert_eq!(metric(&text, "kvtier_server_request_seconds_count"), 2.0);
    // Idle: nothing queued, restoring or running; no page in use.
    for state in ["queued", "restoring", "running"] {
        let name = format!("kvtier_server_sequences{{state=\"{state}\"}}");
        assert_eq!(metric(&text, &name), 0.0, "{name}");
    }
    let page = |u: &str| metric(&text, &format!("kvtier_server_g1_pages{{use=\"{u}\"}}"));
    assert_eq!(page("in_use"), 0.0);
    assert!(
        page("cached") >= 3.0,
        "the long prompt's blocks are cached in G1"
    );
    assert_eq!(page("in_use") + page("cached") + page("free"), 64.0);
}

#[test]
fn a_restart_reads_g3_from_its_saved_index_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    server_support::init_model(&tmp.path().join("tiny"), 0);
    let mut a = Server::start_in(tmp.path(), |_| ());
    // A fresh cache directory has nothing to trust: every slot is scanned.
    assert!(
        a.log().contains("G3 index: every slot scanned"),
        "{}",
        a.log()
    );
    complete(
        &a,
        json!({"model": "tiny", "prompt": long_prompt(80), "max_tokens": 2, "temperature": 0}),
    );
    a.shutdown();
    let b = Server::start_in(tmp.path(), |_| ());
    let log = b.log();
    let blocks: usize = log
        .split("G3 index: ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no G3 index count in {log}"));
    assert!(blocks >= 5, "{log}");
    assert!(
        log.contains("blocks from its checkpoint and 0 journal records"),
        "{log}"
    );
}

#[test]
fn models_and_health() {
    let s = Server::start(|_| ());
    let v = s.get("/v1/models").json();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    assert_eq!(data[0]["id"], "tiny", "named after the model directory");
    assert_eq!(data[0]["object"], "model");
    assert_eq!(data[0]["max_model_len"], 512);
    assert_eq!(s.get("/v1/models/tiny").json()["id"], "tiny");
    let h = s.get("/health");
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");

    let named = Server::start(|o| o.model_name = Some("my-model".into()));
    assert_eq!(named.get("/v1/models").json()["data"][0]["id"], "my-model");
    let r = named.post(
        "/v1/completions",
        &json!({"model": "my-model", "prompt": "hi", "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A stop string taken from the middle of the unconstrained output, made of
/// whole characters other than the replacement character.
fn stop_from(text: &str) -> Option<(String, String)> {
    let chars: Vec<char> = text.chars().collect();
    (4..chars.len().saturating_sub(3)).find_map(|i| {
        let stop: String = chars[i..i + 2].iter().collect();
        if stop.contains('\u{FFFD}') {
            return None;
        }
        let at = text.find(&stop)?;
        Some((stop, text[..at].to_string()))
    })
}

#[test]
fn stop_strings_truncate_the_output() {
    let s = Server::start(|_| ());
    let body = json!({"model": "tiny", "prompt": "Tell me a long story.", "max_tokens": 60,
                      "temperature": 0});
    let free = text_of(&complete(&s, body.clone()));
    let (stop, want) = stop_from(&free).unwrap_or_else(|| panic!("no usable stop in {free:?}"));

    let mut with_stop = body.clone();
    with_stop["stop"] = json!([stop.clone(), "never-appears-xyz"]);
    let v = complete(&s, with_stop.clone());
    assert_eq!(text_of(&v), want, "stop {stop:?} in {free:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 60);

    with_stop["stream"] = json!(true);
    let chunks = s.post("/v1/completions", &with_stop).sse_data();
    assert_eq!(streamed_text(&chunks), want);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );

    // A single string works too, in chat as well.
    let cbody = json!({"model": "tiny", "messages": [{"role": "user", "content": "Go on."}],
                       "max_tokens": 60, "temperature": 0});
    let cfree = text_of(&chat(&s, cbody.clone()));
    if let Some((cstop, cwant)) = stop_from(&cfree) {
        let mut b = cbody.clone();
        b["stop"] = json!(cstop);
        let v = chat(&s, b);
        assert_eq!(text_of(&v), cwant);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
}

#[test]
fn seed_makes_sampling_reproducible() {
    let s = Server::start(|_| ());
    let body = |seed: u64| {
        json!({"model": "tiny", "prompt": "Sample with a seed", "max_tokens": 32,
               "temperature": 1.0, "top_p": 0.95, "seed": seed})
    };
    let a = text_of(&complete(&s, body(7)));
    let b = text_of(&complete(&s, body(7)));
    let c = text_of(&complete(&s, body(8)));
    assert_eq!(a, b, "same seed, same text");
    assert_ne!(a, c, "another seed, other text");
    let chunks = s
        .post("/v1/completions", &{
            let mut v = body(7);
            v["stream"] = json!(true);
            v
        })
        .sse_data();
    assert_eq!(streamed_text(&chunks), a, "streaming samples the same");
}

#[test]
fn greedy_output_is_identical_across_requests_and_without_prefix_reuse() {
    let s = Server::start(|_| ());
    let body = json!({"model": "tiny", "prompt": long_prompt(100), "max_tokens": 40,
                      "temperature": 0});
    let a = complete(&s, body.clone());
    let b = complete(&s, body.clone());
    assert_eq!(text_of(&a), text_of(&b));
    assert!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    let off = Server::start(|o| o.prefix_reuse = false);
    let c = complete(&off, body.clone());
    let d = complete(&off, body);
    assert_eq!(text_of(&c), text_of(&a), "recompute = reuse");
    assert_eq!(d["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[test]
fn concurrent_clients_all_get_their_greedy_reply() {
    let s = Server::start(|o| o.max_batch = 4);
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("client {i}: {}", long_prompt(40 + i)))
        .collect();
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            text_of(&complete(
                &s,
                json!({"model": "tiny", "prompt": p, "max_tokens": 20, "temperature": 0}),
            ))
        })
        .collect();
    let together: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let s = &s;
                scope.spawn(move || {
                    let body = json!({"model": "tiny", "prompt": p, "max_tokens": 20,
                                      "temperature": 0, "stream": i % 2 == 0});
                    let r = s.post("/v1/completions", &body);
                    if i % 2 == 0 {
                        streamed_text(&r.sse_data())
                    } else {
                        assert_eq!(r.status, 200, "{}", r.text());
                        text_of(&r.json())
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
}

#[test]
fn a_client_that_goes_away_mid_stream_ends_its_sequence() {
    use std::io::{Read, Write};

    let s = Server::start(|o| o.max_seq_tokens = 8192);
    let body = json!({"model": "tiny", "prompt": "Go on forever.", "max_tokens": 8000,
                      "temperature": 0, "stream": true})
    .to_string();
    {
        let mut conn = std::net::TcpStream::connect(&s.addr).unwrap();
        write!(
            conn,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut buf = [0u8; 1024];
        assert!(conn.read(&mut buf).unwrap() > 0);
    }
    let t0 = std::time::Instant::now();
    loop {
        let m = s.get("/metrics").text();
        if metric(&m, "kvtier_server_requests_in_flight") == 0.0 {
            let generated = metric(&m, "kvtier_server_generated_tokens_total");
            assert!(generated < 8000.0, "the sequence ran on: {generated}");
            break;
        }
        assert!(t0.elapsed().as_secs() < 60, "the stream was never ended");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    s.assert_serves();
}

/// A log probability is a number at most 0.
fn logprob(v: &Value) -> f64 {
    let l = v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"));
    assert!(l <= 0.0, "{l}");
    l
}

#[test]
fn completion_logprobs_have_openai_shape_and_name_tokens_by_id_on_request() {
    // Without prefix reuse every request computes its prompt the same way,
    // so the values below compare bit for bit. (With it, a repeat computes
    // the prompt's last token in the decode step, whose sums run in another
    // order than the prefill's matmul: equal within rounding, checked in
    // `repeated_logprobs_agree_within_rounding_through_prefix_reuse`.)
    let s = Server::start(|o| o.prefix_reuse = false);
    let body = json!({"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0,
                      "logprobs": 3, "ignore_eos": true, "return_tokens_as_token_ids": true});
    let v = complete(&s, body.clone());
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 5, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    for i in 0..5 {
        let name = tokens[i].as_str().unwrap();
        let id: u32 = name.strip_prefix("token_id:").unwrap().parse().unwrap();
        assert!(id < 260, "{name}");
        let chosen = logprob(&lp["token_logprobs"][i]);
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(
            top.len(),
            3,
            "greedy: the chosen token is among the top 3: {top:?}"
        );
        // Greedy: the chosen token is the most likely one.
        let best = top.values().map(logprob).fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(chosen, best);
        assert_eq!(top[name].as_f64(), Some(chosen));
    }
    // Named by their text: the same values, offsets counting characters.
    let mut by_text = body.clone();
    by_text["return_tokens_as_token_ids"] = json!(false);
    let w = complete(&s, by_text);
    let lp2 = &w["choices"][0]["logprobs"];
    assert_eq!(lp2["token_logprobs"], lp["token_logprobs"]);
    let mut offset = 0;
    for (i, t) in lp2["tokens"].as_array().unwrap().iter().enumerate() {
        assert_eq!(lp2["text_offset"][i], offset);
        offset += t.as_str().unwrap().chars().count();
    }
    // Streamed: the chunks' logprobs add up to the same.
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let chunks = s.post("/v1/completions", &streamed).sse_data();
    let got: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(Value::Array(got), lp["token_logprobs"]);
}

#[test]
fn repeated_logprobs_agree_within_rounding_through_prefix_reuse() {
    let s = Server::start(|_| ());
    let body = json!({"model": "tiny", "prompt": long_prompt(30), "max_tokens": 6,
                      "temperature": 0, "logprobs": 2, "ignore_eos": true});
    let a = complete(&s, body.clone());
    let b = complete(&s, body);
    assert!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let (la, lb) = (&a["choices"][0]["logprobs"], &b["choices"][0]["logprobs"]);
    assert_eq!(la["tokens"], lb["tokens"]);
    let values = |l: &Value| -> Vec<f64> {
        l["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(logprob)
            .collect()
    };
    let (va, vb) = (values(la), values(lb));
    assert_eq!(va.len(), 6);
    for (x, y) in va.iter().zip(&vb) {
        assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{va:?} vs {vb:?}");
    }
}

#[test]
fn chat_logprobs_list_each_token_with_its_alternatives() {
    let s = Server::start(|_| ());
    let v = chat(
        &s,
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
               "temperature": 0, "logprobs": true, "top_logprobs": 2, "ignore_eos": true}),
    );
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4, "{v}");
    for e in content {
        let chosen = logprob(&e["logprob"]);
        let tops = e["top_logprobs"].as_array().unwrap();
        assert_eq!(tops.len(), 2);
        assert!(logprob(&tops[0]["logprob"]) >= logprob(&tops[1]["logprob"]));
        assert!(
            (chosen - logprob(&tops[0]["logprob"])).abs() < 1e-6,
            "greedy picks the top"
        );
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(bytes, e["token"].as_str().unwrap().as_bytes());
    }
    // Without logprobs: null.
    let v = chat(
        &s,
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    );
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[test]
fn logit_bias_and_echo_shape_the_output() {
    let s = Server::start(|_| ());
    // +100 on the token of "z" (the tiny tokenizer has one token per byte):
    // greedy picks it every time.
    let z = u32::from(b'z');
    let v = complete(
        &s,
        json!({"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0,
               "logit_bias": {z.to_string(): 100}, "ignore_eos": true}),
    );
    assert_eq!(text_of(&v), "zzzzzz", "{v}");
    // A penalty on repeats moves greedy away from the biased token after it
    // was generated (frequency 2 per repeat against a +5 bias).
    let v = complete(
        &s,
        json!({"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0,
               "logit_bias": {z.to_string(): 5}, "frequency_penalty": 2.0,
               "presence_penalty": 2.0, "ignore_eos": true}),
    );
    let text = text_of(&v);
    assert!(
        text.starts_with('z') && text.matches('z').count() < 4,
        "{text}"
    );
    // echo: the prompt, then the generated text.
    let plain = complete(
        &s,
        json!({"model": "tiny", "prompt": "Hello", "max_tokens": 3,
                                    "temperature": 0}),
    );
    let echoed = complete(
        &s,
        json!({"model": "tiny", "prompt": "Hello", "max_tokens": 3,
                                     "temperature": 0, "echo": true}),
    );
    assert_eq!(text_of(&echoed), format!("Hello{}", text_of(&plain)));
    // top_k 1 at any temperature is greedy.
    let topk = complete(
        &s,
        json!({"model": "tiny", "prompt": "Hello", "max_tokens": 3,
                                   "temperature": 1.5, "top_k": 1, "seed": 9}),
    );
    assert_eq!(text_of(&topk), text_of(&plain));
}

#[test]
fn tokenize_and_detokenize_as_the_generating_endpoints_see_prompts() {
    let s = Server::start(|_| ());
    let r = s.post("/tokenize", &json!({"model": "tiny", "prompt": "hi"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["tokens"], json!([104, 105]));
    assert_eq!(v["count"], 2);
    assert_eq!(v["max_model_len"], 512);
    // A conversation through the preset's ChatML template, as the chat
    // endpoint renders it; the completion reports the same prompt length.
    let messages = json!([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]);
    let v = s.post("/tokenize", &json!({"messages": messages})).json();
    let ids: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let text = s.post("/detokenize", &json!({"tokens": ids})).json()["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(text, "system\nS\nuser\nhi\nassistant\n", "specials skipped");
    assert_eq!(ids[0], 258, "<|im_start|>");
    let reply = chat(&s, json!({"messages": messages, "max_tokens": 1}));
    assert_eq!(reply["usage"]["prompt_tokens"], v["count"]);
    let v2 = s
        .post(
            "/tokenize",
            &json!({"messages": messages, "add_generation_prompt": false}),
        )
        .json();
    assert_eq!(
        v2["count"].as_u64().unwrap() + 11,
        v["count"].as_u64().unwrap(),
        "the generation prompt is <|im_start|> and the 10 bytes of \"assistant\\n\""
    );
    // Bad input: both or neither, ids outside the vocabulary.
    s.post("/tokenize", &json!({"prompt": "a", "messages": messages}))
        .assert_error(400, Some("prompt"));
    s.post("/tokenize", &json!({}))
        .assert_error(400, Some("prompt"));
    s.post("/detokenize", &json!({"tokens": [1, 99999]}))
        .assert_error(400, Some("tokens"));
    s.post("/detokenize", &json!({"tokens": [-1]}))
        .assert_error(400, Some("tokens"));
}
