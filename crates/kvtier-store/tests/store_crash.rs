//! kill -9 in the middle of write-back: after a restart, every block the
//! store serves has exactly its key's bytes.
//!
//! The test re-executes its own binary as a child (selected by an
//! environment variable) that puts blocks forever through a store with a tiny
//! G2 (so write-back runs constantly) and a G3 smaller than what it writes
//! (so slots are reclaimed and overwritten). The parent kills it with SIGKILL
//! at varying points, reopens the store and verifies everything it finds.

mod common;

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvtier_store::{BlockKey, Recovery, StoreConfig, Tier};

const TEST_NAME: &str = "kill_9_during_write_back_never_serves_wrong_bytes";
const CHILD_DIR_ENV: &str = "KVTIER_CRASH_CHILD";
const CHILD_START_ENV: &str = "KVTIER_CRASH_CHILD_START";
const READY: &str = "KVTIER_CRASH_CHILD_READY";
/// The child gives up on its own after this long, whatever happens.
const CHILD_LIMIT: Duration = Duration::from_secs(20);

fn crash_config(dir: &Path) -> StoreConfig {
    let mut c = store_config(Some(dir), 2, 0);
    c.disk = Some(disk_config(dir, 48, 8));
    c.writeback_max_bytes = 8 * SLOT;
    c
}

/// The child: puts blocks in a loop until killed (or until `CHILD_LIMIT`).
fn run_child(dir: &Path) -> ! {
    let started = Instant::now();
    let start: u64 = std::env::var(CHILD_START_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let store = open(crash_config(dir));
    let mut next = start;
    let mut announced = false;
    while started.elapsed() < CHILD_LIMIT {
        let ks = keys(next..next + 4);
        next += 4;
        put(&store, &ks);
        if !announced && store.metrics().g3.written_bytes.get() > 0 {
            // This run has written to disk: from here on the parent may kill us.
            // On its own line: libtest has printed "test <name> ... " already.
            println!("\n{READY}");
            announced = true;
        }
    }
    eprintln!("crash child: not killed within {CHILD_LIMIT:?}; exiting");
    std::process::exit(3);
}

#[test]
fn kill_9_during_write_back_never_serves_wrong_bytes() {
    if let Some(dir) = std::env::var_os(CHILD_DIR_ENV) {
        run_child(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut served_total = 0usize;
    let mut corrupt_total = 0u64;
    for (round, delay_ms) in [30u64, 110, 5, 250, 70].into_iter().enumerate() {
        let start = round as u64 * 1_000_000;
        let mut child = Command::new(&exe)
            .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR_ENV, dir.path())
            .env(CHILD_START_ENV, start.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut ready = false;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.trim_end().ends_with(READY) {
                ready = true;
                break;
            }
        }
        if !ready {
            let out = child.wait_with_output().unwrap();
            panic!(
                "round {round}: the crash child never got ready ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Not an assertion: only where in the write-back the kill lands.
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap();
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.signal(),
            Some(9),
            "round {round}: the child was not killed by SIGKILL ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );

        let store = open(crash_config(dir.path()));
        let disk = store.disk().unwrap();
        // The index comes from the checkpoint and the journal the child
        // appended to, not from a scan of every slot.
        match disk.recovery() {
            Recovery::Saved { replayed, .. } => assert!(*replayed > 0, "round {round}"),
            other => panic!("round {round}: the saved index was not used: {other:?}"),
        }
        let found = disk.keys();
        assert!(!found.is_empty(), "round {round}: nothing on disk");
        let got = store.get_many(&found);
        // The keys this round's child can have written (far more than it
        // can write before it is killed).
        let this_round: HashSet<BlockKey> = keys(start..start + 100_000).into_iter().collect();
        let mut served = 0usize;
        let mut served_this_round = 0usize;
        for (k, b) in found.iter().zip(&got) {
            if let Some(b) = b {
                assert_eq!(&b.key, k);
                assert_eq!(b.tier, Tier::G3);
                assert_content(b);
                served += 1;
                served_this_round += usize::from(this_round.contains(k));
            }
        }
        assert!(
            served_this_round > 0,
            "round {round}: nothing the killed child wrote survived"
        );
        let g3 = &store.metrics().g3;
        let corrupt = g3.corrupt_blocks.get();
        assert_eq!(
            served as u64 + corrupt,
            found.len() as u64,
            "round {round}: every indexed block is either served intact or rejected as corrupt"
        );
        // What was rejected is gone; what was served is still there.
        assert_eq!(disk.len(), served);
        for (k, b) in found.iter().zip(&got) {
            assert_eq!(store.lookup_prefix(&[*k]).hits(), usize::from(b.is_some()));
        }
        eprintln!(
            "round {round}: kill {delay_ms} ms after ready; {} indexed, {served} served \
             ({served_this_round} from this round), {corrupt} rejected",
            found.len()
        );
        served_total += served;
        corrupt_total += corrupt;
        store.close().unwrap();
    }
    assert!(served_total > 0, "no block survived any of the kills");
    // At most a block or two per kill can be torn.
    assert!(
        corrupt_total <= 5 * 8,
        "{corrupt_total} corrupt blocks after 5 kills"
    );
}
