//! `kvtier bench` rejects bad input with a clear error before any work
//! starts (no model generated, no cache written).

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn bench(args: &[&str], dir: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .current_dir(dir)
        .arg("bench")
        .args(args)
        .output()
        .unwrap()
}

fn assert_fails_with(out: &Output, needle: &str) {
    assert!(!out.status.success(), "expected failure");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_input_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert_fails_with(&bench(&["--sessions", "0"], d), "sessions");
    assert_fails_with(&bench(&["--concurrency", "0"], d), "concurrency");
    assert_fails_with(&bench(&["--workload", "warm-start"], d), "warm-start");
    std::fs::write(
        d.join("gates.toml"),
        "[[gate]]\nname='x'\nmetric='throughput_gain'\nconcurrency=8\nmin=0.3\ncolour='red'\n",
    )
    .unwrap();
    assert_fails_with(&bench(&["--gates", "gates.toml"], d), "colour");
    assert_fails_with(&bench(&["--gates", "missing.toml"], d), "missing.toml");
    // Nothing listens on port 1 of loopback.
    assert_fails_with(
        &bench(
            &["--endpoint", "http://127.0.0.1:1", "--model-name", "m"],
            d,
        ),
        "127.0.0.1:1",
    );
    assert!(
        !d.join("kvtier-cache/models").exists(),
        "no model may be generated for a refused run"
    );
}

#[test]
fn the_cache_dir_is_never_cleared_of_files_kvtier_did_not_make() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cache = d.join("cache");
    std::fs::create_dir_all(cache.join("sub")).unwrap();
    std::fs::write(cache.join("notes.txt"), b"mine").unwrap();
    std::fs::write(cache.join("sub/more.txt"), b"mine too").unwrap();
    let flag = cache.display().to_string();
    // An unreachable endpoint is refused before the directory is looked at.
    assert_fails_with(
        &bench(
            &[
                "--endpoint",
                "http://127.0.0.1:1",
                "--model-name",
                "m",
                "--cache-dir",
                &flag,
            ],
            d,
        ),
        "127.0.0.1:1",
    );
    // A directory the bench did not make is refused, in-process too, before
    // a model is generated.
    assert_fails_with(
        &bench(&["--cache-dir", &flag, "--sessions", "1"], d),
        "was not made by kvtier bench",
    );
    assert_eq!(std::fs::read(cache.join("notes.txt")).unwrap(), b"mine");
    assert_eq!(
        std::fs::read(cache.join("sub/more.txt")).unwrap(),
        b"mine too"
    );
    assert!(!cache.join(".kvtier-bench").exists());
    assert!(!d.join("kvtier-cache/models").exists());
}
