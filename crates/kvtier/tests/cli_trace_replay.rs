//! `kvtier trace replay` against real `kvtier serve` processes on
//! 127.0.0.1: a sequential replay's measured hits equal the simulator's
//! prediction request by request, outputs equal a no-reuse server's, a
//! restart keeps G3 hits, a server that dies mid-replay is reported as
//! failed requests, and a bad trace names its line.

// Test code may unwrap: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod serve_process;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

use serve_process::{Server, init_model, kvtier};

/// Two sessions of 20 turns each, blocks of 16 tokens: a system prompt
/// of two blocks both share and one of its own, then a history that each
/// turn extends by a block and that starts over every fifth turn; the last
/// block is partial.
fn tiny_trace(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    for i in 0..40u64 {
        let (session, own) = if i % 2 == 0 { ("a", 3) } else { ("b", 9) };
        let (round, turn) = (i / 10, i / 2 % 5);
        let mut blocks = vec![Value::from(1), Value::from(2), Value::from(own)];
        blocks.extend((0..=turn).map(|k| Value::from(format!("{session}{round}-{k}"))));
        let input = blocks.len() as u64 * 16 - (i * 7) % 13;
        writeln!(
            f,
            "{}",
            serde_json::json!({"time_s": i as f64 * 0.25, "input_tokens": input,
                "output_tokens": 4, "block_size": 16, "blocks": blocks, "session": session})
        )
        .unwrap();
    }
    path
}

/// A port free now on 127.0.0.1.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `kvtier serve` on a fixed port, started (and restarted) by a script,
/// so the replay's restart command can stop it and start it again on the
/// same address and cache directory.
struct Scripted {
    root: PathBuf,
    url: String,
}

impl Scripted {
    fn start(root: &Path, flags: &[&str]) -> Scripted {
        init_model(&root.join("tiny"), 0);
        let port = free_port();
        let serve = format!(
            "{:?} serve --model {:?} --cache-dir {:?} --port {port} {} >> {:?} 2>&1 &\necho $! > {:?}\n",
            env!("CARGO_BIN_EXE_kvtier"),
            root.join("tiny"),
            root.join("cache"),
            flags.join(" "),
            root.join("serve.log"),
            root.join("pid"),
        );
        let pid = root.join("pid");
        let stop = format!(
            "pid=$(cat {pid:?}); kill -TERM $pid; while kill -0 $pid 2>/dev/null; do sleep 0.05; done\n"
        );
        std::fs::write(root.join("start.sh"), &serve).unwrap();
        std::fs::write(
            root.join("restart.sh"),
            format!("[ \"$KVTIER_REPLAY_SERVER\" = kvtier ] || exit 0\n{stop}{serve}"),
        )
        .unwrap();
        std::fs::write(root.join("kill.sh"), format!("kill -KILL $(cat {pid:?})\n")).unwrap();
        let st = Command::new("sh")
            .arg(root.join("start.sh"))
            .status()
            .unwrap();
        assert!(st.success());
        let s = Scripted {
            root: root.to_path_buf(),
            url: format!("http://127.0.0.1:{port}"),
        };
        s.wait_ready();
        s
    }

    fn wait_ready(&self) {
        let t0 = Instant::now();
        let addr = self.url.trim_start_matches("http://").to_string();
        while t0.elapsed() < Duration::from_secs(60) {
            if std::net::TcpStream::connect(&addr).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "the scripted server did not start: {}",
            std::fs::read_to_string(self.root.join("serve.log")).unwrap_or_default()
        );
    }

    fn script(&self, name: &str) -> String {
        format!("sh {:?}", self.root.join(name))
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.root.join("pid")) {
            let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
        }
    }
}

/// Small tiers: G1 (12 pages) and G2 (a few blocks) evict on the tiny
/// trace, into a G3 that holds everything (a G3 evicting while requests
/// run does so on its writer thread's timing: `kvtier-trace`'s
/// server_sim.rs); G3 written only when G2 evicts and at a clean stop, so
/// a sequential replay is deterministic.
const SMALL_TIERS: [&str; 12] = [
    "--block-tokens",
    "16",
    "--max-seq-tokens",
    "512",
    "--pool-pages",
    "12",
    "--g2-bytes",
    "64KiB",
    "--g3-bytes",
    "64MiB",
    "--g3-sync-ms",
    "0",
];

fn replay(trace: &Path, out: &Path, args: &[&str]) -> Output {
    kvtier()
        .args(["trace", "replay"])
        .arg(trace)
        .args([
            "--block-tokens",
            "16",
            "--time-scale",
            "0",
            "--max-concurrency",
            "1",
            "--json",
            "--out",
        ])
        .arg(out)
        .args(args)
        .output()
        .unwrap()
}

