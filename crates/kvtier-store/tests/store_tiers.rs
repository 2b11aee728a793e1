//! TieredStore across G2 and G3: where blocks are served from, promotion,
//! prefix lookup, write-back under memory pressure, the admission filter,
//! bad input, metrics, and the async wrappers.

mod common;

use common::*;
use kvtier_store::{BlockError, StoreError, Tier};

#[test]
fn reads_come_from_g2_then_from_g3_after_evict_memory_and_g3_hits_are_promoted() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    let ks = keys(0..16);

    let report = put(&store, &ks);
    assert_eq!(report.stored, 16);
    assert_eq!(report.present, 0);
    let again = put(&store, &ks);
    assert_eq!(again.stored, 0, "blocks already in G2 are not stored twice");
    assert_eq!(again.present, 16);

    let look = store.lookup_prefix(&ks);
    assert_eq!(look.hits(), 16);
    assert_eq!(look.hits_in(Tier::G2), 16);
    let tiers = assert_all_hits(&ks, &store.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G2), "{tiers:?}");
    assert_eq!(store.metrics().g2.hits.get(), 16);
    assert_eq!(store.metrics().g3.hits.get(), 0);

    store.evict_memory().unwrap();
    let stats = store.stats();
    assert_eq!(stats.g2_blocks, 0);
    assert_eq!(stats.g2_bytes, 0);
    assert_eq!(stats.g3_blocks, 16);
    assert_eq!(stats.g3_slots, 64);
    assert_eq!(stats.writeback_pending, 0);
    let written = store.metrics().g3.written_bytes.get();
    assert_eq!(written, 16 * SLOT);

    let look = store.lookup_prefix(&ks);
    assert_eq!(look.hits_in(Tier::G3), 16, "{look:?}");

    let tiers = assert_all_hits(&ks, &store.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G3), "{tiers:?}");
    assert_eq!(store.metrics().g3.hits.get(), 16);
    assert_eq!(store.metrics().g3.read_bytes.get(), 16 * SLOT);

    // Promoted: the second read is served from memory, with the same bytes.
    assert_eq!(store.lookup_prefix(&ks).hits_in(Tier::G2), 16);
    let tiers = assert_all_hits(&ks, &store.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G2), "{tiers:?}");
    assert_eq!(store.metrics().g3.hits.get(), 16, "no second disk read");

    // Promoted blocks are known to be on disk: evicting them writes nothing.
    store.evict_memory().unwrap();
    assert_eq!(store.metrics().g3.written_bytes.get(), written);
    assert_eq!(store.stats().g3_blocks, 16);
    assert_all_hits(&ks, &store.get_many(&ks));
}

#[test]
fn lookup_prefix_stops_at_the_first_missing_key_and_counts_per_tier() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    let ks = keys(0..6);
    put(&store, &ks);
    store.evict_memory().unwrap();
    // Promote the first two back into G2.
    assert_all_hits(&ks[..2], &store.get_many(&ks[..2]));

    let mut query = ks.clone();
    query.push(key(1000)); // never stored
    query.extend(keys(2..4)); // cached, but after the gap
    let look = store.lookup_prefix(&query);
    assert_eq!(look.hits(), 6);
    assert_eq!(look.hits_in(Tier::G2), 2);
    assert_eq!(look.hits_in(Tier::G3), 4);
    assert_eq!(
        look.tiers,
        vec![Tier::G2, Tier::G2, Tier::G3, Tier::G3, Tier::G3, Tier::G3]
    );

    let mut gap_first = vec![key(1000)];
    gap_first.extend(ks.iter().copied());
    assert_eq!(store.lookup_prefix(&gap_first).hits(), 0);
    assert_eq!(store.lookup_prefix(&[]).hits(), 0);

    // get_many is not a prefix operation: it serves what is there.
    let got = store.get_many(&query);
    assert_eq!(got.iter().filter(|b| b.is_some()).count(), 8);
    assert!(got[6].is_none());
}

