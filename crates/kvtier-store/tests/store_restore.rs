//! The restore path: `read_prefix` reads the leading cached blocks in one
//! pass across G2 and G3 and stops at the first miss (a corrupt block is a
//! miss); `read_prefix_async` does it on the store's reader threads behind
//! a handle; `offer` stores blocks filled in place and never waits.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::*;
use kvtier_store::block::HEADER_BYTES;
use kvtier_store::{BlockKey, Tier};

#[test]
fn read_prefix_reads_g2_and_g3_in_one_pass_and_stops_at_the_first_miss() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    // 2..6 on disk only, 0..2 in G2; 6 nowhere; 7..9 in G2 past the gap.
    put(&store, &keys(2..6));
    store.evict_memory().unwrap();
    put(&store, &keys(0..2));
    put(&store, &keys(7..9));
    let m = store.metrics();
    let (g3_hits, g3_misses) = (m.g3.hits.get(), m.g3.misses.get());

    let got = store.read_prefix(&keys(0..9));
    let tiers: Vec<Tier> = got.iter().map(|b| b.tier).collect();
    assert_eq!(tiers, [vec![Tier::G2; 2], vec![Tier::G3; 4]].concat());
    for (b, k) in got.iter().zip(keys(0..6)) {
        assert_eq!(b.key, k);
        assert_content(b);
    }
    assert_eq!(m.g3.hits.get() - g3_hits, 4, "each G3 block read once");
    assert_eq!(
        m.g3.misses.get() - g3_misses,
        1,
        "the walk stops at the first key no tier holds"
    );
    // G3 hits were promoted: the same prefix now comes from G2 alone.
    let again = store.read_prefix(&keys(0..9));
    assert_eq!(again.len(), 6);
    assert!(again.iter().all(|b| b.tier == Tier::G2));
    assert!(store.read_prefix(&keys(6..9)).is_empty());
    assert!(store.read_prefix(&[]).is_empty());
}

#[test]
fn a_corrupt_block_ends_the_prefix_and_is_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    let ks = keys(0..8);
    put(&store, &ks);
    store.evict_memory().unwrap();
    let (path, off) = store.disk().unwrap().locate_key(&ks[3]).unwrap();
    flip_byte(&path, off + HEADER_BYTES as u64 + 100);

    let got = store.read_prefix(&ks);
    assert_eq!(got.len(), 3, "blocks 0..3, then the corrupt block 3");
    got.iter().for_each(assert_content);
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 1);
    assert!(!store.disk().unwrap().contains(&ks[3]), "deleted");
}

#[test]
fn read_prefix_async_gives_the_same_blocks_and_wakes_its_caller() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    let ks = keys(0..12);
    put(&store, &ks[..10]);
    store.evict_memory().unwrap();

    let (tx, rx) = mpsc::channel();
    let handle = store.read_prefix_async(ks.clone(), None, move || {
        let _ = tx.send(std::thread::current().name().map(str::to_string));
    });
    let woke_on = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("notified when done");
    assert_eq!(
        woke_on.as_deref(),
        Some("kvtier-read"),
        "off the caller's thread"
    );
    assert!(handle.is_done());
    let got = handle.wait().expect("finished, not cancelled");
    assert_eq!(got.len(), 10);
    assert!(got.iter().all(|b| b.tier == Tier::G3));
    got.iter().for_each(assert_content);

    // A cancelled read hands nothing back, and still wakes its caller.
    let (tx, rx) = mpsc::channel();
    let handle = store.read_prefix_async(ks, None, move || {
        let _ = tx.send(());
    });
    handle.cancel();
    rx.recv_timeout(Duration::from_secs(30)).expect("notified");
    assert!(handle.is_done());
}

#[test]
fn a_store_closed_once_its_async_read_is_done_reopens_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = || store_config(Some(dir.path()), 256, 64);
    let store = open(config());
    let ks = keys(0..4);
    put(&store, &ks);
    store.evict_memory().unwrap();

    // The callback holds the reader thread until the store is reopened:
    // the read's job must not keep the store (and its directory's owner
    // lock) past telling its caller it is done.
    let (done_tx, done_rx) = mpsc::channel();
    let (reopened_tx, reopened_rx) = mpsc::channel::<()>();
    let handle = store.read_prefix_async(ks.clone(), None, move || {
        let _ = done_tx.send(());
        let _ = reopened_rx.recv_timeout(Duration::from_secs(30));
    });
    done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("notified when done");
    assert_eq!(handle.wait().expect("finished").len(), 4);
    drop(store);
    let again = kvtier_store::TieredStore::open(config());
    let _ = reopened_tx.send(());
    let again = again.expect("reopened while the read's thread was still in its callback");
    assert_eq!(again.read_prefix(&ks).len(), 4);
}

/// Fills a block the way an engine exports a page: straight into the
/// store's buffer.
fn filled(store: &kvtier_store::TieredStore, key: &BlockKey) -> kvtier_store::BlockBuf {
    let mut b = store.new_block().expect("a block buffer");
    b.payload_mut().copy_from_slice(&payload(key));
    b
}

#[test]
fn offered_blocks_are_stored_like_puts_and_read_back_verified() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    let ks = keys(0..6);
    let report = store.offer(ks.iter().map(|k| (*k, filled(&store, k))).collect());
    assert_eq!(report.stored, 6);
    let again = store.offer(ks[..2].iter().map(|k| (*k, filled(&store, k))).collect());
    assert_eq!((again.stored, again.present), (0, 2));
    assert_all_hits(&ks, &store.get_many(&ks));
    store.evict_memory().unwrap();
    let got = store.read_prefix(&ks);
    assert_eq!(got.len(), 6);
    got.iter().for_each(assert_content);
}

#[test]
fn offer_never_waits_for_the_disk_it_drops_and_counts_instead() {
    let dir = tempfile::tempdir().unwrap();
    // One block of G2 and one of write-back queue: 50 blocks offered at
    // once evict 49, of which the queue takes one.
    let mut config = store_config(Some(dir.path()), 1, 128);
    config.writeback_max_bytes = SLOT;
    let store = open(config);
    let ks = keys(0..50);
    let report = store.offer(ks.iter().map(|k| (*k, filled(&store, k))).collect());
    assert_eq!(report.stored, 50);
    let dropped = store.metrics().writeback_dropped.get();
    assert_eq!(dropped, 48, "past the queue's bound: dropped, counted");
    store.flush().unwrap();
    let s = store.stats();
    assert_eq!(s.g3_blocks, 2, "the queued block and the one left in G2");
    assert_eq!(s.g3_blocks as u64 + dropped, 50, "nothing else lost");
    let text = store.metrics().render();
    assert!(
        text.contains("kvtier_store_writeback_dropped_total 48"),
        "{text}"
    );
}