fn report(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "replay failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

fn tiers(v: &Value) -> [u64; 3] {
    ["g1", "g2", "g3"].map(|t| v[t].as_u64().unwrap())
}

#[test]
fn a_sequential_replay_hits_what_the_simulator_predicts_and_a_restart_keeps_g3() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tiny_trace(tmp.path());
    let server = Scripted::start(&tmp.path().join("kvtier"), &SMALL_TIERS);
    let baseline = Server::start(&["--no-prefix-reuse"]);
    let out_dir = tmp.path().join("out");
    let restart = server.script("restart.sh");
    let out = replay(
        &trace,
        &out_dir,
        &[
            "--endpoint",
            &server.url,
            "--baseline-endpoint",
            &format!("http://{}", baseline.addr),
            "--restart-cmd",
            &restart,
            "--restart-at",
            "0.5",
            "--window",
            "4",
        ],
    );
    let v = report(&out);
    // The JSON contract.
    assert_eq!(v["trace"], "tiny.jsonl");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for (run, mode) in runs.iter().zip(["kvtier", "baseline"]) {
        assert_eq!(run["mode"], mode);
        assert_eq!(run["requests"], 40);
        assert_eq!(run["failed"], 0, "{run}");
        for key in ["ttft_p50_s", "ttft_p99_s", "throughput_tok_s", "hit_rate"] {
            assert!(run[key].as_f64().unwrap() >= 0.0, "{key}: {run}");
        }
        assert!(run["restart_error"].is_null(), "{run}");
    }
    let names: Vec<&str> = v["gates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            assert!(g["passed"].is_boolean());
            g["name"].as_str().unwrap()
        })
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert_eq!(v["identical_outputs"], true, "{v}");
    assert_eq!(v["compared_outputs"], 40);
    assert_eq!(runs[1]["hit_rate"], 0.0, "the no-reuse server hits nothing");

    // Per request, what the server reported is what the simulator said.
    let lines = std::fs::read_to_string(out_dir.join("requests.jsonl")).unwrap();
    let kv: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l["mode"] == "kvtier")
        .collect();
    assert_eq!(kv.len(), 40);
    let mut sum = [0u64; 3];
    let mut g3_after_restart = 0;
    for l in &kv {
        let measured = tiers(&l["hit_tokens"]);
        assert!(!l["predicted"].is_null(), "no prediction: {l}");
        assert_eq!(measured, tiers(&l["predicted"]), "request {}", l["index"]);
        for t in 0..3 {
            sum[t] += measured[t];
        }
        if l["index"].as_u64().unwrap() >= 20 {
            g3_after_restart += measured[2];
        }
    }
    assert!(
        sum.iter().all(|&n| n > 0),
        "every tier served something: {sum:?}"
    );
    assert!(g3_after_restart > 0, "G3 hits survive the restart");
    let k = &runs[0];
    assert_eq!(k["predicted_hit_rate"], k["hit_rate"], "{k}");
    assert!(k["hit_rate_before_restart"].as_f64().unwrap() > 0.0);
    assert!(k["hit_rate_first_window_after_restart"].as_f64().unwrap() > 0.0);
    for f in ["report.json", "report.txt", "over_time.svg", "ttft_cdf.svg"] {
        assert!(out_dir.join(f).is_file(), "{f} written");
    }
}

#[test]
fn a_server_killed_mid_replay_gives_failed_requests_and_the_replay_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tiny_trace(tmp.path());
    let server = Scripted::start(&tmp.path().join("kvtier"), &SMALL_TIERS);
    let kill = server.script("kill.sh");
    let out = replay(
        &trace,
        &tmp.path().join("out"),
        &[
            "--endpoint",
            &server.url,
            "--restart-cmd",
            &kill,
            "--restart-at",
            "0.25",
            "--restart-timeout",
            "1s",
        ],
    );
    let v = report(&out);
    let run = &v["runs"][0];
    assert_eq!(run["requests"], 40);
    assert_eq!(run["failed"], 30, "{run}");
    assert!(
        run["restart_error"]
            .as_str()
            .unwrap()
            .contains("did not come back"),
        "{run}"
    );
    assert!(!run["errors"].as_array().unwrap().is_empty());
    assert!(
        v["identical_outputs"].is_null(),
        "no baseline, nothing compared"
    );
}

#[test]
fn a_bad_trace_is_refused_naming_its_line() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"time_s\": 0, \"input_tokens\": 16, \"output_tokens\": 1, \"blocks\": [1]}\n\
         {\"time_s\": 1, \"input_tokens\": 16, \"output_tokens\": 1, \"blocks\": [1]}\n\
         {\"time_s\": 2, \"input_tokens\": \"many\", \"blocks\": [1]}\n",
    )
    .unwrap();
    // Nothing listens there: the trace is read, and refused, first.
    let out = kvtier()
        .args(["trace", "replay"])
        .arg(&path)
        .args(["--endpoint", "http://127.0.0.1:9"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.jsonl:3:"), "names the line: {err}");
}
