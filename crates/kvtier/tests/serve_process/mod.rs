//! Shared by the tests that need the `kvtier serve` process itself
//! (signals, the first stdout line, exit codes, the Python client): a tiny
//! model written by `kvtier model init`, the real binary on 127.0.0.1 port
//! 0, and the HTTP client of the server crate's tests (included by path, so
//! it lives once).

// Test helpers may unwrap: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

#[path = "../../../kvtier-server/tests/server_support/http.rs"]
pub mod http;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub use http::*;

static STARTS: AtomicUsize = AtomicUsize::new(0);

/// The `kvtier` binary.
pub fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

/// Writes the tiny preset into `dir` with `kvtier model init`.
pub fn init_model(dir: &Path, seed: u64) {
    let out = kvtier()
        .args([
            "model",
            "init",
            "--preset",
            "tiny",
            "--seed",
            &seed.to_string(),
        ])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "model init failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("parameters"), "{stdout}");
}

/// The flags every test server gets (small blocks, small context, small
/// tiers) before the test's own.
pub fn base_args(model: &Path, cache: &Path) -> Vec<String> {
    let mut v: Vec<String> = vec!["serve".into(), "--model".into()];
    v.push(model.display().to_string());
    v.push("--cache-dir".into());
    v.push(cache.display().to_string());
    for a in [
        "--port",
        "0",
        "--block-tokens",
        "16",
        "--max-seq-tokens",
        "512",
        "--g2-bytes",
        "64MiB",
        "--g3-bytes",
        "64MiB",
        "--max-wait-ms",
        "5",
    ] {
        v.push(a.into());
    }
    v
}

/// A running `kvtier serve`.
pub struct Server {
    child: Option<Child>,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// The first line the server printed on stdout.
    pub first_line: String,
    /// Holds the model (`tiny/`) and the cache (`cache/`).
    pub root: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    stderr_path: PathBuf,
}

impl Server {
    /// A fresh tiny model in a temporary directory, served with `extra`
    /// flags.
    pub fn start(extra: &[&str]) -> Server {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        init_model(&root.join("tiny"), 0);
        let mut s = Server::start_in(&root, extra);
        s._tmp = Some(tmp);
        s
    }

    /// Serves `root/tiny` with the cache in `root/cache`.
    /// A flag in `extra` replaces the same flag of [`base_args`].
    pub fn start_in(root: &Path, extra: &[&str]) -> Server {
        let base = base_args(&root.join("tiny"), &root.join("cache"));
        let mut args = vec![base[0].clone()];
        for pair in base[1..].chunks(2) {
            if !extra.contains(&pair[0].as_str()) {
                args.extend_from_slice(pair);
            }
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let n = STARTS.fetch_add(1, Ordering::Relaxed);
        let stderr_path = root.join(format!("serve-{n}.stderr"));
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut child = kvtier()
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(first)) = lines.next() {
                let _ = tx.send(first);
            }
            // Keep draining so the server never blocks on a full pipe.
            for _ in lines {}
        });
        let first = match rx.recv_timeout(STEP) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the server printed no address; stderr:\n{}",
                    std::fs::read_to_string(&stderr_path).unwrap_or_default()
                );
            }
        };
        let addr = first
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_string();
        Server {
            child: Some(child),
            addr,
            first_line: first,
            root: root.to_path_buf(),
            _tmp: None,
            stderr_path,
        }
    }

    /// What the server wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Sends `signal` (`TERM`, `INT`) to the server with kill(1).
    pub fn signal(&self, signal: &str) {
        let pid = self.pid();
        let st = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(st.success(), "kill -{signal} {pid} failed");
    }

    /// Waits for the server to exit (after a signal).
    pub fn wait(&mut self) -> ExitStatus {
        let child = self.child.as_mut().unwrap();
        let t0 = Instant::now();
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                self.child = None;
                return st;
            }
            assert!(
                t0.elapsed() < STEP,
                "the server did not exit; stderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// POSTs `body` as JSON to `path`.
    pub fn post(&self, path: &str, body: &Value) -> Resp {
        post_json(&self.addr, path, body)
    }

    /// GETs `path`.
    pub fn get(&self, path: &str) -> Resp {
        request(&self.addr, "GET", path, &[], b"")
    }

    /// A small valid completion; asserts it succeeds (the server still
    /// serves).
    pub fn assert_serves(&self) {
        let r = self.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "still there?", "max_tokens": 3, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
