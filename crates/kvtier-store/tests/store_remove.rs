//! `DiskTier::remove_dir`: a G3 no store owns goes, with only kvtier's own
//! files; an open one is refused and kept.

mod common;

use std::ffi::OsString;
use std::path::Path;

use common::*;
use kvtier_store::disk::{DiskError, DiskTier};

fn names(dir: &Path) -> Vec<OsString> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .expect("read the directory")
        .map(|e| e.expect("a directory entry").file_name())
        .collect();
    v.sort();
    v
}

#[test]
fn a_closed_store_is_removed_index_and_journals_included() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ns");
    let store = open(store_config(Some(&root), 64, 64));
    put(&store, &keys(0..10));
    drop(store);
    let slot_dir = std::fs::read_dir(root.join("kvtier-g3"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert!(names(&slot_dir).len() >= 3, "{:?}", names(&slot_dir));
    let n = DiskTier::remove_dir(&root).unwrap();
    assert!(n >= 3, "segments, the index and the lock file: {n}");
    assert!(!root.exists(), "every directory was kvtier's and is empty");
    assert_eq!(DiskTier::remove_dir(&root).unwrap(), 0);
}

#[test]
fn files_kvtier_did_not_write_stay_with_their_directories() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ns");
    let (tier, _) = open_disk(disk_config(&root, 16, 8));
    let slot_dir = tier.dirs()[0].clone();
    drop(tier);
    std::fs::write(slot_dir.join("notes.txt"), b"mine").unwrap();
    std::fs::write(root.join("README"), b"also mine").unwrap();
    assert!(DiskTier::remove_dir(&root).unwrap() >= 2);
    assert_eq!(names(&slot_dir), vec![OsString::from("notes.txt")]);
    assert_eq!(std::fs::read(slot_dir.join("notes.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read(root.join("README")).unwrap(), b"also mine");
}

#[test]
fn an_open_tier_is_refused_and_nothing_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ns");
    let (tier, _) = open_disk(disk_config(&root, 16, 8));
    let before = names(&tier.dirs()[0]);
    let err = DiskTier::remove_dir(&root).unwrap_err();
    assert!(matches!(err, DiskError::Locked { .. }), "{err}");
    assert_eq!(names(&tier.dirs()[0]), before);
    drop(tier);
    assert!(DiskTier::remove_dir(&root).unwrap() > 0);
}
