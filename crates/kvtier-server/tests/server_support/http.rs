//! A minimal HTTP/1.1 client over real TCP (raw enough to send malformed
//! requests), a server-sent-events parser and prompt helpers, shared by the
//! server tests here and the `kvtier` binary's process tests (which include
//! this file by path).

// Test helpers may unwrap: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

/// How long any one step may take before the test fails.
pub const STEP: Duration = Duration::from_secs(120);

/// An HTTP response.
#[derive(Debug, Clone)]
pub struct Resp {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body (de-chunked).
    pub body: Vec<u8>,
}

impl Resp {
    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of a server-sent-events body; asserts the last
    /// is `[DONE]` and drops it.
    pub fn sse_data(&self) -> Vec<Value> {
        assert_eq!(self.status, 200, "{}", self.text());
        assert!(
            self.header("content-type")
                .is_some_and(|c| c.starts_with("text/event-stream")),
            "{:?}",
            self.headers
        );
        let text = self.text();
        let mut data = Vec::new();
        for event in text.split("\n\n") {
            for line in event.lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    data.push(d.trim_start().to_string());
                }
            }
        }
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
        data.pop();
        data.iter()
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
            .collect()
    }

    /// Asserts an OpenAI-style error with `status` (and `param`, if given).
    pub fn assert_error(&self, status: u16, param: Option<&str>) {
        assert_eq!(self.status, status, "{}", self.text());
        assert!(
            self.header("content-type")
                .is_some_and(|c| c.starts_with("application/json")),
            "{:?}",
            self.headers
        );
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{v}");
        }
    }
}

/// POSTs JSON.
pub fn post_json(addr: &str, path: &str, body: &Value) -> Resp {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`).
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(STEP)).unwrap();
    s.set_write_timeout(Some(STEP)).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) and close before reading all of a large
    // body: a failed write is fine, the response is what counts.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if !raw.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("reading the response to {method} {path}: {e}"),
        }
    }
    parse_response(&raw)
}

/// Parses a raw HTTP/1.1 response (skipping 1xx ones).
pub fn parse_response(mut raw: &[u8]) -> Resp {
    loop {
        let end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
        let head = String::from_utf8_lossy(&raw[..end]).into_owned();
        let rest = &raw[end + 4..];
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap();
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        if (100..200).contains(&status) {
            raw = rest;
            continue;
        }
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
        let body = if chunked {
            dechunk(rest)
        } else {
            rest.to_vec()
        };
        return Resp {
            status,
            headers,
            body,
        };
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            panic!("truncated chunked body");
        };
        let size_text = String::from_utf8_lossy(&raw[..eol]).into_owned();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16)
            .unwrap_or_else(|_| panic!("bad chunk size {size_text:?}"));
        raw = &raw[eol + 2..];
        if size == 0 {
            return out;
        }
        assert!(raw.len() >= size + 2, "truncated chunk");
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// The text of a completion or chat response.
pub fn text_of(v: &Value) -> String {
    let c = &v["choices"][0];
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

/// The text of a streamed response: the concatenated deltas.
pub fn streamed_text(chunks: &[Value]) -> String {
    let mut s = String::new();
    for c in chunks {
        if let Some(choice) = c["choices"].get(0) {
            if let Some(t) = choice["text"].as_str() {
                s.push_str(t);
            }
            if let Some(t) = choice["delta"]["content"].as_str() {
                s.push_str(t);
            }
        }
    }
    s
}

/// A prompt of about `n` bytes (= tokens for the tiny byte-level model).
pub fn long_prompt(n: usize) -> String {
    let base = "The quick brown fox jumps over the lazy dog; kvtier keeps its KV blocks. ";
    base.repeat(n / base.len() + 1)[..n].to_string()
}
