//! G3 faults: flipped bytes, truncated segments and a full device. A block
//! that is not intact is never served; everything intact still is.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kvtier_store::block::HEADER_BYTES;
use kvtier_store::{BlockKey, DiskConfig, DiskError, DiskTier, StoreConfig, Tier, TieredStore};

fn config(dir: &Path) -> StoreConfig {
    let mut c = store_config(Some(dir), 256, 32);
    c.disk = Some(disk_config(dir, 32, 8));
    c
}

/// Writes `ks` through a store on `dir`, closes it, and returns where each
/// block lives (found by reopening).
fn write_and_locate(dir: &Path, ks: &[BlockKey]) -> HashMap<BlockKey, (PathBuf, u64)> {
    let store = open(config(dir));
    put(&store, ks);
    store.close().expect("close");
    let store = open(config(dir));
    let disk = store.disk().expect("G3 configured");
    let map = ks
        .iter()
        .map(|k| (*k, disk.locate_key(k).expect("block on disk")))
        .collect();
    store.close().expect("close");
    map
}

/// Writes `ks` and flips a byte inside the key field of `ks[i]`'s header;
/// returns that key.
fn with_a_flipped_key_byte(dir: &Path, ks: &[BlockKey], i: usize) -> BlockKey {
    let loc = write_and_locate(dir, ks);
    let (path, off) = &loc[&ks[i]];
    flip_byte(path, off + 12);
    ks[i]
}

/// The bad block's slot is free again: a full set of new blocks fits
/// without evicting any of the intact ones (32 slots, 7 used), and after a
/// reopen the bad block is still gone.
fn assert_slot_reused_and_block_gone(store: TieredStore, dir: &Path, bad: &BlockKey) {
    let fresh = keys(100..125);
    put(&store, &fresh);
    store.evict_memory().expect("evict G2");
    assert_eq!(store.metrics().g3.evictions.get(), 0);
    assert_eq!(store.stats().g3_blocks, 32);
    store.close().expect("close");
    let store = open(config(dir));
    assert!(!store.disk().expect("G3 configured").contains(bad));
    assert_eq!(store.stats().g3_blocks, 32);
}

#[test]
fn a_flipped_payload_byte_is_detected_deleted_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..8);
    let bad = ks[3];
    let loc = write_and_locate(dir.path(), &ks);
    let (path, off) = &loc[&bad];
    flip_byte(path, off + HEADER_BYTES as u64 + 5000);

    let store = open(config(dir.path()));
    // The header is intact, so the index has the block until it is read.
    assert!(store.disk().unwrap().contains(&bad));
    let got = store.get_many(&ks);
    assert!(got[3].is_none(), "corrupt block served");
    let good: Vec<_> = ks.iter().copied().filter(|k| *k != bad).collect();
    let good_got: Vec<_> = got
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(_, b)| b)
        .collect();
    let tiers = assert_all_hits(&good, &good_got);
    assert!(tiers.iter().all(|&t| t == Tier::G3));
    let g3 = &store.metrics().g3;
    assert_eq!(g3.corrupt_blocks.get(), 1);
    assert_eq!(g3.hits.get(), 7);
    assert!(!store.disk().unwrap().contains(&bad));
    assert_eq!(
        store.lookup_prefix(&ks).hits(),
        3,
        "prefix stops at the deleted block"
    );
    assert_eq!(store.stats().g3_blocks, 7);

    // A second read is a plain miss.
    let misses = g3.misses.get();
    assert!(store.get_many(&[bad]).remove(0).is_none());
    assert_eq!(g3.corrupt_blocks.get(), 1);
    assert_eq!(g3.misses.get(), misses + 1);
    store.close().unwrap();

    // Deleted for good: its header was wiped.
    let store = open(config(dir.path()));
    assert!(!store.disk().unwrap().contains(&bad));
    assert!(store.get_many(&[bad]).remove(0).is_none());
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 0);
    let tiers = assert_all_hits(&good, &store.get_many(&good));
    assert!(tiers.iter().all(|&t| t == Tier::G3));
    // The key can be stored again, into a working slot.
    put(&store, &[bad]);
    store.evict_memory().unwrap();
    assert_all_hits(&[bad], &store.get_many(&[bad]));
    store.close().unwrap();
    let store = open(config(dir.path()));
    assert_all_hits(&ks, &store.get_many(&ks));
}

