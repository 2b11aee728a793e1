//! `kvtier store bench --tier g4` against a real redis-server: the JSON
//! contract, both sides measured, the pool left clean; and the flag checks.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

use kvtier_testkit::{RedisCluster, RedisServer, Resp};
use serde_json::Value;

fn store_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["store", "bench"])
        .args(args)
        .env_remove("KVTIER_REMOTE")
        .output()
        .unwrap()
}

fn keys(redis: &RedisServer, pattern: &str) -> Vec<String> {
    match redis.command(&[b"KEYS", pattern.as_bytes()]).unwrap() {
        Resp::Array(Some(items)) => items
            .into_iter()
            .map(|r| match r {
                Resp::Bulk(Some(b)) => String::from_utf8(b).unwrap(),
                other => panic!("KEYS item {other:?}"),
            })
            .collect(),
        other => panic!("KEYS answered {other:?}"),
    }
}

#[test]
fn g4_bench_measures_both_sides_and_cleans_up() {
    let redis = RedisServer::start().unwrap();
    let url = redis.url();
    let out = store_bench(&[
        "--tier",
        "g4",
        "--remote",
        &url,
        "--total-bytes",
        "8MiB",
        "--block-bytes",
        "256KiB",
        "--repeat",
        "1",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["value_bytes"].as_u64(), Some((256 << 10) + 128), "{v}");
    let g4 = v["g4_get_gbps"].as_f64().unwrap();
    let rb = v["redis_benchmark_get_gbps"].as_f64().unwrap();
    assert!(g4 > 0.0 && g4.is_finite(), "{v}");
    assert!(rb > 0.0 && rb.is_finite(), "{v}");
    // 8 MiB holds 31 values of 256 KiB + 128 bytes.
    assert_eq!(v["blocks"].as_u64(), Some(31), "{v}");
    assert_eq!(v["total_bytes"].as_u64(), Some(31 * ((256 << 10) + 128)));
    assert_eq!(v["in_flight"].as_u64(), Some(32));
    assert_eq!(v["redis_benchmark_clients"].as_u64(), Some(32));
    assert_eq!(v["redis_benchmark_keyspace"].as_u64(), Some(31));
    assert_eq!(v["g4_samples_gbps"].as_array().unwrap().len(), 1);
    assert_eq!(
        v["redis_benchmark_samples_gbps"].as_array().unwrap().len(),
        1
    );
    let ratio = v["ratio"].as_f64().unwrap();
    assert!((ratio - g4 / rb).abs() < 1e-9, "{v}");
    assert_eq!(v["goal_met"].as_bool(), Some(ratio >= 0.8));
    assert_eq!(v["keys_left"].as_u64(), Some(0), "{v}");
    assert_eq!(v["g4_errors"].as_u64(), Some(0), "{v}");
    assert!(v["redis_benchmark_skipped"].is_null(), "{v}");
    let ns = v["namespace"].as_str().unwrap();
    assert!(ns.starts_with("kvtier-bench-"), "{ns}");

    // redis-benchmark read the bench's own values: every GET was a hit.
    let Resp::Bulk(Some(info)) = redis.command(&[b"INFO", b"stats"]).unwrap() else {
        panic!("INFO")
    };
    let info = String::from_utf8(info).unwrap();
    let stat = |name: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
            .unwrap()
    };
    // Misses: one EXISTS probe before the puts and one EXISTS per block
    // after the clean-up; a wrong redis-benchmark key would add 256 more.
    assert!(stat("keyspace_misses") <= 1 + 31, "{info}");
    let requests = v["redis_benchmark_requests"].as_u64().unwrap();
    assert!(requests >= 256, "{v}");
    assert!(stat("keyspace_hits") >= requests + 31, "{info}");

    // Nothing is left behind, and redis-benchmark wrote nothing.
    assert!(keys(&redis, "kvtier-bench-*").is_empty());
    assert_eq!(
        redis.command(&[b"DBSIZE"]).unwrap(),
        Resp::Integer(0),
        "{:?}",
        keys(&redis, "*")
    );
}

