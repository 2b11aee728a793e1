//! Graceful shutdown: SIGTERM lets a stream in flight finish, the process
//! exits 0, and the KV blocks it computed are on disk (G3) for the next
//! process, which restores them instead of recomputing.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod serve_process;

use std::io::{Read, Write};
use std::net::TcpStream;

use serde_json::json;
use serve_process::{STEP, Server, init_model, long_prompt, parse_response, streamed_text};

#[test]
fn sigterm_finishes_the_stream_in_flight_and_flushes_the_cache_to_g3() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    init_model(&root.join("tiny"), 3);
    let extra = ["--max-seq-tokens", "8192"];
    let mut s = Server::start_in(root, &extra);
    let prompt = long_prompt(300);

    // A long stream; SIGTERM as soon as its first token arrives.
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1000, "temperature": 0,
                      "stream": true, "stream_options": {"include_usage": true}})
    .to_string();
    let mut conn = TcpStream::connect(&s.addr).unwrap();
    conn.set_read_timeout(Some(STEP)).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        s.addr,
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while raw.windows(6).filter(|w| w == b"data: ").count() < 2 {
        let n = conn.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&raw)
        );
        raw.extend_from_slice(&buf[..n]);
    }
    s.signal("TERM");
    conn.read_to_end(&mut raw).unwrap();
    let resp = parse_response(&raw);
    let chunks = resp.sse_data();
    let usage = &chunks.last().unwrap()["usage"];
    assert!(
        usage["completion_tokens"].as_u64().unwrap() > 0,
        "{usage}: {}",
        s.stderr()
    );
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert!(finish == "length" || finish == "stop", "{finish}");
    if finish == "length" {
        assert_eq!(
            usage["completion_tokens"], 1000,
            "the stream ran to its end"
        );
    }
    assert!(!streamed_text(&chunks).is_empty() || usage["completion_tokens"] == 0);

    let status = s.wait();
    assert!(status.success(), "{status:?}; stderr:\n{}", s.stderr());
    let stderr = s.stderr();
    assert!(stderr.contains("shutting down"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    // A new process: G1 and G2 are empty, the prefix comes from G3.
    let mut s2 = Server::start_in(root, &extra);
    let r = s2.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["kvtier"]["cached_tokens"]["g3"], 299, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 299);
    assert!(v["kvtier"]["restored_bytes"].as_u64().unwrap() > 0, "{v}");
    let metrics = s2.get("/metrics").text();
    assert!(
        metrics.contains("kvtier_server_cached_prompt_tokens_total{tier=\"g3\"} 299"),
        "{metrics}"
    );
    // SIGINT stops it the same way.
    s2.signal("INT");
    let status = s2.wait();
    assert!(status.success(), "{status:?}; stderr:\n{}", s2.stderr());
}

/// Serves `prompt` once on a fresh server with `--g3-sync-ms sync_ms`, kills
/// it with SIGKILL `wait_ms` later, and returns the prompt tokens a restarted
/// server restores from G3.
fn g3_tokens_after_kill_9(sync_ms: &str, wait_ms: u64) -> u64 {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    init_model(&root.join("tiny"), 3);
    let prompt = long_prompt(300);
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0});
    let extra = ["--max-seq-tokens", "8192", "--g3-sync-ms", sync_ms];
    let mut s = Server::start_in(root, &extra);
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    std::thread::sleep(std::time::Duration::from_millis(wait_ms));
    s.signal("KILL");
    let status = s.wait();
    assert!(!status.success(), "{status:?}");

    let s2 = Server::start_in(root, &["--max-seq-tokens", "8192"]);
    let v = s2.post("/v1/completions", &body).json();
    v["kvtier"]["cached_tokens"]["g3"].as_u64().unwrap()
}

#[test]
fn kill_9_after_the_write_back_bound_loses_no_computed_block() {
    // Ten bounds after the answer: every full block of the prompt is on G3.
    assert_eq!(g3_tokens_after_kill_9("200", 2000), 299);
    // The control: without the bound, the blocks never left G2.
    assert_eq!(g3_tokens_after_kill_9("0", 2000), 0);
}
