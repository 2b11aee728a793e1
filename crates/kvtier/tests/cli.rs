//! End-to-end tests of the `kvtier` binary.

use std::process::Command;

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

#[test]
fn store_bench_json_has_the_contract_fields() {
    let dir = tempfile::tempdir().unwrap();
    let out = kvtier()
        .args([
            "store",
            "bench",
            "--total-bytes",
            "16MiB",
            "--block-bytes",
            "256KiB",
            "--in-flight",
            "1,4",
            "--repeat",
            "1",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {stderr}"));
    assert!(v["device_limit_gbps"].as_f64().unwrap() > 0.0);
    assert!(v["io_mode"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(v["io_backend"].is_string());
    assert!(v["direct_io"].is_boolean());
    assert!(v["page_cache_dropped"].is_boolean());
    assert_eq!(v["total_bytes"].as_u64(), Some(16 << 20));
    assert!(v["write_gbps"].as_f64().unwrap() > 0.0);
    assert_eq!(v["device_limit_samples_gbps"].as_array().unwrap().len(), 3);
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for (c, q) in cases.iter().zip([1, 4]) {
        assert_eq!(c["in_flight"].as_u64(), Some(q));
        assert_eq!(c["block_bytes"].as_u64(), Some(262_144));
        assert!(c["gbps"].as_f64().unwrap() > 0.0);
        assert!(c["fraction_of_limit"].as_f64().unwrap() > 0.0);
        assert_eq!(c["samples_gbps"].as_array().unwrap().len(), 1);
    }
    // Files are removed unless --keep.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "bench left files behind: {left:?}");
}

#[test]
fn store_bench_keep_leaves_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = kvtier()
        .args([
            "store",
            "bench",
            "--total-bytes",
            "1MiB",
            "--block-bytes",
            "64KiB",
            "--in-flight",
            "2",
            "--repeat",
            "1",
            "--keep",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("device limit"), "{table}");
    assert!(table.contains("in flight"), "{table}");
    let run: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(run.len(), 1, "one kvtier-bench-<pid> directory");
}

#[test]
fn info_json_parses() {
    let dir = tempfile::tempdir().unwrap();
    let out = kvtier()
        .args(["info", "--json", "--cache-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "version",
        "cpus",
        "memory_bytes",
        "io_backend",
        "io_backend_fallback",
        "cache_dir",
        "direct_io",
        "direct_io_reason",
    ] {
        assert!(v.get(field).is_some(), "missing {field}: {v}");
    }
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert!(v["cpus"].as_u64().unwrap() >= 1);
    assert_eq!(
        v["direct_io"].as_bool().unwrap(),
        v["direct_io_reason"].is_null()
    );
}

#[test]
fn bad_input_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (&["--block-bytes", "1000"][..], "multiple of 4096"),
        (&["--block-bytes", "4KiB"], "minimum"),
        (&["--total-bytes", "lots"], "lots"),
        (&["--in-flight", "0"], "in-flight"),
        (
            &["--total-bytes", "64KiB", "--block-bytes", "256KiB"],
            "holds no",
        ),
    ] {
        let out = kvtier()
            .args(["store", "bench", "--json"])
            .args(args)
            .arg("--dir")
            .arg(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
    }
    // A directory that cannot be created.
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let out = kvtier()
        .args([
            "store",
            "bench",
            "--total-bytes",
            "1MiB",
            "--block-bytes",
            "256KiB",
            "--dir",
        ])
        .arg(file.join("sub"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot create bench directory"), "{stderr}");
}

#[test]
fn help_texts_are_there() {
    for args in [
        &["--help"][..],
        &["store", "bench", "--help"],
        &["info", "--help"],
    ] {
        let out = kvtier().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        assert!(!out.stdout.is_empty());
    }
}