#[test]
fn small_memory_forces_write_back_and_every_block_stays_readable() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = store_config(Some(dir.path()), 4, 128);
    // A one-block write-back queue: puts wait for the writer (backpressure).
    config.writeback_max_bytes = SLOT;
    let store = open(config);
    let ks = keys(0..64);
    for chunk in ks.chunks(4) {
        let r = put(&store, chunk);
        assert_eq!(r.stored, chunk.len());
        let s = store.stats();
        assert!(s.g2_bytes <= 4 * SLOT, "G2 over capacity: {s:?}");
    }
    assert!(store.metrics().g2.evictions.get() >= 60);
    // Nothing is lost at any time: evicted blocks are in the write-back
    // queue or on disk.
    assert_eq!(store.lookup_prefix(&ks).hits(), 64);

    store.flush().unwrap();
    let s = store.stats();
    assert_eq!(s.writeback_pending, 0);
    assert_eq!(
        s.g3_blocks, 64,
        "flush writes evicted and dirty blocks: {s:?}"
    );
    let disk = store.disk().unwrap();
    for k in &ks {
        assert!(disk.contains(k), "{k} not in G3 after flush");
    }
    assert_eq!(store.metrics().g3.written_bytes.get(), 64 * SLOT);
    assert_eq!(store.metrics().g3.put_errors.get(), 0);

    let got = store.get_many(&ks);
    let tiers = assert_all_hits(&ks, &got);
    let from_disk = tiers.iter().filter(|&&t| t == Tier::G3).count();
    assert!(from_disk >= 60, "{from_disk} blocks read from G3");
    assert_eq!(store.metrics().g3.hits.get(), from_disk as u64);
}

#[test]
fn admission_filter_keeps_once_seen_blocks_out_of_g3() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = store_config(Some(dir.path()), 256, 64);
    config.admit_on_second_sighting = true;
    let store = open(config);

    let once = keys(0..8);
    let put_twice = keys(8..12);
    let put_then_hit = keys(12..16);
    put(&store, &once);
    put(&store, &put_twice);
    assert_eq!(put(&store, &put_twice).present, 4);
    put(&store, &put_then_hit);
    assert_all_hits(&put_then_hit, &store.get_many(&put_then_hit));

    store.evict_memory().unwrap();
    assert_eq!(store.metrics().admission_rejected.get(), 8);
    let disk = store.disk().unwrap();
    assert_eq!(disk.len(), 8);
    for k in &once {
        assert!(!disk.contains(k), "once-seen block {k} reached G3");
    }
    assert!(store.get_many(&once).iter().all(Option::is_none));
    assert_eq!(store.lookup_prefix(&once).hits(), 0);

    let seen_twice: Vec<_> = put_twice.iter().chain(&put_then_hit).copied().collect();
    let tiers = assert_all_hits(&seen_twice, &store.get_many(&seen_twice));
    assert!(tiers.iter().all(|&t| t == Tier::G3));
    let text = store.metrics().render();
    assert!(
        text.contains("kvtier_store_admission_rejected_total 8"),
        "{text}"
    );
}

