//! `kvtier trace stats|sim` and `kvtier plan` as a script calls them: the
//! JSON fields the issue names, a plot, and bad input refused with the
//! file and line.

use std::io::Write;
use std::process::Command;

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

/// A Mooncake trace of conversations: each turn extends the one before.
fn conversations(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("conv.jsonl");
    let mut f = std::fs::File::create(&path).expect("create");
    let mut t = 0;
    for turn in 1..=6u64 {
        for conv in 0..8u64 {
            let ids: Vec<u64> = (0..turn * 2).map(|b| conv * 100 + b).collect();
            let input = ids.len() as u64 * 512 - 100;
            writeln!(
                f,
                "{{\"timestamp\": {t}, \"input_length\": {input}, \"output_length\": 10, \"hash_ids\": {ids:?}}}"
            )
            .expect("write");
            t += 250;
        }
    }
    path
}

fn json(out: std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[test]
fn stats_sim_and_plan_give_their_json_contracts() {
    let dir = tempfile::tempdir().expect("dir");
    let trace = conversations(dir.path());
    let s = json(
        kvtier()
            .args(["trace", "stats", "--json"])
            .arg(&trace)
            .output()
            .expect("run"),
    );
    assert_eq!(s["requests"], 48);
    assert_eq!(s["unique_blocks"], 8 * 12);
    assert!(s["infinite_prefix_hit_tokens"].as_f64().expect("hit") > 0.5);

    let plot = dir.path().join("curves.svg");
    let v = json(
        kvtier()
            .args([
                "trace",
                "sim",
                "--json",
                "--capacities",
                "10%,50%,100%",
                "--plot",
            ])
            .arg(&plot)
            .arg(&trace)
            .output()
            .expect("run"),
    );
    assert_eq!(v["trace"]["requests"], 48);
    let points = v["points"].as_array().expect("points");
    assert_eq!(points.len(), 3 * 5);
    for p in points {
        for k in [
            "policy",
            "capacity_blocks",
            "hit_rate_tokens",
            "hit_rate_blocks",
            "g3_write_blocks",
        ] {
            assert!(p.get(k).is_some(), "{k} missing in {p}");
        }
    }
    // At 100 % every policy is the infinite cache.
    let full: Vec<f64> = points
        .iter()
        .filter(|p| p["capacity_blocks"] == 96)
        .map(|p| p["hit_rate_tokens"].as_f64().expect("rate"))
        .collect();
    assert_eq!(full.len(), 5);
    assert!(full.iter().all(|h| (h - full[0]).abs() < 1e-12), "{full:?}");
    assert!(v["gap_closed"].is_object());
    let svg = std::fs::read_to_string(&plot).expect("plot");
    assert!(
        svg.contains("<svg") && svg.contains("hit rate"),
        "{}",
        &svg[..200.min(svg.len())]
    );

    let p = json(
        kvtier()
            .args([
                "plan",
                "--json",
                "--model",
                "llama-3.1-8b",
                "--g1",
                "1GiB",
                "--g2",
                "0,4GiB",
                "--g3",
                "0,64GiB",
            ])
            .arg(&trace)
            .output()
            .expect("run"),
    );
    assert_eq!(p["rows"].as_array().expect("rows").len(), 4);
    assert_eq!(p["bytes_per_token"], 131_072);
    assert!(
        p["baseline"]["usd_per_million_tokens"]
            .as_f64()
            .expect("usd")
            > 0.0
    );
}

#[test]
fn a_malformed_line_is_refused_with_file_and_line() {
    let dir = tempfile::tempdir().expect("dir");
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": \"x\"}\n",
    )
    .expect("write");
    for args in [&["trace", "stats"][..], &["trace", "sim"][..]] {
        let out = kvtier().args(args).arg(&trace).output().expect("run");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("bad.jsonl:2: input_length"), "{err}");
    }
    let out = kvtier()
        .args(["trace", "sim", "--capacities", "4GiB"])
        .arg(&trace)
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&out.stderr).contains("give --model"));
}