#[test]
fn g4_bench_table_and_keep() {
    let redis = RedisServer::start().unwrap();
    let url = redis.url();
    let out = store_bench(&[
        "--tier",
        "g4",
        "--remote",
        &url,
        "--total-bytes",
        "1MiB",
        "--block-bytes",
        "64KiB",
        "--in-flight",
        "1,4",
        "--repeat",
        "2",
        "--keep",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "g4 restore",
        "redis-benchmark",
        "g4 / redis-benchmark = ",
        "goal >= 0.80",
    ] {
        assert!(stdout.contains(needle), "{needle:?} missing:\n{stdout}");
    }
    assert!(stdout.contains("4 in flight"), "{stdout}");
    // --keep leaves the 15 blocks (1 MiB / (64 KiB + 128)) in the pool.
    assert_eq!(keys(&redis, "kvtier-bench-*").len(), 15);
}

#[test]
fn g4_bench_fails_cleanly_on_a_dead_pool() {
    // Nothing listens on port 1 of loopback.
    let out = store_bench(&[
        "--tier",
        "g4",
        "--remote",
        "redis://user:hunter2@127.0.0.1:1",
        "--total-bytes",
        "1MiB",
        "--block-bytes",
        "64KiB",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("cannot reach the G4 pool"), "{stderr}");
    assert!(stderr.contains("127.0.0.1:1"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn tier_and_remote_must_go_together() {
    let out = store_bench(&["--tier", "g4", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--remote"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty());

    let dir = tempfile::tempdir().unwrap();
    let out = store_bench(&[
        "--remote",
        "redis://127.0.0.1:1",
        "--total-bytes",
        "1MiB",
        "--block-bytes",
        "256KiB",
        "--dir",
        dir.path().to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--tier g4"), "{stderr}");
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "no bench files for a refused run"
    );
}

#[test]
fn a_missing_redis_benchmark_is_a_clear_error() {
    let redis = RedisServer::start().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["store", "bench", "--tier", "g4", "--remote", &redis.url()])
        .args(["--total-bytes", "1MiB", "--block-bytes", "64KiB"])
        .env_remove("KVTIER_REMOTE")
        .env("KVTIER_REDIS_BENCHMARK", "/nonexistent/redis-benchmark")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("KVTIER_REDIS_BENCHMARK"), "{stderr}");
    // Refused before anything was written to the pool.
    assert_eq!(redis.command(&[b"DBSIZE"]).unwrap(), Resp::Integer(0));
}

#[test]
fn g4_bench_authenticates_redis_benchmark_without_showing_the_password() {
    let redis = RedisServer::start_with_acl("bencher", "hunter2").unwrap();
    let url = format!("redis://bencher:hunter2@127.0.0.1:{}", redis.port());
    let out = store_bench(&[
        "--tier",
        "g4",
        "--remote",
        &url,
        "--total-bytes",
        "2MiB",
        "--block-bytes",
        "256KiB",
        "--in-flight",
        "4",
        "--repeat",
        "1",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stdout.contains("hunter2") && !stderr.contains("hunter2"));
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert!(v["redis_benchmark_get_gbps"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(
        v["remote"].as_str(),
        Some(format!("redis://bencher:***@127.0.0.1:{}", redis.port()).as_str())
    );
    assert_eq!(redis.command(&[b"DBSIZE"]).unwrap(), Resp::Integer(0));
}

#[test]
fn g4_bench_on_a_cluster_measures_g4_and_says_why_redis_benchmark_was_skipped() {
    let cluster = RedisCluster::start(3).unwrap();
    let out = store_bench(&[
        "--tier",
        "g4",
        "--remote",
        &cluster.url(),
        "--total-bytes",
        "2MiB",
        "--block-bytes",
        "64KiB",
        "--repeat",
        "1",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert!(v["g4_get_gbps"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["redis_benchmark_get_gbps"].is_null(), "{v}");
    assert!(v["ratio"].is_null(), "{v}");
    let why = v["redis_benchmark_skipped"].as_str().unwrap();
    assert!(why.contains("Cluster"), "{why}");
    assert_eq!(v["keys_left"].as_u64(), Some(0), "{v}");
    for node in 0..3 {
        assert_eq!(
            cluster.command_on(node, &[b"DBSIZE"]).unwrap(),
            Resp::Integer(0)
        );
    }
}
