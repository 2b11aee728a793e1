//! A clean stop keeps the cache: reopening a store on the same directory
//! serves every block from G3 with identical bytes. Layouts with other slot
//! sizes live apart; other configurations never serve each other's blocks.

mod common;

use common::*;
use kvtier_store::{StoreConfig, Tier};

fn assert_reopened_from_g3(config: StoreConfig, ks: &[kvtier_store::BlockKey]) {
    let store = open(config);
    let s = store.stats();
    assert_eq!(s.g2_blocks, 0);
    assert_eq!(s.g3_blocks, ks.len(), "{s:?}");
    let look = store.lookup_prefix(ks);
    assert_eq!(look.hits_in(Tier::G3), ks.len(), "{look:?}");
    let tiers = assert_all_hits(ks, &store.get_many(ks));
    assert!(tiers.iter().all(|&t| t == Tier::G3), "{tiers:?}");
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 0);
    assert_eq!(store.metrics().g3.hits.get(), ks.len() as u64);
}

#[test]
fn close_then_reopen_serves_every_block_from_g3() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..20);
    let store = open(store_config(Some(dir.path()), 256, 64));
    put(&store, &ks);
    // Everything is still dirty in G2: close must write it.
    assert_eq!(store.stats().g3_blocks, 0);
    store.close().unwrap();
    assert_reopened_from_g3(store_config(Some(dir.path()), 256, 64), &ks);
    // And once more: reading and closing changes nothing on disk.
    assert_reopened_from_g3(store_config(Some(dir.path()), 256, 64), &ks);
}

#[test]
fn dropping_the_last_handle_persists_like_close() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..24);
    {
        // Small G2: some blocks go through write-back, the rest are dirty in
        // G2 when the last handle drops.
        let store = open(store_config(Some(dir.path()), 6, 64));
        let other = store.clone();
        put(&store, &ks[..12]);
        drop(store);
        put(&other, &ks[12..]);
        assert!(other.stats().g2_blocks > 0);
        drop(other);
    }
    assert_reopened_from_g3(store_config(Some(dir.path()), 256, 64), &ks);
}

#[test]
fn persist_on_close_off_keeps_only_what_was_written_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = store_config(Some(dir.path()), 256, 64);
    config.persist_on_close = false;
    let store = open(config.clone());
    put(&store, &keys(0..8));
    store.evict_memory().unwrap(); // these 8 are on disk now
    put(&store, &keys(8..16)); // these stay in G2 only
    store.close().unwrap();

    let store = open(config);
    assert_eq!(store.stats().g3_blocks, 8);
    assert_all_hits(&keys(0..8), &store.get_many(&keys(0..8)));
    assert!(store.get_many(&keys(8..16)).iter().all(Option::is_none));
}

#[test]
fn reopening_with_a_layout_of_another_slot_size_sees_none_of_the_old_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..10);
    let store = open(store_config(Some(dir.path()), 256, 64));
    put(&store, &ks);
    store.close().unwrap();

    let mut other = store_config(Some(dir.path()), 256, 64);
    other.layout = other_size_layout();
    let other_slot = other_size_layout().encoded_bytes();
    assert_ne!(other_slot, SLOT);
    let store = open(other.clone());
    assert_eq!(store.stats().g3_blocks, 0);
    assert_eq!(store.lookup_prefix(&ks).hits(), 0);
    assert!(store.get_many(&ks).iter().all(Option::is_none));
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 0);
    // The other layout works on its own slot directory.
    let big = vec![3u8; other_size_layout().payload_bytes() as usize];
    let other_keys = keys(500..504);
    let refs: Vec<_> = other_keys.iter().map(|k| (*k, big.as_slice())).collect();
    store.put_many(&refs).unwrap();
    store.close().unwrap();
    assert!(
        kvtier_store::DiskTier::slot_dir(dir.path(), &other_size_layout()).is_dir(),
        "other layout has its own slot directory"
    );

    // The first layout's blocks were not touched.
    assert_reopened_from_g3(store_config(Some(dir.path()), 256, 64), &ks);
    let store = open(other);
    let got = store.get_many(&other_keys);
    assert!(
        got.iter()
            .all(|b| b.as_ref().is_some_and(|b| b.payload() == big.as_slice()))
    );
    assert_eq!(store.lookup_prefix(&ks).hits(), 0);
}

/// docs/store.md: "different layouts use different slot directories and
/// never see each other's blocks"; disk.rs: a header that "belongs to
/// another layout marks the slot free". A layout with the same encoded size
/// (f16 x 128 dims vs f32 x 64 dims) shares the slot directory, so the
/// header's layout is what has to keep its blocks apart.
#[test]
fn a_same_size_layout_never_serves_the_other_layouts_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(0..6);
    let store = open(store_config(Some(dir.path()), 256, 64));
    put(&store, &ks);
    store.close().unwrap();

    let mut other = store_config(Some(dir.path()), 256, 64);
    other.layout = same_size_other_layout();
    assert_eq!(other.layout.encoded_bytes(), SLOT);
    assert_ne!(other.layout, layout());
    let store = open(other);
    let got = store.get_many(&ks);
    for (k, b) in ks.iter().zip(&got) {
        if let Some(b) = b {
            let (header, _) = kvtier_store::block::decode_block(b.encoded(), Some(k)).unwrap();
            panic!(
                "store with layout {} served block {k} whose header says layout {}",
                store.layout(),
                header.layout
            );
        }
    }
    assert_eq!(store.lookup_prefix(&ks).hits(), 0);
}

#[test]
fn two_directories_stripe_blocks_and_survive_restart() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let config = || {
        let mut c = store_config(Some(a.path()), 256, 0);
        let mut dc = disk_config(a.path(), 32, 4);
        dc.dirs = vec![a.path().to_path_buf(), b.path().to_path_buf()];
        c.disk = Some(dc);
        c
    };
    let ks = keys(0..20);
    let store = open(config());
    assert_eq!(store.stats().g3_slots, 32);
    put(&store, &ks);
    store.close().unwrap();

    let store = open(config());
    let disk = store.disk().unwrap();
    let mut per_dir = [0usize; 2];
    for k in &ks {
        let (path, off) = disk.locate_key(k).unwrap();
        assert_eq!(off % SLOT, 0);
        if path.starts_with(slot_dir(a.path())) {
            per_dir[0] += 1;
        } else {
            assert!(path.starts_with(slot_dir(b.path())), "{path:?}");
            per_dir[1] += 1;
        }
    }
    assert_eq!(per_dir, [10, 10], "20 blocks on 2 directories, striped");
    drop(store);
    assert_reopened_from_g3(config(), &ks);
}
