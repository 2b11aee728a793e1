//! The OpenAI-compatible endpoint target over real HTTP on 127.0.0.1.
//!
//! kvtier's own server lives in the binary crate, which this crate cannot
//! depend on, so the peer here is a small std `TcpListener` server that
//! answers `GET /v1/models` and streams canned server-sent events the way
//! kvtier serve, vLLM and llama.cpp do (chunked transfer encoding). It is a
//! test peer only: the client side (ureq, the SSE reader, the timing) is the
//! real code.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtier_bench::cold_recovery::workload::Session;
use kvtier_bench::reporting::report::{MachineInfo, TierTokens};
use kvtier_bench::targets::endpoint::{Endpoint, EndpointOptions};
use kvtier_bench::targets::target::Target;
use kvtier_bench::{ColdRecoveryConfig, Gates, Hooks, Mode, RunOptions, run_cold_recovery};
use kvtier_energy::{CostModel, MeterOptions};
use serde_json::{Value, json};

/// How the peer answers the `n`-th completion (numbered from 0).
type Handler = dyn Fn(usize, &Value, &mut TcpStream) + Send + Sync;

/// A tiny HTTP/1.1 server on 127.0.0.1 (one thread per connection, every
/// response `Connection: close`). Stops when dropped.
struct Peer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    bodies: Arc<Mutex<Vec<Value>>>,
    accept: Option<JoinHandle<()>>,
}

impl Peer {
    fn start(handler: impl Fn(usize, &Value, &mut TcpStream) + Send + Sync + 'static) -> Peer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let handler: Arc<Handler> = Arc::new(handler);
        let count = Arc::new(AtomicUsize::new(0));
        let accept = {
            let (stop, bodies) = (stop.clone(), bodies.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let (handler, bodies, count) = (handler.clone(), bodies.clone(), count.clone());
                    std::thread::spawn(move || serve(conn, &*handler, &bodies, &count));
                }
            })
        };
        Peer {
            addr,
            stop,
            bodies,
            accept: Some(accept),
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn serve(mut conn: TcpStream, handler: &Handler, bodies: &Mutex<Vec<Value>>, count: &AtomicUsize) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
        return;
    }
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    if request_line.starts_with("GET /v1/models ") {
        let list = json!({"object": "list", "data": [
            {"id": "tiny", "object": "model"}, {"id": "other", "object": "model"}
        ]});
        respond(&mut conn, "200 OK", &list.to_string());
    } else if request_line.starts_with("POST /v1/completions ") {
        let body: Value = serde_json::from_slice(&body).unwrap();
        bodies.lock().unwrap().push(body.clone());
        let n = count.fetch_add(1, Ordering::SeqCst);
        handler(n, &body, &mut conn);
    } else {
        respond(
            &mut conn,
            "404 Not Found",
            r#"{"error":{"message":"no route"}}"#,
        );
    }
}

fn respond(conn: &mut TcpStream, status: &str, body: &str) {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(body.as_bytes());
}

fn sse_head(conn: &mut TcpStream) {
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    conn.write_all(head.as_bytes()).unwrap();
}

/// Sends one event as one HTTP chunk.
fn sse_event(conn: &mut TcpStream, data: &str) {
    let payload = format!("data: {data}\n\n");
    let _ = conn.write_all(format!("{:x}\r\n{payload}\r\n", payload.len()).as_bytes());
    let _ = conn.flush();
}

fn sse_end(conn: &mut TcpStream) {
    let _ = conn.write_all(b"0\r\n\r\n");
}