#[test]
fn a_payload_of_the_wrong_length_is_an_error_and_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    let good = payload(&key(0));
    let short = vec![7u8; PAYLOAD - 1];
    let long = vec![7u8; PAYLOAD + 4096];
    for bad in [&short, &long, &Vec::new()] {
        let err = store
            .put_many(&[(key(0), good.as_slice()), (key(1), bad.as_slice())])
            .expect_err("a wrong payload length must fail");
        match err {
            StoreError::Block(BlockError::PayloadLength { header, layout }) => {
                assert_eq!(header, bad.len() as u64);
                assert_eq!(layout, PAYLOAD as u64);
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert_eq!(store.lookup_prefix(&[key(0)]).hits(), 0, "nothing stored");
        assert_eq!(store.stats().g2_blocks, 0);
    }
    store.flush().unwrap();
    assert_eq!(store.stats().g3_blocks, 0);
    assert!(store.get_many(&keys(0..2)).iter().all(Option::is_none));
}

#[test]
fn metrics_render_per_tier_hits_misses_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    let ks = keys(0..10);
    put(&store, &ks);
    store.evict_memory().unwrap();

    let mut query = ks.clone();
    query.extend(keys(100..103));
    let got = store.get_many(&query);
    assert_all_hits(&ks, &got[..10]);
    assert!(got[10..].iter().all(Option::is_none));
    assert_all_hits(&ks, &store.get_many(&ks));

    let text = store.metrics().render();
    let m = |name: &str, tier: &str| metric(&text, name, tier);
    // First read: 13 G2 misses, 10 G3 hits, 3 G3 misses; second: 10 G2 hits.
    assert_eq!(m("kvtier_store_hits_total", "g2"), 10.0, "{text}");
    assert_eq!(m("kvtier_store_misses_total", "g2"), 13.0, "{text}");
    assert_eq!(m("kvtier_store_hits_total", "g3"), 10.0, "{text}");
    assert_eq!(m("kvtier_store_misses_total", "g3"), 3.0, "{text}");
    assert_eq!(m("kvtier_store_read_bytes_total", "g3"), (10 * SLOT) as f64);
    assert_eq!(
        m("kvtier_store_written_bytes_total", "g3"),
        (10 * SLOT) as f64
    );
    assert_eq!(m("kvtier_store_corrupt_blocks_total", "g3"), 0.0);
    assert_eq!(m("kvtier_store_put_errors_total", "g3"), 0.0);
    assert_eq!(m("kvtier_store_capacity_bytes", "g3"), (64 * SLOT) as f64);
    assert_eq!(m("kvtier_store_occupancy_bytes", "g3"), (10 * SLOT) as f64);
    assert_eq!(m("kvtier_store_capacity_bytes", "g2"), (256 * SLOT) as f64);
    assert_eq!(m("kvtier_store_occupancy_bytes", "g2"), (10 * SLOT) as f64);
    assert_eq!(m("kvtier_store_read_seconds_count", "g3"), 1.0, "{text}");
    assert!(
        text.contains("kvtier_store_writeback_pending_blocks 0"),
        "{text}"
    );
    let mode = text
        .lines()
        .find(|l| l.starts_with("kvtier_store_io_mode{tier=\"g3\""))
        .unwrap_or_else(|| panic!("no G3 io_mode series:\n{text}"));
    let disk = store.disk().unwrap();
    let want = if disk.direct() { "direct" } else { "buffered" };
    assert!(mode.contains(&format!("direct=\"{want}\"")), "{mode}");
    assert!(
        mode.contains(&format!("backend=\"{}\"", disk.engine().backend().name())),
        "{mode}"
    );
    assert!(mode.ends_with(" 1"), "{mode}");
}

#[test]
fn store_without_g3_is_a_bounded_memory_cache() {
    let store = open(store_config(None, 4, 0));
    assert!(store.disk().is_none());
    let ks = keys(0..20);
    put(&store, &ks);
    let s = store.stats();
    assert!(s.g2_blocks <= 4, "{s:?}");
    assert!(s.g2_bytes <= 4 * SLOT);
    assert_eq!(s.g3_blocks, 0);
    let got = store.get_many(&ks);
    let hits: Vec<_> = got.iter().flatten().collect();
    assert_eq!(hits.len(), s.g2_blocks);
    for b in hits {
        assert_eq!(b.tier, Tier::G2);
        assert_content(b);
    }
    store.flush().unwrap();
    store.evict_memory().unwrap();
    assert_eq!(store.stats().g2_blocks, 0);
    assert!(store.get_many(&ks).iter().all(Option::is_none));
}

#[test]
fn memory_bytes_zero_sends_every_put_straight_to_g3() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 0, 64));
    let ks = keys(0..12);
    assert_eq!(put(&store, &ks).stored, 12);
    store.flush().unwrap();
    let s = store.stats();
    assert_eq!(s.g2_blocks, 0);
    assert_eq!(s.g3_blocks, 12);
    let tiers = assert_all_hits(&ks, &store.get_many(&ks));
    assert!(tiers.iter().all(|&t| t == Tier::G3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_wrappers_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(store_config(Some(dir.path()), 256, 64));
    let ks = keys(0..12);
    let report = store.put_many_async(blocks(&ks)).await.unwrap();
    assert_eq!(report.stored, 12);

    let got = store.get_many_async(ks.clone()).await.unwrap();
    let tiers = assert_all_hits(&ks, &got);
    assert!(tiers.iter().all(|&t| t == Tier::G2));

    let s2 = store.clone();
    tokio::task::spawn_blocking(move || s2.evict_memory())
        .await
        .unwrap()
        .unwrap();
    let mut query = ks.clone();
    query.push(key(999));
    let got = store.get_many_async(query).await.unwrap();
    let tiers = assert_all_hits(&ks, &got[..12]);
    assert!(tiers.iter().all(|&t| t == Tier::G3));
    assert!(got[12].is_none());

    let bad = vec![(key(50), vec![0u8; 3])];
    let err = store.put_many_async(bad).await.unwrap_err();
    assert!(matches!(err, StoreError::Block(_)), "{err:?}");
    assert_eq!(store.lookup_prefix(&[key(50)]).hits(), 0);
}
