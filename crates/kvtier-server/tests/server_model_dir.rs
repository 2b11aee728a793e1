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

/// Sets `field` of `dir/config.json` to `value`.
fn set_config(dir: &Path, field: &str, value: Value) {
    let path = dir.join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    cfg[field] = value;
    std::fs::write(&path, cfg.to_string()).unwrap();
}

#[test]
fn out_of_range_config_fields_are_refused_naming_the_field() {
    for (field, value, needle) in [
        (
            "num_hidden_layers",
            json!(1_000_000_000u64),
            "num_hidden_layers",
        ),
        ("vocab_size", json!(1u64 << 40), "vocab_size"),
        ("rope_theta", json!(0.0), "rope_theta"),
        ("rms_norm_eps", json!(-1e-6), "rms_norm_eps"),
    ] {
        let (_tmp, dir) = tiny();
        set_config(&dir, field, value);
        let err = serve_fails(&dir);
        assert!(
            err.contains("config.json") && err.contains(needle),
            "{field}: {err}"
        );
    }
    // In range but more weights than this machine's memory.
    let (_tmp, dir) = tiny();
    set_config(&dir, "num_hidden_layers", json!(1024));
    set_config(&dir, "hidden_size", json!(65536));
    set_config(&dir, "intermediate_size", json!(262144));
    set_config(&dir, "num_attention_heads", json!(512));
    set_config(&dir, "num_key_value_heads", json!(512));
    let err = serve_fails(&dir);
    assert!(
        err.contains("memory") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn config_or_tokenizer_that_is_a_device_or_fifo_is_an_error_not_a_hang() {
    for file in ["config.json", "tokenizer.json"] {
        let (_tmp, dir) = tiny();
        let path = dir.join(file);
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        let err = serve_fails(&dir);
        assert!(
            err.contains(file) && err.contains("not a regular file"),
            "{err}"
        );

        std::fs::remove_file(&path).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success());
        let err = serve_fails(&dir);
        assert!(
            err.contains(file) && err.contains("not a regular file"),
            "{err}"
        );
    }
}

#[test]
fn nan_or_all_zero_weights_are_refused_naming_the_tensor() {
    for (bits, needle) in [(f32::NAN.to_le_bytes(), "NaN"), ([0u8; 4], "all zeros")] {
        let (_tmp, dir) = tiny();
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let name = "model.norm.weight";
        let info = &header[name];
        assert_eq!(info["dtype"], "F32", "{header}");
        let start = 8 + n + info["data_offsets"][0].as_u64().unwrap() as usize;
        let end = 8 + n + info["data_offsets"][1].as_u64().unwrap() as usize;
        if needle == "NaN" {
            bytes[start..start + 4].copy_from_slice(&bits);
        } else {
            bytes[start..end].fill(0);
        }
        std::fs::write(&path, &bytes).unwrap();
        let err = serve_fails(&dir);
        assert!(
            err.contains(name) && err.contains(needle) && err.contains("model.safetensors"),
            "{err}"
        );
    }
}