fn text_chunk(text: &str, finish: Option<&str>) -> String {
    json!({"id": "cmpl-1", "object": "text_completion", "model": "tiny",
        "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}]})
    .to_string()
}

/// What a good stream carries after its text.
#[derive(Clone, Copy)]
enum Usage {
    /// No usage chunk (the server ignores `include_usage`).
    None,
    /// OpenAI's usage with `cached_tokens`.
    OpenAi,
    /// Usage plus kvtier's per-tier object.
    Kvtier,
}

const PIECES: [&str; 3] = ["Hello", " wor", "ld!"];
const DELAY: Duration = Duration::from_millis(40);

/// An empty first chunk, then each piece after `DELAY`, a finish chunk, the
/// usage chunk when asked for, then `[DONE]`.
fn good_stream(conn: &mut TcpStream, body: &Value, usage: Usage) {
    sse_head(conn);
    std::thread::sleep(DELAY);
    sse_event(conn, &text_chunk("", None));
    for p in PIECES {
        std::thread::sleep(DELAY);
        sse_event(conn, &text_chunk(p, None));
    }
    sse_event(conn, &text_chunk("", Some("length")));
    let wants_usage = body["stream_options"]["include_usage"] == json!(true);
    let usage_obj = json!({"prompt_tokens": 123, "completion_tokens": 4, "total_tokens": 127,
        "prompt_tokens_details": {"cached_tokens": 96}});
    match usage {
        Usage::None => {}
        _ if !wants_usage => {}
        Usage::OpenAi => sse_event(
            conn,
            &json!({"choices": [], "usage": usage_obj}).to_string(),
        ),
        Usage::Kvtier => sse_event(
            conn,
            &json!({"choices": [], "usage": usage_obj, "kvtier": {
                "cached_tokens": {"g1": 16, "g2": 32, "g3": 48},
                "ttft_seconds": 0.01, "engine_ttft_seconds": 0.009, "restored_bytes": 65536}})
            .to_string(),
        ),
    }
    sse_event(conn, "[DONE]");
    sse_end(conn);
}

/// One piece of text, then the connection is dropped.
fn cut_stream(conn: &mut TcpStream) {
    sse_head(conn);
    sse_event(conn, &text_chunk("Hel", None));
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

fn session(id: usize) -> Session {
    Session {
        id,
        text: format!("System: a shared prefix. Session {id} history: words words words."),
    }
}

#[test]
fn an_unreachable_endpoint_is_an_error_at_new() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let t = Instant::now();
    let e = Endpoint::new(&format!("http://127.0.0.1:{port}"), "tiny").unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    let msg = e.to_string();
    assert!(
        msg.contains("not reachable") && msg.contains(&port.to_string()),
        "{msg}"
    );
}

#[test]
fn bad_urls_and_unknown_models_are_errors_at_new() {
    let peer = Peer::start(|_, _, conn| respond(conn, "500 Internal Server Error", "{}"));
    let e = Endpoint::new(&peer.url(), "missing")
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing") && e.contains("tiny, other"), "{e}");
    assert!(
        Endpoint::new("https://127.0.0.1:1", "tiny")
            .unwrap_err()
            .to_string()
            .contains("https")
    );
    assert!(Endpoint::new("127.0.0.1:1", "tiny").is_err());
    // An empty model takes the first served one; a /v1 suffix is accepted.
    let ep = Endpoint::new(&format!("{}/v1/", peer.url()), "").unwrap();
    assert_eq!(ep.model(), "tiny");
    assert_eq!(ep.base_url(), peer.url());
}

#[test]
fn a_good_stream_times_ttft_before_e2e_and_takes_counts_from_usage() {
    let peer = Peer::start(|_, body, conn| good_stream(conn, body, Usage::Kvtier));
    let mut ep = Endpoint::new(&peer.url(), "tiny").unwrap();
    ep.begin(Mode::Baseline, true).unwrap();
    let s = session(3);
    let rec = ep.request(&s, 7);
    assert_eq!(rec.error, None);
    assert_eq!(rec.session, 3);
    // The first chunk is empty: TTFT waits for the first text, two delays in.
    assert!(rec.ttft_s >= 2.0 * DELAY.as_secs_f64(), "{rec:?}");
    assert!(rec.ttft_s < rec.e2e_s, "{rec:?}");
    assert!(rec.e2e_s >= 4.0 * DELAY.as_secs_f64(), "{rec:?}");
    assert_eq!(
        rec.output_tokens, 4,
        "usage.completion_tokens, not the 3 chunks"
    );
    assert_eq!(rec.prompt_tokens, 123);
    assert_eq!(
        rec.hit_tokens,
        TierTokens {
            g1: 16,
            g2: 32,
            g3: 48,
            g4: 0
        }
    );
    assert_eq!(rec.restored_bytes, 65536);
    ep.end().unwrap();

    let sent = peer.bodies();
    assert_eq!(sent.len(), 1);
    let b = &sent[0];
    assert_eq!(b["model"], "tiny");
    assert_eq!(b["prompt"], s.text.as_str());
    assert_eq!(b["max_tokens"], 7);
    assert_eq!(b["temperature"], 0);
    assert_eq!(b["stream"], true);
    assert_eq!(b["stream_options"]["include_usage"], true);
    assert!(ep.describe().contains(&peer.url()) && ep.describe().contains("as-is"));
}

#[test]
fn without_usage_chunks_are_counted_and_cached_tokens_go_to_g1() {
    let peer = Peer::start(|n, body, conn| {
        good_stream(conn, body, if n == 0 { Usage::None } else { Usage::OpenAi })
    });
    let ep = Endpoint::new(&peer.url(), "tiny").unwrap();
    let s = session(0);
    let bare = ep.request(&s, 8);
    assert_eq!(bare.error, None);
    assert_eq!(bare.output_tokens, PIECES.len());
    assert_eq!(bare.prompt_tokens, s.text.len().div_ceil(4), "estimated");
    assert_eq!(bare.prompt_tokens, ep.count_tokens(&s.text));
    assert_eq!(bare.hit_tokens, TierTokens::default());
    let openai = ep.request(&s, 8);
    assert_eq!(openai.error, None);
    assert_eq!((openai.output_tokens, openai.prompt_tokens), (4, 123));
    assert_eq!(
        openai.hit_tokens,
        TierTokens {
            g1: 96,
            g2: 0,
            g3: 0,
            g4: 0
        },
        "unknown tier: G1"
    );
}

#[test]
fn a_connection_closed_mid_stream_is_a_failed_record_not_a_panic() {
    let peer = Peer::start(|_, _, conn| cut_stream(conn));
    let ep = Endpoint::new(&peer.url(), "tiny").unwrap();
    let rec = ep.request(&session(1), 8);
    let e = rec.error.expect("a cut stream must fail");
    assert!(e.contains("stream"), "{e}");
    assert_eq!(rec.session, 1);
}

#[test]
fn http_errors_and_streamed_errors_are_failed_records() {
    let peer = Peer::start(|n, _, conn| {
        if n == 0 {
            respond(
                conn,
                "500 Internal Server Error",
                r#"{"error":{"message":"out of pages"}}"#,
            );
        } else {
            sse_head(conn);
            sse_event(
                conn,
                r#"{"error":{"message":"engine failed","type":"server_error"}}"#,
            );
            sse_event(conn, "[DONE]");
            sse_end(conn);
        }
    });
    let ep = Endpoint::new(&peer.url(), "tiny").unwrap();
    let e = ep.request(&session(0), 8).error.unwrap();
    assert!(e.contains("500") && e.contains("out of pages"), "{e}");
    let e = ep.request(&session(0), 8).error.unwrap();
    assert!(e.contains("engine failed"), "{e}");
}

#[test]
fn a_stalled_stream_times_out_into_a_failed_record() {
    let peer = Peer::start(|_, _, conn| {
        sse_head(conn);
        sse_event(conn, &text_chunk("Hel", None));
        std::thread::sleep(Duration::from_secs(3));
    });
    let opts = EndpointOptions {
        request_timeout: Duration::from_millis(400),
        ..Default::default()
    };
    let ep = Endpoint::with_options(&peer.url(), "tiny", opts).unwrap();
    let t = Instant::now();
    let rec = ep.request(&session(0), 8);
    assert!(rec.error.is_some(), "{rec:?}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn a_run_whose_requests_fail_mid_run_finishes_and_counts_them() {
    // Pass 1 (2 sessions) succeeds; afterwards every other request is cut.
    let peer = Peer::start(|n, body, conn| {
        if n >= 2 && n % 2 == 1 {
            cut_stream(conn);
        } else {
            good_stream(conn, body, Usage::OpenAi);
        }
    });
    let mut ep = Endpoint::new(&peer.url(), "tiny").unwrap();
    let run = RunOptions {
        workload: ColdRecoveryConfig {
            sessions: 2,
            shared_tokens: 16,
            history_tokens: 32,
            question_tokens: 4,
            max_tokens: 4,
            concurrency: vec![1, 2],
            evict_g2: true,
            seed: 3,
            ..Default::default()
        },
        gates: Gates::default(),
        cost: CostModel::default(),
        meter: MeterOptions::default(),
        progress: false,
    };
    let mut limit = || Ok(1.0);
    let mut drop_cache = || true;
    let hooks = Hooks {
        device_limit: &mut limit,
        drop_page_cache: &mut drop_cache,
    };
    let report = run_cold_recovery(&mut ep, &run, hooks, MachineInfo::default()).unwrap();
    assert_eq!(report.results.len(), 4);
    for r in &report.results {
        assert_eq!((r.requests, r.failed), (1, 1), "one of each per run: {r:?}");
        assert_eq!(r.samples.len(), 2);
        assert!(r.samples.iter().any(|s| s.error.is_some()));
        assert!(r.throughput_tok_s > 0.0);
    }
    assert!(report.target.contains("OpenAI-compatible endpoint"));
    assert_eq!(peer.bodies().len(), 2 + 4 * 2);
}

#[test]
fn a_baseline_endpoint_gets_the_baseline_runs_and_nothing_else() {
    use kvtier_bench::targets::endpoint_pair::EndpointPair;
    let kv = Peer::start(|_, body, conn| good_stream(conn, body, Usage::OpenAi));
    let base = Peer::start(|_, body, conn| good_stream(conn, body, Usage::OpenAi));
    let mut pair = EndpointPair::new(
        Endpoint::new(&base.url(), "other").unwrap(),
        Endpoint::new(&kv.url(), "tiny").unwrap(),
    );
    let run = RunOptions {
        workload: ColdRecoveryConfig {
            sessions: 2,
            shared_tokens: 16,
            history_tokens: 32,
            question_tokens: 4,
            max_tokens: 4,
            concurrency: vec![1, 2],
            evict_g2: true,
            seed: 3,
            ..Default::default()
        },
        gates: Gates::default(),
        cost: CostModel::default(),
        meter: MeterOptions::default(),
        progress: false,
    };
    let mut limit = || Ok(1.0);
    let mut drop_cache = || true;
    let hooks = Hooks {
        device_limit: &mut limit,
        drop_page_cache: &mut drop_cache,
    };
    let report = run_cold_recovery(&mut pair, &run, hooks, MachineInfo::default()).unwrap();
    assert_eq!(report.results.len(), 4);
    assert!(report.results.iter().all(|r| r.failed == 0));
    // The filling pass (2) and two kvtier runs of 2 sessions go to the
    // kvtier server; two baseline runs of 2 to the baseline server, each
    // with its own model name.
    let (kv_bodies, base_bodies) = (kv.bodies(), base.bodies());
    assert_eq!(kv_bodies.len(), 2 + 2 * 2);
    assert_eq!(base_bodies.len(), 2 * 2);
    assert!(kv_bodies.iter().all(|b| b["model"] == json!("tiny")));
    assert!(base_bodies.iter().all(|b| b["model"] == json!("other")));
    assert!(report.target.contains("baseline"), "{}", report.target);
}