/// `corrupt_blocks` counts "blocks that failed verification": one corrupt
/// block asked for twice in one batch is still one corrupt block.
#[test]
fn a_corrupt_block_asked_for_twice_in_one_read_counts_once() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..4);
    let bad = ks[1];
    let loc = write_and_locate(dir.path(), &ks);
    let (path, off) = &loc[&bad];
    flip_byte(path, off + HEADER_BYTES as u64 + 1000);

    let store = open(config(dir.path()));
    let got = store.get_many(&[bad, ks[2], bad]);
    assert!(got[0].is_none() && got[2].is_none(), "corrupt block served");
    assert_all_hits(&ks[2..3], &got[1..2]);
    assert!(!store.disk().unwrap().contains(&bad));
    assert_eq!(
        store.metrics().g3.corrupt_blocks.get(),
        1,
        "one corrupt block, counted once"
    );
}

#[test]
fn a_flipped_header_byte_is_a_miss_counted_once_and_its_slot_reused() {
    // With the saved index the open does not read the slot: the block is
    // indexed until its first read, which rejects it.
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..8);
    let bad = with_a_flipped_key_byte(dir.path(), &ks, 5);

    let store = open(config(dir.path()));
    assert!(matches!(
        store.disk().unwrap().recovery(),
        kvtier_store::Recovery::Saved { blocks: 8, .. }
    ));
    let got = store.get_many(&ks);
    assert!(
        got[5].is_none(),
        "a block with a flipped header byte was served"
    );
    assert_eq!(got.iter().flatten().count(), 7);
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 1);
    assert!(!store.disk().unwrap().contains(&bad));
    // Its wipe was journaled: it does not come back.
    assert_slot_reused_and_block_gone(store, dir.path(), &bad);
}

#[test]
fn a_flipped_header_byte_drops_the_block_at_a_scanning_open() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..8);
    let bad = with_a_flipped_key_byte(dir.path(), &ks, 5);
    // Without the saved index the open reads every header.
    std::fs::remove_file(slot_dir(dir.path()).join("index.kvti")).unwrap();

    let store = open(config(dir.path()));
    assert!(matches!(
        store.disk().unwrap().recovery(),
        kvtier_store::Recovery::Scanned { .. }
    ));
    assert!(!store.disk().unwrap().contains(&bad));
    assert_eq!(store.stats().g3_blocks, 7);
    assert_eq!(store.lookup_prefix(&ks).hits(), 5);
    let got = store.get_many(&ks);
    assert!(got[5].is_none());
    for (k, b) in ks.iter().zip(&got) {
        if *k != bad {
            let b = b.as_ref().unwrap_or_else(|| panic!("{k} lost"));
            assert_eq!(b.tier, Tier::G3);
            assert_content(b);
        }
    }
    assert_slot_reused_and_block_gone(store, dir.path(), &bad);
}

#[test]
fn a_truncated_segment_loses_only_the_blocks_at_and_after_the_cut() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..32); // fills all 32 slots: 4 segments of 8
    let loc = write_and_locate(dir.path(), &ks);
    let seg1 = slot_dir(dir.path()).join("seg-00001.kvt");
    let seg3 = slot_dir(dir.path()).join("seg-00003.kvt");
    assert_eq!(std::fs::metadata(&seg1).unwrap().len(), 8 * SLOT);
    // Segment 1: cut in the middle of slot 2's payload. Segment 3: cut
    // inside slot 5's header.
    let cut1 = 2 * SLOT + SLOT / 2;
    let cut3 = 5 * SLOT + 64;
    for (p, cut) in [(&seg1, cut1), (&seg3, cut3)] {
        let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.set_len(cut).unwrap();
        f.sync_all().unwrap();
    }

    let store = open(config(dir.path()));
    assert_eq!(
        std::fs::metadata(&seg1).unwrap().len(),
        8 * SLOT,
        "reopen re-extends the segment"
    );
    let got = store.get_many(&ks);
    let mut served = 0;
    for (k, b) in ks.iter().zip(&got) {
        let (path, off) = &loc[k];
        let cut = if *path == seg1 {
            Some(cut1)
        } else if *path == seg3 {
            Some(cut3)
        } else {
            None
        };
        let intact = cut.is_none_or(|c| off + SLOT <= c);
        match b {
            Some(b) => {
                assert!(intact, "{k} at {path:?}+{off} served despite the cut");
                assert_eq!(b.tier, Tier::G3);
                assert_content(b);
                served += 1;
            }
            None => assert!(!intact, "intact {k} at {path:?}+{off} was lost"),
        }
    }
    // 32 blocks - (6 in seg 1 from slot 2 on) - (3 in seg 3 from slot 5 on).
    assert_eq!(served, 23);
    // Slot 2 of segment 1 had an intact header: found, read, rejected.
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 1);
    assert_eq!(store.stats().g3_blocks, 23);
    store.close().unwrap();
    let store = open(config(dir.path()));
    assert_eq!(store.stats().g3_blocks, 23);
    assert_eq!(store.get_many(&ks).iter().flatten().count(), 23);
}

