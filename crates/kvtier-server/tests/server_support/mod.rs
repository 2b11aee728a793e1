//! Shared by the server tests: a tiny model written with
//! `kvtier_engine::write_preset`, a server started in this process with
//! [`kvtier_server::start`] on 127.0.0.1 port 0 and reached over real HTTP
//! on loopback ([`http`]).

// Test helpers may unwrap: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

pub mod http;

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvtier_engine::{Preset, write_preset};
use kvtier_server::{RunningServer, ServeError, ServeOptions};
use kvtier_store::RemoteConfig;
use serde_json::{Value, json};

pub use http::*;

/// Writes the tiny preset into `dir` (what `kvtier model init --preset
/// tiny --seed SEED` writes).
pub fn init_model(dir: &Path, seed: u64) {
    let params = write_preset(Preset::Tiny, seed, dir).unwrap();
    assert!(params > 0, "no parameters written");
}

/// The options every test server gets (small blocks, small context, small
/// tiers) before the test's own: `kvtier serve --port 0 --block-tokens 16
/// --max-seq-tokens 512 --g2-bytes 64MiB --g3-bytes 64MiB --max-wait-ms 5`.
pub fn base_options(model: &Path, cache: &Path) -> ServeOptions {
    ServeOptions {
        cache_dir: cache.to_path_buf(),
        port: 0,
        block_tokens: 16,
        max_seq_tokens: 512,
        g2_bytes: 64 << 20,
        g3_bytes: 64 << 20,
        max_wait: Duration::from_millis(5),
        ..ServeOptions::new(model)
    }
}

/// The G4 pool at `url` as `--remote URL` sets it.
pub fn remote(url: &str) -> Option<RemoteConfig> {
    Some(RemoteConfig::new(url))
}

/// The error and its causes, as `kvtier` prints them (`a: b: c`).
pub fn error_chain(e: &ServeError) -> String {
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// A server running in this process.
pub struct Server {
    inner: Option<RunningServer>,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// Holds the model (`tiny/`) and the cache (`cache/`).
    pub root: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Server {
    /// A fresh tiny model in a temporary directory, served with the base
    /// options as `opts` changes them.
    pub fn start(opts: impl FnOnce(&mut ServeOptions)) -> Server {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        init_model(&root.join("tiny"), 0);
        let mut s = Server::start_in(&root, opts);
        s._tmp = Some(tmp);
        s
    }

    /// Serves `root/tiny` with the cache in `root/cache`, the base options
    /// changed by `opts`.
    pub fn start_in(root: &Path, opts: impl FnOnce(&mut ServeOptions)) -> Server {
        let mut o = base_options(&root.join("tiny"), &root.join("cache"));
        opts(&mut o);
        let inner = kvtier_server::start(o)
            .unwrap_or_else(|e| panic!("the server did not start: {}", error_chain(&e)));
        let addr = inner.addr();
        assert!(addr.ip().is_loopback(), "{addr}");
        Server {
            addr: addr.to_string(),
            inner: Some(inner),
            root: root.to_path_buf(),
            _tmp: None,
        }
    }

    /// The start-up line (what was loaded, G2/G3/G4, prefix reuse).
    pub fn log(&self) -> String {
        self.inner
            .as_ref()
            .map(|s| s.summary().to_string())
            .unwrap_or_default()
    }

    /// Shuts the server down (requests in flight finish, the cache is
    /// flushed to G3).
    pub fn shutdown(&mut self) {
        if let Some(s) = self.inner.take() {
            s.shutdown()
                .unwrap_or_else(|e| panic!("shutdown failed: {}", error_chain(&e)));
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
        // Dropping the running server shuts it down.
        self.inner.take();
    }
}
