//! A broken model directory stops the server from starting with a clear
//! error naming the file: never a panic, never a server that starts.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod server_support;

use std::path::Path;

use kvtier_server::ServeOptions;
use serde_json::{Value, json};
use server_support::{base_options, error_chain, init_model};

/// Starts a server on `model`, asserts it fails cleanly, returns the error
/// with its causes.
fn serve_fails(model: &Path) -> String {
    serve_fails_with(model, |_| ())
}

/// [`serve_fails`] with the options changed by `opts`.
fn serve_fails_with(model: &Path, opts: impl FnOnce(&mut ServeOptions)) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let mut o = base_options(model, &tmp.path().join("cache"));
    opts(&mut o);
    let started =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| kvtier_server::start(o)));
    let Ok(result) = started else {
        panic!("starting on a broken model directory panicked");
    };
    match result {
        Ok(server) => {
            let addr = server.addr();
            drop(server);
            panic!("a server started on a broken model directory ({addr})");
        }
        Err(e) => {
            let err = error_chain(&e);
            assert!(!err.is_empty());
            assert!(!err.contains("panicked"), "{err}");
            err
        }
    }
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
    let e = serve_fails_with(&dir, |o| o.device = "gpu".into());
    assert!(e.contains("expected cpu, cuda or cuda:N"), "{e}");
    if !cfg!(feature = "cuda") {
        let e = serve_fails_with(&dir, |o| o.device = "cuda:0".into());
        assert!(e.contains("--features cuda"), "{e}");
    }
}
