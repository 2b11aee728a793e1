//! Many threads on one store (and on one G3 tier): every block returned has
//! exactly its key's bytes, nothing deadlocks, and the store still flushes.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::*;
use kvtier_io::AlignedBuf;
use kvtier_store::disk::{PutOutcome, ReadOutcome};
use kvtier_store::{DiskError, Tier};

#[test]
fn eight_threads_mixing_puts_gets_lookups_and_evictions_see_only_correct_bytes() {
    const THREADS: u64 = 8;
    const OPS: u64 = 800;
    const KEYSPACE: u64 = 96;
    let dir = tempfile::tempdir().unwrap();
    // G2 holds 8 blocks, G3 40: both evict constantly.
    let mut config = store_config(Some(dir.path()), 8, 0);
    config.disk = Some(disk_config(dir.path(), 40, 8));
    config.writeback_max_bytes = 6 * SLOT;
    let store = open(config);
    let served = AtomicU64::new(0);
    let from_g3 = AtomicU64::new(0);

    std::thread::scope(|s| {
        for t in 0..THREADS {
            let store = store.clone();
            let (served, from_g3) = (&served, &from_g3);
            s.spawn(move || {
                let mut rng = Rng::new(t + 1);
                for _ in 0..OPS {
                    let first = rng.below(KEYSPACE);
                    let n = 1 + rng.below(6);
                    let ks: Vec<_> = (first..first + n).map(|i| key(i % KEYSPACE)).collect();
                    match rng.below(100) {
                        0..40 => {
                            let r = put(&store, &ks);
                            assert_eq!(r.stored + r.present, ks.len());
                        }
                        40..80 => {
                            let got = store.get_many(&ks);
                            assert_eq!(got.len(), ks.len());
                            for (k, b) in ks.iter().zip(&got) {
                                if let Some(b) = b {
                                    assert_eq!(&b.key, k);
                                    assert_content(b);
                                    served.fetch_add(1, Ordering::Relaxed);
                                    if b.tier == Tier::G3 {
                                        from_g3.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                            }
                        }
                        80..97 => {
                            let look = store.lookup_prefix(&ks);
                            assert!(look.hits() <= ks.len());
                        }
                        _ => store.evict_memory().unwrap(),
                    }
                }
            });
        }
    });

    store.flush().unwrap();
    let s = store.stats();
    eprintln!(
        "{} blocks served ({} from G3); G3 evictions {}; {s:?}",
        served.load(Ordering::Relaxed),
        from_g3.load(Ordering::Relaxed),
        store.metrics().g3.evictions.get()
    );
    assert_eq!(s.writeback_pending, 0, "{s:?}");
    assert!(s.g2_bytes <= 8 * SLOT, "{s:?}");
    assert!(s.g3_blocks <= 40, "{s:?}");
    let g3 = &store.metrics().g3;
    assert_eq!(g3.corrupt_blocks.get(), 0, "a block was damaged under load");
    assert_eq!(g3.put_errors.get(), 0);
    assert!(
        g3.evictions.get() > 0,
        "G3 never evicted: the test did not exercise reclaim"
    );
    assert!(served.load(Ordering::Relaxed) > 0);
    // After the storm, every block on disk reads back intact.
    store.evict_memory().unwrap();
    let on_disk = store.disk().unwrap().keys();
    assert!(!on_disk.is_empty());
    let tiers = assert_all_hits(&on_disk, &store.get_many(&on_disk));
    assert!(tiers.iter().all(|&t| t == Tier::G3));
    // Every key that was ever put is either still cached or was evicted
    // cleanly; none is served with wrong bytes.
    let all = keys(0..KEYSPACE);
    for b in store.get_many(&all).iter().flatten() {
        assert_content(b);
    }
    store.close().unwrap();
}

#[test]
fn reads_racing_evicting_puts_on_a_full_tier_never_see_foreign_or_torn_bytes() {
    const N: u64 = 8;
    const ROUNDS: u64 = 1000;
    let dir = tempfile::tempdir().unwrap();
    let (tier, metrics) = open_disk(disk_config(dir.path(), N, 4));
    let tier = Arc::new(tier);
    let seed: Vec<_> = keys(0..N).iter().map(|k| (*k, encoded(k))).collect();
    assert!(tier.put_many(&seed).iter().all(|r| r.is_ok()));
    let done = AtomicBool::new(false);
    let hits = AtomicU64::new(0);

    std::thread::scope(|s| {
        let reader = {
            let tier = tier.clone();
            let (done, hits) = (&done, &hits);
            s.spawn(move || {
                let mut reads = 0u64;
                // Bounded by the writer's rounds; at least a few passes.
                while !done.load(Ordering::Acquire) || reads < 4 {
                    reads += 1;
                    // Every slot at once (the writer can reclaim none), or
                    // half of them (it reclaims the others meanwhile).
                    let reqs: Vec<_> = tier
                        .keys()
                        .into_iter()
                        .enumerate()
                        .filter(|(i, _)| reads.is_multiple_of(2) || i.is_multiple_of(2))
                        .map(|(_, k)| (k, AlignedBuf::zeroed(SLOT as usize, 4096).unwrap()))
                        .collect();
                    for r in tier.read_many(reqs) {
                        match r.outcome {
                            ReadOutcome::Hit(()) => {
                                assert_encoded(&r.key, &r.buf);
                                hits.fetch_add(1, Ordering::Relaxed);
                            }
                            ReadOutcome::Miss => {}
                            ReadOutcome::Corrupt(e) => {
                                panic!("block {} overwritten under its reader: {e}", r.key)
                            }
                            ReadOutcome::Failed(e) => panic!("read of {} failed: {e}", r.key),
                        }
                    }
                }
            })
        };
        let mut written = 0u64;
        let mut full = 0u64;
        for round in 1..=ROUNDS {
            let batch: Vec<_> = keys(round * N..round * N + N)
                .iter()
                .map(|k| (*k, encoded(k)))
                .collect();
            for r in tier.put_many(&batch) {
                match r {
                    Ok(PutOutcome::Written) => written += 1,
                    Ok(PutOutcome::Present) => panic!("fresh key reported present"),
                    Err(DiskError::Full) => full += 1,
                    Err(e) => panic!("put failed: {e}"),
                }
            }
        }
        done.store(true, Ordering::Release);
        reader.join().unwrap();
        eprintln!("{written} blocks written, {full} puts refused (all slots pinned)");
        assert!(written > 0);
        assert_eq!(written + full, ROUNDS * N);
    });

    assert!(hits.load(Ordering::Relaxed) > 0);
    assert_eq!(metrics.corrupt_blocks.get(), 0);
    assert_eq!(metrics.put_errors.get(), 0, "Full is not an I/O error");
    assert_eq!(tier.len() as u64, N, "the tier stays full");
    let ks = tier.keys();
    for (k, b) in ks.iter().zip(tier.get_many(&ks)) {
        assert_encoded(k, &b.expect("indexed block reads back"));
    }
}
