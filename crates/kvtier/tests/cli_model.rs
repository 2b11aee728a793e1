//! End-to-end tests of `kvtier model synth|load|bench` and `kvtier
//! checkpoint bench` on small inputs: the JSON contracts, and clear errors
//! on bad input. No timing is asserted beyond "positive".

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

fn run(args: &[&str], dir: &Path) -> Output {
    kvtier().args(args).arg(dir).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "failed: {}", stderr(out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", stderr(out)))
}

/// A 4 MiB model in 2 shards.
fn synth(dir: &Path) {
    let out = run(&["model", "synth", "--bytes", "4MiB", "--shards", "2"], dir);
    assert!(out.status.success(), "synth failed: {}", stderr(&out));
}

#[test]
fn synth_then_load_reports_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    assert!(model.join("model.safetensors.index.json").is_file());
    assert!(model.join("model-00002-of-00002.safetensors").is_file());

    let v = json(&run(&["model", "load", "--json"], &model));
    assert_eq!(v["shards"].as_u64(), Some(2));
    assert!(v["bytes"].as_u64().unwrap() > 4 << 20);
    assert!(v["tensors"].as_u64().unwrap() > 2);
    assert!(v["gbps"].as_f64().unwrap() > 0.0);
    assert!(v["direct"].is_boolean());
    assert!(v["io_backend"].is_string());
    assert_eq!(v["device"].as_str(), Some("cpu"));
    assert!(v["staging_buffers"].is_null());
    assert!(v["verified"].is_null());

    // Every tensor read back and compared with the file, on request.
    let v = json(&run(&["model", "load", "--json", "--verify"], &model));
    assert_eq!(v["verified"].as_bool(), Some(true));

    // Buffered on request, with the reason.
    let v = json(&run(&["model", "load", "--json", "--buffered"], &model));
    assert_eq!(v["direct"].as_bool(), Some(false));
    assert!(v["buffered_reason"].is_string());

    // A second synth into the same directory needs --force.
    let out = run(&["model", "synth", "--bytes", "4MiB"], &model);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
}

#[test]
fn model_bench_json_has_the_contract_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let v = json(&run(
        &[
            "model",
            "bench",
            "--json",
            "--repeat",
            "1",
            "--mode",
            "both",
            "--settle-secs",
            "0",
            "--no-python",
        ],
        &model,
    ));
    assert!(v["device_limit_gbps"].as_f64().unwrap() > 0.0);
    assert!(v["bytes"].as_u64().unwrap() > 4 << 20);
    let names: Vec<&str> = v["loaders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["naive", "mmap", "kvtier"]);
    for l in v["loaders"].as_array().unwrap() {
        assert!(l["gbps"].as_f64().unwrap() > 0.0, "{l}");
        assert_eq!(l["mode"].as_str(), Some("cold"));
    }
    let warm = v["warm_loaders"].as_array().unwrap();
    assert_eq!(warm.len(), 3);
    assert!(warm.iter().all(|l| l["mode"] == "warm"));
    let skipped: Vec<&str> = v["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(skipped, ["python-safetensors", "runai-streamer"]);
    assert!(v["first_touch_gbps"].as_f64().unwrap() > 0.0);
    // 3 contenders x 2 modes, plus the final sample.
    assert_eq!(v["device_limit_samples_gbps"].as_array().unwrap().len(), 7);
    // The device-limit scratch directory is gone; the model is untouched.
    let left: Vec<String> = std::fs::read_dir(&model)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("kvtier-bench-"))
        .collect();
    assert!(left.is_empty(), "bench left {left:?}");
}

#[test]
fn checkpoint_bench_json_has_the_contract_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let out = kvtier()
        .args([
            "checkpoint",
            "bench",
            "--bytes",
            "16MiB",
            "--repeat",
            "1",
            "--settle-secs",
            "0",
            "--shard-bytes",
            "8MiB",
            "--json",
            "--dir",
        ])
        .arg(tmp.path())
        .output()
        .unwrap();
    let v = json(&out);
    assert!(v["device_write_limit_gbps"].as_f64().unwrap() > 0.0);
    assert_eq!(v["bytes"].as_u64(), Some(16 << 20));
    let writers = v["writers"].as_array().unwrap();
    let names: Vec<&str> = writers
        .iter()
        .map(|w| w["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["naive", "kvtier"]);
    for w in writers {
        assert!(w["gbps"].as_f64().unwrap() > 0.0, "{w}");
        assert_eq!(w["durable"].as_bool(), Some(true));
        assert!(w["files"].as_u64().unwrap() >= 2, "{w}");
    }
    // Page-aligned tensors: kvtier writes nearly all of them from memory.
    assert_eq!(v["tensor_memory"].as_str(), Some("page-aligned"));
    assert_eq!(writers[0]["borrowed_bytes"].as_u64(), Some(0));
    let borrowed = writers[1]["borrowed_bytes"].as_u64().unwrap();
    assert!(borrowed > 8 << 20 && borrowed <= 16 << 20, "{borrowed}");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "bench left files behind: {left:?}");
}

#[test]
fn a_missing_directory_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model");
    for args in [
        &["model", "load"][..],
        &["model", "bench", "--no-python", "--settle-secs", "0"],
    ] {
        let out = run(args, &missing);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(err.contains("no-such-model"), "{args:?}: {err}");
        assert!(err.starts_with("error:"), "{args:?}: {err}");
    }
}

#[test]
fn a_corrupt_shard_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let shard = model.join("model-00001-of-00002.safetensors");
    // Cut the file short: the header now describes more data than exists.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 1000).unwrap();
    drop(f);
    for args in [
        &["model", "load"][..],
        &["model", "bench", "--no-python", "--settle-secs", "0"],
    ] {
        let out = run(args, &model);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(
            err.contains("model-00001-of-00002.safetensors"),
            "{args:?}: {err}"
        );
    }
    // Garbage instead of a header.
    std::fs::write(&shard, b"\xff\xff\xff\xff\xff\xff\xff\xffnot json").unwrap();
    let out = run(&["model", "load"], &model);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("model-00001-of-00002.safetensors"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn bad_flags_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    for args in [
        &["model", "bench", "--mode", "tepid"][..],
        &["model", "bench", "--repeat", "0"],
        &["model", "load", "--chunk-bytes", "1000"],
        &["model", "load", "--in-flight", "0"],
        &["model", "synth", "--bytes", "2"],
    ] {
        let out = run(args, tmp.path());
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!stderr(&out).is_empty());
    }
}

#[test]
fn load_to_a_device_this_build_lacks_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let out = run(&["model", "load", "--device", "gpu"], &model);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("expected cpu, cuda or cuda:N"),
        "{}",
        stderr(&out)
    );
    let out = run(&["model", "load", "--staging-buffers", "1"], &model);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("staging-buffers"), "{}", stderr(&out));
    if !cfg!(feature = "cuda") {
        let out = run(&["model", "load", "--device", "cuda:0"], &model);
        assert!(!out.status.success());
        assert!(stderr(&out).contains("--features cuda"), "{}", stderr(&out));
    }
}
