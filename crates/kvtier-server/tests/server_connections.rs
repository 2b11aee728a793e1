//! Bounded connections: a connection that sends no request (new, half a
//! header, or idle after a keep-alive answer) is closed after the header
//! timeout; a paused body is a 408; one connection past the cap and one
//! generating request past the in-flight cap get a 503 in OpenAI's shape,
//! while `/health` still answers; an over-long prompt is refused before it
//! is tokenized.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod server_support;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;
use server_support::{Resp, Server, parse_response};

/// What became of a connection the client left silent for `wait`.
#[derive(Debug, PartialEq, Eq)]
enum Fate {
    /// The server closed it (EOF or reset), with these bytes before.
    Closed(Vec<u8>),
    /// Still open when the client stopped waiting.
    Open,
}

fn fate(s: &mut TcpStream, wait: Duration) -> Fate {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Fate::Closed(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Fate::Closed(got),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Fate::Open;
            }
            Err(e) => panic!("reading: {e}"),
        }
    }
}

fn connect(s: &Server) -> TcpStream {
    TcpStream::connect(&s.addr).unwrap()
}

/// One keep-alive GET on `c`, its response read by its length.
fn keep_alive_get(c: &mut TcpStream, addr: &str, path: &str) -> Resp {
    write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the response");
        raw.extend_from_slice(&buf[..n]);
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().unwrap())
                .unwrap();
            if raw.len() >= end + 4 + len {
                return parse_response(&raw);
            }
        }
    }
}

#[test]
fn silent_half_sent_and_idle_keep_alive_connections_are_closed_after_the_header_timeout() {
    let s = Server::start(|o| o.conn_limits.header_timeout = Duration::from_millis(300));
    // Nothing sent.
    let mut silent = connect(&s);
    // Half a request head (a slow-loris client).
    let mut half = connect(&s);
    half.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    // One whole request, then idle on the kept-alive connection.
    let mut idle = connect(&s);
    let r = keep_alive_get(&mut idle, &s.addr, "/health");
    assert_eq!(r.status, 200, "{}", r.text());
    for (name, c) in [
        ("silent", &mut silent),
        ("half a head", &mut half),
        ("idle after an answer", &mut idle),
    ] {
        match fate(c, Duration::from_secs(10)) {
            Fate::Closed(bytes) => {
                // hyper may answer a timed-out head with 408; never with a 200.
                let text = String::from_utf8_lossy(&bytes);
                assert!(
                    bytes.is_empty() || text.starts_with("HTTP/1.1 408"),
                    "{name}: {text}"
                );
            }
            Fate::Open => panic!("{name}: still open 10 s after a 300 ms header timeout"),
        }
    }
    s.assert_serves();

    // The control: with a long timeout the same silent connection stays.
    let s = Server::start(|o| o.conn_limits.header_timeout = Duration::from_secs(60));
    let mut silent = connect(&s);
    assert_eq!(fate(&mut silent, Duration::from_secs(1)), Fate::Open);
}

#[test]
fn a_connection_past_the_cap_gets_503_and_a_freed_place_serves_again() {
    let s = Server::start(|o| {
        o.conn_limits.max_connections = 3;
        o.conn_limits.header_timeout = Duration::from_secs(60);
    });
    // Three connections, each proven accepted by one answered request.
    let mut held: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut c = connect(&s);
            assert_eq!(keep_alive_get(&mut c, &s.addr, "/health").status, 200);
            c
        })
        .collect();
    let r = s.get("/health");
    r.assert_error(503, None);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("connections"),
        "{}",
        r.text()
    );
    // One place freed: the server serves again (the freed permit comes
    // back once the server sees the close).
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = s.get("/health");
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 503, "{}", r.text());
        assert!(
            Instant::now() < deadline,
            "no place freed 10 s after a close"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `kvtier_server_http_in_flight` as `/metrics` shows it.
fn http_in_flight(s: &Server) -> f64 {
    let text = s.get("/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix("kvtier_server_http_in_flight "))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or_else(|| panic!("no kvtier_server_http_in_flight in\n{text}"))
}

#[test]
fn a_request_past_the_in_flight_cap_gets_503_health_still_answers_and_a_paused_body_is_408() {
    let s = Server::start(|o| {
        o.conn_limits.max_in_flight = 1;
        o.conn_limits.header_timeout = Duration::from_secs(2);
    });
    // A completion whose body stops halfway holds the one place.
    let body = json!({"model": "tiny", "prompt": "hello", "max_tokens": 2}).to_string();
    let mut paused = connect(&s);
    write!(
        paused,
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{}",
        s.addr,
        body.len(),
        &body[..body.len() / 2]
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while http_in_flight(&s) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the paused request never counted"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "hi", "max_tokens": 1}),
    );
    r.assert_error(503, None);
    assert!(r.text().contains("in flight"), "{}", r.text());
    // Neither /health nor /metrics counts against the cap.
    assert_eq!(s.get("/health").status, 200);
    // The paused body times out: 408 in OpenAI's shape, the place is free.
    match fate(&mut paused, Duration::from_secs(10)) {
        Fate::Closed(bytes) => {
            let r = parse_response(&bytes);
            r.assert_error(408, None);
            assert_eq!(r.json()["error"]["code"], "request_timeout", "{}", r.text());
        }
        Fate::Open => panic!("a body paused past the 2 s timeout was still waited for"),
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while http_in_flight(&s) > 0.0 {
        assert!(Instant::now() < deadline, "the place was never given back");
        std::thread::sleep(Duration::from_millis(10));
    }
    s.assert_serves();
}

#[test]
fn a_prompt_too_long_in_bytes_is_refused_before_it_is_tokenized() {
    let s = Server::start(|o| o.max_prompt_tokens = Some(64));
    // 64 tokens of the embedded tokenizer can never spell 1 MB.
    let huge = "a".repeat(1 << 20);
    for (path, body, param) in [
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": huge, "max_tokens": 1}),
            "prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": huge}]}),
            "messages",
        ),
    ] {
        let r = s.post(path, &body);
        r.assert_error(400, Some(param));
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
        assert!(r.text().contains("bytes"), "{}", r.text());
    }
    s.assert_serves();
}
