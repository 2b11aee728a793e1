//! Bounded write-back: after a kill -9, every block put more than the sync
//! interval before the kill is served from G3, with its key's bytes; with
//! the sync off, the same blocks (which never left G2) are lost, so the
//! test tells the two apart.
//!
//! The test re-executes its own binary as a child (selected by an
//! environment variable) that puts blocks into a store whose G2 holds them
//! all (nothing is evicted), says so, and waits to be killed.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvtier_store::{StoreConfig, Tier};

const TEST_NAME: &str = "kill_9_loses_no_block_older_than_the_sync_interval";
const CHILD_DIR_ENV: &str = "KVTIER_SYNC_CHILD";
const CHILD_SYNC_ENV: &str = "KVTIER_SYNC_CHILD_MS";
const READY: &str = "KVTIER_SYNC_CHILD_READY";
const BLOCKS: u64 = 24;
const SYNC_MS: u64 = 100;

fn config(dir: &Path, sync_ms: u64) -> StoreConfig {
    let mut c = store_config(Some(dir), 4 * BLOCKS, 4 * BLOCKS);
    c.g3_sync = (sync_ms > 0).then(|| Duration::from_millis(sync_ms));
    c
}

fn run_child(dir: &Path) -> ! {
    let sync_ms: u64 = std::env::var(CHILD_SYNC_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let store = open(config(dir, sync_ms));
    put(&store, &keys(0..BLOCKS));
    assert_eq!(store.disk().map(|d| d.len()), Some(0), "nothing evicted");
    // On its own line: libtest has printed "test <name> ... " already.
    println!("\n{READY}");
    std::thread::sleep(Duration::from_secs(20));
    eprintln!("sync child: not killed in time; exiting");
    std::process::exit(3);
}

/// Runs a child with the sync every `sync_ms` (0: off), kills it with
/// SIGKILL `wait` after its blocks are in G2, and returns how many of them
/// a reopened store serves from G3 (each checked byte for byte).
fn blocks_after_kill(dir: &Path, sync_ms: u64, wait: Duration) -> usize {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(&exe)
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD_DIR_ENV, dir)
        .env(CHILD_SYNC_ENV, sync_ms.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let ready = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.trim_end().ends_with(READY));
    let ready_at = Instant::now();
    if !ready {
        let out = child.wait_with_output().unwrap();
        panic!(
            "the sync child never got ready ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::thread::sleep(wait.saturating_sub(ready_at.elapsed()));
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.signal(), Some(9), "{}", out.status);

    let store = open(config(dir, 0));
    let got = store.get_many(&keys(0..BLOCKS));
    let mut served = 0;
    for b in got.iter().flatten() {
        assert_eq!(b.tier, Tier::G3);
        assert_content(b);
        served += 1;
    }
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 0);
    served
}

#[test]
fn kill_9_loses_no_block_older_than_the_sync_interval() {
    if let Some(dir) = std::env::var_os(CHILD_DIR_ENV) {
        run_child(Path::new(&dir));
    }
    // Ten intervals after the puts: every block must be on G3.
    let synced = tempfile::tempdir().unwrap();
    let n = blocks_after_kill(synced.path(), SYNC_MS, Duration::from_millis(10 * SYNC_MS));
    assert_eq!(
        n as u64, BLOCKS,
        "blocks older than the sync bound were lost"
    );
    // The control: without the sync, the same blocks never left G2.
    let unsynced = tempfile::tempdir().unwrap();
    let n = blocks_after_kill(unsynced.path(), 0, Duration::from_millis(10 * SYNC_MS));
    assert_eq!(
        n, 0,
        "without the sync nothing should reach G3 before eviction"
    );
}