#[test]
fn a_segment_truncated_to_nothing_opens_empty() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..32);
    let loc = write_and_locate(dir.path(), &ks);
    let seg0 = slot_dir(dir.path()).join("seg-00000.kvt");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&seg0)
        .unwrap()
        .set_len(0)
        .unwrap();
    let store = open(config(dir.path()));
    assert_eq!(store.stats().g3_blocks, 24);
    for (k, b) in ks.iter().zip(store.get_many(&ks)) {
        let in_seg0 = loc[k].0 == seg0;
        assert_eq!(b.is_none(), in_seg0, "{k}");
        if let Some(b) = b {
            assert_content(&b);
        }
    }
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 0);
}

/// A tmpfs of `size` mounted on a fresh temporary directory for the life of
/// the value (unmounted lazily on drop, then the directory is removed).
struct TmpfsMount {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl TmpfsMount {
    fn new(size: &str) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().to_path_buf();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => panic!(
                "this test needs root to mount a {size} tmpfs on {path:?} (CI runs as root): \
                 mount failed with {}: {}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => panic!("this test needs `mount` (and root) to fill a tmpfs: {e}"),
        }
        Self { path, _dir: dir }
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

#[test]
fn a_removed_block_does_not_come_back_at_the_next_open() {
    // `DiskTier::remove` is for blocks refused after a whole read (rows
    // other than asked for): their headers are wiped, so neither the saved
    // index nor a scan of every slot's header finds them again.
    let dir = tempfile::tempdir().unwrap();
    let dc = disk_config(dir.path(), 16, 8);
    let ks = keys(0..4);
    {
        let (tier, _) = open_disk(dc.clone());
        for k in &ks {
            tier.put_many(&[(*k, encoded(k))]).remove(0).unwrap();
        }
        assert!(tier.remove(&ks[1]));
        assert!(!tier.remove(&ks[1]), "removed once");
        tier.sync().unwrap();
    }
    for scan in [false, true] {
        if scan {
            std::fs::remove_file(slot_dir(dir.path()).join("index.kvti")).unwrap();
        }
        let (tier, _) = open_disk(dc.clone());
        assert_eq!(
            matches!(tier.recovery(), kvtier_store::Recovery::Scanned { .. }),
            scan
        );
        assert!(
            !tier.contains(&ks[1]),
            "a removed block came back (scan: {scan})"
        );
        check_all(&tier, &[ks[0], ks[2], ks[3]]);
    }
}

#[test]
fn a_full_device_fails_puts_cleanly_and_damages_nothing() {
    let mnt = TmpfsMount::new("1m");
    // A 256 KiB filler that is deleted later to make room again.
    let filler = mnt.path.join("filler");
    std::fs::write(&filler, vec![1u8; 256 * 1024]).unwrap();

    // 256 slots = 5 MiB of sparse segments on a 1 MiB device.
    let mut dc = disk_config(&mnt.path, 256, 64);
    dc.direct = Some(false);
    let (tier, metrics) = open_disk(dc.clone());
    assert!(!tier.direct());

    let mut stored: Vec<BlockKey> = Vec::new();
    let mut failed = 0u64;
    let mut i = 0u64;
    while failed < 3 {
        assert!(i < 1000, "a 1 MiB tmpfs never filled up");
        let k = key(i);
        i += 1;
        match tier.put_many(&[(k, encoded(&k))]).remove(0) {
            Ok(_) => {
                assert_eq!(failed, 0, "a put succeeded after the device was full");
                stored.push(k);
            }
            Err(DiskError::Io(e)) => {
                assert_eq!(e.kind(), std::io::ErrorKind::StorageFull, "{e}");
                failed += 1;
            }
            Err(other) => panic!("unexpected error {other:?}"),
        }
    }
    assert!(stored.len() > 10, "only {} blocks fit", stored.len());
    assert_eq!(metrics.put_errors.get(), failed);
    assert_eq!(tier.len(), stored.len());
    check_all(&tier, &stored);
    assert_eq!(metrics.corrupt_blocks.get(), 0);

    // A failed batch of several blocks fails each of them, cleanly.
    let batch: Vec<_> = keys(5000..5004).iter().map(|k| (*k, encoded(k))).collect();
    for r in tier.put_many(&batch) {
        assert!(matches!(r, Err(DiskError::Io(_))), "{r:?}");
    }
    assert_eq!(metrics.put_errors.get(), failed + 4);
    check_all(&tier, &stored);
    assert_eq!(tier.len(), stored.len(), "failed puts are not indexed");

    // Restart on the full device: everything stored is intact.
    drop(tier);
    let tier = reopen_and_check(&dc, &stored);

    // Make room: new puts work again and the old blocks are untouched.
    std::fs::remove_file(&filler).unwrap();
    let more = keys(6000..6004);
    let batch: Vec<_> = more.iter().map(|k| (*k, encoded(k))).collect();
    for r in tier.put_many(&batch) {
        assert!(r.is_ok(), "{r:?}");
    }
    stored.extend(more);
    check_all(&tier, &stored);
    drop(tier);
    reopen_and_check(&dc, &stored);
}

/// Reads every key of `stored` from `tier` and checks its bytes.
fn check_all(tier: &DiskTier, stored: &[BlockKey]) {
    let got = tier.get_many(stored);
    for (k, b) in stored.iter().zip(got) {
        let b = b.unwrap_or_else(|| panic!("{k} lost after ENOSPC"));
        assert_encoded(k, &b);
    }
}

/// Reopens the tier: every block of `stored` is served intact; any other
/// key the index finds (a slot a failed put wrote partly) must fail
/// verification, never be served.
fn reopen_and_check(dc: &DiskConfig, stored: &[BlockKey]) -> DiskTier {
    let (tier, metrics) = open_disk(dc.clone());
    check_all(&tier, stored);
    assert_eq!(metrics.corrupt_blocks.get(), 0);
    let all = tier.keys();
    let extra: Vec<_> = all
        .iter()
        .filter(|k| !stored.contains(k))
        .copied()
        .collect();
    assert_eq!(all.len(), stored.len() + extra.len());
    for (k, b) in extra.iter().zip(tier.get_many(&extra)) {
        assert!(
            b.is_none(),
            "{k}, never stored whole, was served after a restart"
        );
    }
    assert_eq!(metrics.corrupt_blocks.get(), extra.len() as u64);
    assert_eq!(tier.len(), stored.len());
    eprintln!(
        "reopened: {} blocks, {} partial slots of failed puts indexed then rejected",
        stored.len(),
        extra.len()
    );
    tier
}

#[test]
fn a_store_on_a_full_device_keeps_accepting_puts_and_flush_returns() {
    let mnt = TmpfsMount::new("1m");
    let mut config = store_config(Some(&mnt.path), 0, 0);
    let mut dc = disk_config(&mnt.path, 256, 64);
    dc.direct = Some(false);
    config.disk = Some(dc);
    config.writeback_max_bytes = 4 * SLOT;
    let store = open(config);
    let ks = keys(0..100); // ~2 MiB of blocks for a 1 MiB device
    for chunk in ks.chunks(5) {
        let r = put(&store, chunk);
        assert_eq!(r.stored, chunk.len());
    }
    store.flush().unwrap();
    let g3 = &store.metrics().g3;
    let errors = g3.put_errors.get();
    let on_disk = store.stats().g3_blocks;
    assert!(errors > 0, "the device never filled");
    assert!(on_disk > 10, "only {on_disk} blocks fit");
    assert_eq!(
        on_disk as u64 + errors,
        100,
        "every block is either on disk or counted as a failed put"
    );
    assert_eq!(store.stats().writeback_pending, 0);
    let text = store.metrics().render();
    assert_eq!(
        metric(&text, "kvtier_store_put_errors_total", "g3"),
        errors as f64
    );

    // Everything that made it is intact, and reads keep working.
    let disk_keys = store.disk().unwrap().keys();
    let tiers = assert_all_hits(&disk_keys, &store.get_many(&disk_keys));
    assert!(tiers.iter().all(|&t| t == Tier::G3));
    let served = store.get_many(&ks).iter().flatten().count();
    assert_eq!(served, on_disk);
    store.close().unwrap();
}
