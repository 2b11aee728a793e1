//! A broken model directory stops `kvtier serve` with a clear error naming
//! the file and a non-zero exit: never a panic, never a server that starts.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod server_support;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use server_support::{STEP, base_args, init_model, kvtier};

/// Runs `kvtier serve` on `model`, asserts it fails cleanly, returns stderr.
fn serve_fails(model: &Path) -> String {
    serve_fails_with(model, &[])
}

/// [`serve_fails`] with `extra` flags.
fn serve_fails_with(model: &Path, extra: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let mut child = kvtier()
        .args(base_args(model, &tmp.path().join("cache")))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > STEP {
            let _ = child.kill();
            panic!("kvtier serve kept running on a broken model directory");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "exit 0; stderr: {stderr}");
    assert_eq!(
        out.status.code(),
        Some(1),
        "an error exit, not a crash: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stdout.contains("listening"), "{stdout}");
    assert!(stderr.contains("error:"), "{stderr}");
    stderr
}

fn tiny() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    init_model(&dir, 0);
    (tmp, dir)
}

/// Tensor names in a safetensors file's header.
fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

#[test]
fn missing_shard_names_the_file() {
    let (_tmp, dir) = tiny();
    let names = tensor_names(&dir.join("model.safetensors"));
    let first = "model-00001-of-00002.safetensors";
    let second = "model-00002-of-00002.safetensors";
    std::fs::rename(dir.join("model.safetensors"), dir.join(first)).unwrap();
    let mut map = serde_json::Map::new();
    for (i, n) in names.iter().enumerate() {
        map.insert(n.clone(), json!(if i == 0 { second } else { first }));
    }
    let index = json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let err = serve_fails(&dir);
    assert!(err.contains(second), "{err}");
}

#[test]
fn corrupt_tokenizer_names_the_file() {
    let (_tmp, dir) = tiny();
    std::fs::write(
        dir.join("tokenizer.json"),
        b"{\"version\": \"1.0\", \"model\": ",
    )
    .unwrap();
    let err = serve_fails(&dir);
    assert!(err.contains("tokenizer.json"), "{err}");

    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let err = serve_fails(&dir);
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn config_weights_shape_mismatch_names_the_file() {
    let (_tmp, dir) = tiny();
    let path = dir.join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    cfg["intermediate_size"] = json!(96);
    std::fs::write(&path, cfg.to_string()).unwrap();
    let err = serve_fails(&dir);
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("shape"), "{err}");
}

#[test]
fn corrupt_config_and_missing_directory_are_clear_errors() {
    let (_tmp, dir) = tiny();
    std::fs::write(dir.join("config.json"), b"{\"model_type\": ").unwrap();
    let err = serve_fails(&dir);
    assert!(err.contains("config.json"), "{err}");

    let err = serve_fails(&dir.join("no-such-model"));
    assert!(
        err.contains("no-such-model") && err.contains("does not exist"),
        "{err}"
    );
}

#[test]
fn truncated_weights_name_the_file() {
    let (_tmp, dir) = tiny();
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = serve_fails(&dir);
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn an_unknown_or_unbuilt_device_is_a_clear_error() {
    let (_tmp, dir) = tiny();
    let e = serve_fails_with(&dir, &["--device", "gpu"]);
    assert!(e.contains("expected cpu, cuda or cuda:N"), "{e}");
    if !cfg!(feature = "cuda") {
        let e = serve_fails_with(&dir, &["--device", "cuda:0"]);
        assert!(e.contains("--features cuda"), "{e}");
    }
}
