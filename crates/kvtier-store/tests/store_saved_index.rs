//! G3's saved index (checkpoint + journal): a clean reopen reads it instead
//! of every slot; a torn, foreign or missing one is a full scan that finds
//! the same blocks; a stale one (older files put back) never makes a wrong
//! block served. Kill -9 reopens are in store_crash.rs.

// Test helpers may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::*;
use kvtier_store::{DiskConfig, Recovery, Tier};

fn open_with(dir: &Path, disk: DiskConfig) -> kvtier_store::TieredStore {
    let mut c = store_config(Some(dir), 4, 0);
    c.disk = Some(disk);
    open(c)
}

fn write_blocks(dir: &Path, disk: DiskConfig, ks: &[kvtier_store::BlockKey]) {
    let store = open_with(dir, disk);
    put(&store, ks);
    store.close().unwrap();
}

#[test]
fn a_clean_reopen_reads_the_checkpoint_and_finds_every_block() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..40);
    write_blocks(dir.path(), disk_config(dir.path(), 64, 16), &ks);
    let store = open_with(dir.path(), disk_config(dir.path(), 64, 16));
    assert_eq!(
        store.disk().unwrap().recovery(),
        &Recovery::Saved {
            blocks: 40,
            replayed: 0
        }
    );
    let tiers = assert_all_hits(&ks, &store.get_many(&ks));
    assert!(tiers.iter().all(|t| *t == Tier::G3));
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 0);
}

#[test]
fn a_torn_or_missing_checkpoint_is_a_scan_that_finds_the_same_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..24);
    write_blocks(dir.path(), disk_config(dir.path(), 32, 8), &ks);
    let index = slot_dir(dir.path()).join("index.kvti");
    for damage in ["torn", "flipped", "missing"] {
        match damage {
            "torn" => {
                let len = std::fs::metadata(&index).unwrap().len();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&index)
                    .unwrap()
                    .set_len(len - 7)
                    .unwrap();
            }
            "flipped" => flip_byte(&index, 70),
            _ => std::fs::remove_file(&index).unwrap(),
        }
        let store = open_with(dir.path(), disk_config(dir.path(), 32, 8));
        match store.disk().unwrap().recovery() {
            Recovery::Scanned { why } => eprintln!("{damage}: {why}"),
            other => panic!("{damage}: a damaged checkpoint was used: {other:?}"),
        }
        assert_all_hits(&ks, &store.get_many(&ks));
        // The scan's result is saved again: the next open reads it.
        store.close().unwrap();
        let store = open_with(dir.path(), disk_config(dir.path(), 32, 8));
        assert!(matches!(
            store.disk().unwrap().recovery(),
            Recovery::Saved { blocks: 24, .. }
        ));
        store.close().unwrap();
    }
}

#[test]
fn a_checkpoint_of_another_shape_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..16);
    write_blocks(dir.path(), disk_config(dir.path(), 32, 8), &ks);
    // Twice the capacity: a new segment set, another shape.
    let store = open_with(dir.path(), disk_config(dir.path(), 64, 8));
    assert!(matches!(
        store.disk().unwrap().recovery(),
        Recovery::Scanned { .. }
    ));
    assert_all_hits(&ks, &store.get_many(&ks));
}

#[test]
fn a_stale_checkpoint_put_back_never_serves_a_wrong_block() {
    let dir = tempfile::tempdir().unwrap();
    let sd = slot_dir(dir.path());
    let old = keys(0..16);
    write_blocks(dir.path(), disk_config(dir.path(), 16, 8), &old);
    // Keep the files that describe `old`.
    let saved: Vec<(std::path::PathBuf, Vec<u8>)> = std::fs::read_dir(&sd)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n == "index.kvti" || n.starts_with("journal-")
        })
        .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
        .collect();
    assert!(saved.len() >= 2, "{saved:?}");
    // Overwrite every slot with other blocks.
    let new = keys(100..116);
    write_blocks(dir.path(), disk_config(dir.path(), 16, 8), &new);
    // Put the old files back in place of the new ones.
    for e in std::fs::read_dir(&sd).unwrap() {
        let p = e.unwrap().path();
        let n = p.file_name().unwrap().to_string_lossy().into_owned();
        if n == "index.kvti" || n.starts_with("journal-") {
            std::fs::remove_file(&p).unwrap();
        }
    }
    for (p, bytes) in &saved {
        std::fs::write(p, bytes).unwrap();
    }
    let store = open_with(dir.path(), disk_config(dir.path(), 16, 8));
    assert!(matches!(
        store.disk().unwrap().recovery(),
        Recovery::Saved { blocks: 16, .. }
    ));
    // The index names the old keys; their slots hold the new blocks.
    let got = store.get_many(&old);
    assert!(
        got.iter().all(Option::is_none),
        "a block of an overwritten key was served from a stale index"
    );
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 16);
    // What is served is always right: a new put, then a read, verifies.
    put(&store, &new[..4]);
    store.evict_memory().unwrap();
    assert_all_hits(&new[..4], &store.get_many(&new[..4]));
}
