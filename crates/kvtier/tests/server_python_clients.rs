//! Official Python clients against `kvtier serve` over real HTTP on
//! 127.0.0.1: the `openai` client (a chat, a streamed chat, cached tokens
//! on a repeated long prompt: tests/python/test_openai_client.py) and
//! `prometheus_client`'s two parsers on `/metrics`
//! (tests/python/test_metrics_parse.py). `scripts/test` installs both;
//! these tests fail, never skip, when python3 or a package is missing.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod serve_process;

use std::path::PathBuf;
use std::process::Command;

use serde_json::json;
use serve_process::Server;

fn python() -> Command {
    let mut c = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()));
    // The client must reach 127.0.0.1 directly, whatever proxy is set.
    for v in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
    ] {
        c.env_remove(v);
    }
    c.env("NO_PROXY", "127.0.0.1,localhost");
    c
}

#[test]
fn openai_python_client_chats_streams_and_reads_cached_tokens() {
    let probe = python()
        .args(["-c", "import openai; print(openai.__version__)"])
        .output()
        .unwrap_or_else(|e| panic!("python3 is required for this test and could not run: {e}"));
    assert!(
        probe.status.success(),
        "the openai Python package is required: python3 -m pip install 'openai>=1.40' \
         (scripts/test does this)\n{}",
        String::from_utf8_lossy(&probe.stderr)
    );

    let s = Server::start(&[]);
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/test_openai_client.py");
    let out = python()
        .arg(&script)
        .arg(format!("http://{}", s.addr))
        .arg("tiny")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{} failed ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}\nserver stderr:\n{}",
        script.display(),
        out.status,
        s.stderr()
    );
    assert!(stdout.trim_end().ends_with("ok"), "{stdout}");
}

#[test]
fn prometheus_client_parses_metrics_in_both_formats() {
    let probe = python()
        .args(["-c", "import prometheus_client"])
        .output()
        .unwrap_or_else(|e| panic!("python3 is required for this test and could not run: {e}"));
    assert!(
        probe.status.success(),
        "the prometheus_client Python package is required: python3 -m pip install prometheus_client \
         (scripts/test does this)\n{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let s = Server::start(&[]);
    let r = s.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "count me", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/test_metrics_parse.py");
    let out = python()
        .arg(&script)
        .arg(format!("http://{}", s.addr))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{} failed ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        script.display(),
        out.status
    );
    assert!(stdout.trim_end().ends_with("ok"), "{stdout}");
}
