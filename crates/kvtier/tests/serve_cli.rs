//! What only the `kvtier serve` / `kvtier prefill` processes can show: the
//! first stdout line is `listening on http://ADDR` and the server behind it
//! serves; a model directory that cannot be served is an error exit (1)
//! with `error:` on stderr; bad flags are refused before anything starts.
//! The HTTP API itself is tested in-process in the kvtier-server crate.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod serve_process;

use std::process::Stdio;
use std::time::{Duration, Instant};

use serve_process::{STEP, Server, base_args, init_model, kvtier};

#[test]
fn serve_prints_its_address_first_and_serves() {
    let s = Server::start(&[]);
    let port: u16 = s
        .first_line
        .strip_prefix("listening on http://127.0.0.1:")
        .unwrap_or_else(|| panic!("first line {:?}", s.first_line))
        .parse()
        .unwrap();
    assert_ne!(port, 0, "the bound port, not the asked one");
    s.assert_serves();
    let models = s.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "tiny", "{models}");
    let health = s.get("/health");
    assert_eq!(health.status, 200, "{}", health.text());
    assert!(s.stderr().contains("loaded in"), "{}", s.stderr());
}

#[test]
fn a_model_directory_that_cannot_be_served_is_an_error_exit() {
    let tmp = tempfile::tempdir().unwrap();
    let mut child = kvtier()
        .args(base_args(
            &tmp.path().join("no-such-model"),
            &tmp.path().join("cache"),
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > STEP {
            let _ = child.kill();
            panic!("kvtier serve kept running on a missing model directory");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "an error exit, not a crash: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stdout.contains("listening"), "{stdout}");
    assert!(stderr.contains("error:"), "{stderr}");
    assert!(
        stderr.contains("no-such-model") && stderr.contains("does not exist"),
        "{stderr}"
    );
}

#[test]
fn a_second_server_on_the_same_cache_dir_is_refused_naming_the_first() {
    let first = Server::start(&[]);
    let out = kvtier()
        .args(base_args(
            &first.root.join("tiny"),
            &first.root.join("cache"),
        ))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stdout.contains("listening"), "{stdout}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains(&format!("in use by process {}", first.pid())),
        "{stderr}"
    );
    // The first server lost nothing.
    first.assert_serves();
}

#[test]
fn the_printed_default_config_starts_a_server_and_the_environment_reaches_serve() {
    let out = kvtier()
        .args(["config", "--print-default"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("kvtier.toml");
    std::fs::write(&file, &out.stdout).unwrap();
    let path = file.display().to_string();
    let s = Server::start(&["--config", &path]);
    s.assert_serves();
    // A KVTIER_<KEY> variable is a flag's value (checked like one).
    let out = kvtier()
        .args(["serve", "--model", "m"])
        .env("KVTIER_MAX_BATCH", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("max-batch"), "{stderr}");
}

#[test]
fn bad_serve_and_prefill_flags_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny");
    init_model(&model, 0);
    for (args, needle) in [
        (&["serve"][..], "--model"),
        (&["serve", "--model", "m", "--max-batch", "0"], "max-batch"),
        (&["serve", "--model", "m", "--g2-bytes", "lots"], "lots"),
        (&["serve", "--model", "m", "--port", "70000"], "port"),
        (&["prefill", "--model", "m"], "--prompt"),
    ] {
        let out = kvtier()
            .args(args)
            .env_remove("KVTIER_REMOTE")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // Without a pool, prefill refuses to run.
    let out = kvtier()
        .args(["prefill", "--model"])
        .arg(&model)
        .args(["--prompt", "hello"])
        .env_remove("KVTIER_REMOTE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--remote"));
    // A bad limit is found once the model is read.
    let out = kvtier()
        .args(base_args(&model, &tmp.path().join("cache")))
        .args(["--max-prompt-tokens", "512"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--max-prompt-tokens 512"), "{stderr}");
}
