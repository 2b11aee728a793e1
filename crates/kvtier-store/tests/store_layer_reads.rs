//! Layer-wise prefix reads (`read_prefix_layered`): every layer of every
//! block of the leading run is handed to the sink exactly once, with the
//! block's own bytes; G3 reads go part-major (layer 0 of every block before
//! layer 1 of any, with one read in flight); the result is the verified
//! run, and a corrupt block is handed over (unverified) but cut from it.

// Test helpers outside #[test] fns may unwrap: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use std::ops::Range;
use std::sync::{Arc, Mutex, mpsc};

use common::{fingerprint, flip_byte, keys, payload_for};
use kvtier_store::block::HEADER_BYTES;
use kvtier_store::{
    Arrangement, DiskConfig, KvDtype, KvLayout, LayerSink, RemoteConfig, StoreConfig, Tier,
    TieredStore,
};
use kvtier_testkit::RedisServer;

/// 4 layers of 128 KiB (2 x 4 heads x 64 tokens x 64 dims x f32), layer-major.
fn layout() -> KvLayout {
    KvLayout {
        layers: 4,
        kv_heads: 4,
        head_dim: 64,
        block_tokens: 64,
        dtype: KvDtype::F32,
        codec: kvtier_store::KvCodec::None,
        arrangement: Arrangement::LayerMajor,
        shard: None,
    }
}

const LAYER: usize = 128 * 1024;

fn open(dir: &std::path::Path, in_flight: usize) -> TieredStore {
    open_with(dir, in_flight, None)
}

fn open_with(dir: &std::path::Path, in_flight: usize, g4: Option<&str>) -> TieredStore {
    let slot = layout().encoded_bytes();
    let mut c = StoreConfig::new(layout(), fingerprint());
    c.memory_bytes = 64 * slot;
    let mut dc = DiskConfig::new(vec![dir.to_path_buf()], 64 * slot, layout());
    dc.in_flight = in_flight;
    c.disk = Some(dc);
    c.g3_sync = None;
    c.remote = g4.map(RemoteConfig::new);
    TieredStore::open(c).unwrap()
}

/// One hand-over: block index, layers, bytes.
type Handed = (usize, Range<u32>, Vec<u8>);

/// Records what it is handed.
#[derive(Default)]
struct Recorder {
    got: Mutex<Vec<Handed>>,
    planned: Mutex<Vec<Vec<Tier>>>,
    /// Layers handed over before `planned` was called.
    before_planned: Mutex<usize>,
    /// What `yield_factor` answers.
    yield_factor: f64,
}

impl LayerSink for Recorder {
    fn layers(&self, index: usize, layers: Range<u32>, stored: &[u8]) {
        if self.planned.lock().unwrap().is_empty() {
            *self.before_planned.lock().unwrap() += 1;
        }
        self.got
            .lock()
            .unwrap()
            .push((index, layers, stored.to_vec()));
    }

    fn planned(&self, tiers: &[Tier]) {
        self.planned.lock().unwrap().push(tiers.to_vec());
    }

    fn yield_factor(&self) -> f64 {
        self.yield_factor
    }
}

/// Reads `ks` layer-wise; the verified blocks' keys and what the sink saw.
fn read(store: &TieredStore, ks: &[kvtier_store::BlockKey]) -> (usize, Arc<Recorder>) {
    read_yielding(store, ks, 0.0)
}

/// [`read`] with a sink whose `yield_factor` is `k`.
fn read_yielding(
    store: &TieredStore,
    ks: &[kvtier_store::BlockKey],
    k: f64,
) -> (usize, Arc<Recorder>) {
    read_as(store, ks, None, k)
}

/// Reads `ks` layer-wise, the last a short block of `tail_rows` when
/// given, with a sink whose `yield_factor` is `k`; checks each verified
/// block's rows and bytes.
fn read_as(
    store: &TieredStore,
    ks: &[kvtier_store::BlockKey],
    tail_rows: Option<u32>,
    k: f64,
) -> (usize, Arc<Recorder>) {
    let sink = Arc::new(Recorder {
        yield_factor: k,
        ..Recorder::default()
    });
    let (tx, rx) = mpsc::channel();
    let handle = store.read_prefix_layered(ks.to_vec(), tail_rows, sink.clone(), move || {
        let _ = tx.send(());
    });
    let blocks = handle.wait().unwrap();
    rx.recv().unwrap();
    for (i, (b, k)) in blocks.iter().zip(ks).enumerate() {
        let rows = match tail_rows {
            Some(r) if i + 1 == ks.len() => r,
            _ => layout().block_tokens,
        };
        assert_eq!(b.key, *k);
        assert_eq!(b.rows(), rows);
        let len = layout().with_tokens(rows).payload_bytes() as usize;
        assert_eq!(b.payload(), &payload_for(k, len)[..]);
    }
    (blocks.len(), sink)
}

/// Each (block, layer) of blocks `0..n` handed over exactly once, with
/// that layer's bytes of the block's payload.
fn assert_every_layer_once(ks: &[kvtier_store::BlockKey], n: usize, sink: &Recorder) {
    assert_every_layer_once_of(ks, n, sink, layout());
}

/// [`assert_every_layer_once`], the last of `ks` a block of `last`.
fn assert_every_layer_once_of(
    ks: &[kvtier_store::BlockKey],
    n: usize,
    sink: &Recorder,
    last: KvLayout,
) {
    let got = sink.got.lock().unwrap();
    let mut seen = vec![vec![0u32; 4]; n];
    for (i, layers, bytes) in got.iter() {
        assert!(*i < n, "block {i} is past the run of {n}");
        let of = if *i + 1 == ks.len() { last } else { layout() };
        let payload = payload_for(&ks[*i], of.payload_bytes() as usize);
        let layer = of.payload_bytes() as usize / 4;
        let range = layers.start as usize * layer..layers.end as usize * layer;
        assert_eq!(&bytes[..], &payload[range], "block {i} layers {layers:?}");
        for l in layers.clone() {
            seen[*i][l as usize] += 1;
        }
    }
    assert!(
        seen.iter().flatten().all(|&c| c == 1),
        "every layer of every block once: {seen:?}"
    );
}

/// Blocks `from..` were each handed over in one piece, all four layers.
fn assert_whole_from(sink: &Recorder, from: usize, why: &str) {
    let got = sink.got.lock().unwrap();
    assert!(
        got.iter()
            .filter(|(i, _, _)| *i >= from)
            .all(|(_, l, _)| *l == (0..4)),
        "{why}"
    );
}

fn put(store: &TieredStore, ks: &[kvtier_store::BlockKey]) {
    let len = layout().payload_bytes() as usize;
    let blocks: Vec<_> = ks.iter().map(|k| (*k, payload_for(k, len))).collect();
    let refs: Vec<_> = blocks.iter().map(|(k, p)| (*k, &p[..])).collect();
    store.put_many(&refs).unwrap();
}

#[test]
fn g3_layers_land_part_major_each_once_with_their_bytes() {
    let dir = tempfile::tempdir().unwrap();
    // One read in flight: the order of the reads is the order landed.
    let store = open(dir.path(), 1);
    let ks = keys(0..6);
    put(&store, &ks);
    store.evict_memory().unwrap();
    let mut asked = ks.clone();
    asked.extend(keys(100..101));
    let (n, sink) = read(&store, &asked);
    assert_eq!(n, 6, "the run ends at the key no tier holds");
    assert_eq!(*sink.planned.lock().unwrap(), vec![vec![Tier::G3; 6]]);
    assert_every_layer_once(&ks, 6, &sink);
    // Part-major: every block's first layer before any block's last.
    let got = sink.got.lock().unwrap();
    let last_first = got.iter().rposition(|(_, l, _)| l.start == 0).unwrap();
    let first_last = got.iter().position(|(_, l, _)| l.end == 4).unwrap();
    assert!(
        last_first < first_last,
        "layer 0 of every block lands before layer 3 of any"
    );
    assert!(got.len() > 6, "the slots were read in parts, not whole");
}

#[test]
fn g2_hits_are_handed_over_whole_and_many_reads_in_flight_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 32);
    let ks = keys(0..8);
    put(&store, &ks[..5]);
    store.evict_memory().unwrap();
    put(&store, &ks[5..]);
    // 0..5 from G3 (32 reads in flight), 5..8 from G2.
    let (n, sink) = read(&store, &ks);
    assert_eq!(n, 8);
    let want = [vec![Tier::G3; 5], vec![Tier::G2; 3]].concat();
    assert_eq!(*sink.planned.lock().unwrap(), vec![want]);
    assert_every_layer_once(&ks, 8, &sink);
    assert_whole_from(&sink, 5, "a G2 block is handed over whole");
}

#[test]
fn a_corrupt_block_is_handed_over_but_cut_from_the_verified_run() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 8);
    let ks = keys(0..6);
    put(&store, &ks);
    store.evict_memory().unwrap();
    let (path, off) = store.disk().unwrap().locate_key(&ks[3]).unwrap();
    // A byte of layer 2: the block's first layers land intact.
    flip_byte(&path, off + (HEADER_BYTES + 2 * LAYER + 100) as u64);
    let (n, sink) = read(&store, &ks);
    assert_eq!(n, 3, "blocks 0..3, then the corrupt block 3");
    assert_eq!(*sink.planned.lock().unwrap(), vec![vec![Tier::G3; 6]]);
    assert_eq!(store.metrics().g3.corrupt_blocks.get(), 1);
    assert!(!store.disk().unwrap().contains(&ks[3]), "deleted");
    let got = sink.got.lock().unwrap();
    assert!(
        got.iter().any(|(i, _, _)| *i == 3),
        "its layers were handed over before its check failed"
    );
}

#[test]
fn g4_blocks_come_whole_after_g3_ones_and_without_a_g4_read_the_plan_comes_first() {
    let redis = RedisServer::start().unwrap();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ks = keys(0..6);
    // A writes all six through to G4; B holds 0..3 on its own disk.
    let a = open_with(da.path(), 8, Some(&redis.url()));
    put(&a, &ks);
    a.flush().unwrap();
    let b = open_with(db.path(), 8, Some(&redis.url()));
    put(&b, &ks[..3]);
    b.evict_memory().unwrap();
    let (n, sink) = read(&b, &ks);
    assert_eq!(n, 6);
    let want = [vec![Tier::G3; 3], vec![Tier::G4; 3]].concat();
    assert_eq!(*sink.planned.lock().unwrap(), vec![want]);
    assert_every_layer_once(&ks, 6, &sink);
    assert_whole_from(&sink, 3, "a G4 block is handed over whole");
    // All of it local now (G2 evicted to G3): no GET, so the plan is
    // known before the first layer lands.
    b.evict_memory().unwrap();
    let (n, sink) = read(&b, &ks);
    assert_eq!(n, 6);
    assert_eq!(*sink.planned.lock().unwrap(), vec![vec![Tier::G3; 6]]);
    assert_eq!(*sink.before_planned.lock().unwrap(), 0);
}

#[test]
fn a_yielding_sink_gets_g4_blocks_one_by_one_in_order_up_to_the_first_miss() {
    let redis = RedisServer::start().unwrap();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ks = keys(0..6);
    // The pool holds blocks 0..4; 4 and 5 are nowhere.
    let a = open_with(da.path(), 8, Some(&redis.url()));
    put(&a, &ks[..4]);
    a.flush().unwrap();
    let b = open_with(db.path(), 8, Some(&redis.url()));
    let (n, sink) = read_yielding(&b, &ks, 0.5);
    assert_eq!(n, 4, "the verified run ends at the first miss");
    assert_eq!(*sink.planned.lock().unwrap(), vec![vec![Tier::G4; 4]]);
    assert_every_layer_once(&ks, 4, &sink);
    assert_whole_from(&sink, 0, "a G4 block is handed over whole");
    let order: Vec<usize> = sink.got.lock().unwrap().iter().map(|h| h.0).collect();
    assert_eq!(
        order,
        vec![0, 1, 2, 3],
        "one GET at a time, in prefix order"
    );
    assert_eq!(
        *sink.before_planned.lock().unwrap(),
        4,
        "a yielding read hands blocks over before its plan"
    );
    // The same read without yielding finds the same run.
    b.evict_memory().unwrap();
    let (n, _) = read(&b, &ks);
    assert_eq!(n, 4);
}

/// Rows of the short blocks below: a prompt's tail.
const ROWS: u32 = 40;

/// Stores `ks`, the last a short block of [`ROWS`] rows.
fn put_with_tail(store: &TieredStore, ks: &[kvtier_store::BlockKey]) {
    let (tail, whole) = ks.split_last().unwrap();
    put(store, whole);
    let mut b = store.new_short_block(ROWS).unwrap();
    assert_eq!(b.layout(), layout().with_tokens(ROWS));
    let want = payload_for(tail, b.layout().payload_bytes() as usize);
    b.payload_mut().copy_from_slice(&want);
    assert_eq!(store.offer(vec![(*tail, b)]).stored, 1);
}

#[test]
fn a_short_tail_comes_back_with_only_its_rows_from_every_tier() {
    let redis = RedisServer::start().unwrap();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ks = keys(0..4);
    let short = layout().with_tokens(ROWS);
    let a = open_with(da.path(), 8, Some(&redis.url()));
    put_with_tail(&a, &ks);
    for tier in [Tier::G2, Tier::G3] {
        if tier == Tier::G3 {
            a.evict_memory().unwrap();
        }
        let (n, sink) = read_as(&a, &ks, Some(ROWS), 0.0);
        assert_eq!(n, 4, "{tier:?}");
        assert_eq!(*sink.planned.lock().unwrap(), vec![vec![tier; 4]]);
        assert_every_layer_once_of(&ks, 4, &sink, short);
    }
    // G3 in parts: the tail too (its 4 layers of 80 KiB in two parts).
    a.evict_memory().unwrap();
    let before = a.metrics().g3.read_bytes.get();
    let (_, sink) = read_as(&a, &ks, Some(ROWS), 0.0);
    let tail_parts = sink.got.lock().unwrap().iter().filter(|h| h.0 == 3).count();
    assert!(tail_parts > 1, "the tail was read in parts");
    // Its slot only up to its end.
    let short_end = (HEADER_BYTES as u64 + short.payload_bytes()).next_multiple_of(4096);
    assert!(short_end < layout().encoded_bytes());
    assert_eq!(
        a.metrics().g3.read_bytes.get() - before,
        3 * layout().encoded_bytes() + short_end
    );
    // Written through to the pool short, read back from it by another node.
    a.flush().unwrap();
    let b = open_with(db.path(), 8, Some(&redis.url()));
    let (n, sink) = read_as(&b, &ks, Some(ROWS), 0.0);
    assert_eq!(n, 4);
    assert_eq!(*sink.planned.lock().unwrap(), vec![vec![Tier::G4; 4]]);
    assert_every_layer_once_of(&ks, 4, &sink, short);
    // And after a restart, from G3 again (the index kept the short slot).
    a.evict_memory().unwrap();
    drop(a);
    let a = open_with(da.path(), 8, None);
    assert!(a.disk().unwrap().contains(&ks[3]));
    let (n, _) = read_as(&a, &ks, Some(ROWS), 0.0);
    assert_eq!(n, 4, "after reopening");
}

#[test]
fn a_block_read_as_other_rows_than_it_holds_is_refused_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path(), 8);
    let ks = keys(0..4);
    put_with_tail(&store, &ks);
    // The short tail asked for whole, from G2: refused there, and from
    // G3 below it, where it is deleted.
    store.flush().unwrap();
    let (n, _) = read_as(&store, &ks, None, 0.0);
    assert_eq!(n, 3, "a short block never stands in for a whole one");
    assert!(!store.disk().unwrap().contains(&ks[3]), "deleted from G3");
    assert_eq!(read_as(&store, &ks, Some(ROWS), 0.0).0, 3, "and gone");
    // A whole block asked for as a tail (what an older kvtier stored
    // whole under a tail's key), from G3: refused and deleted.
    store.evict_memory().unwrap();
    let (n, _) = read_as(&store, &ks[..3], Some(ROWS), 0.0);
    assert_eq!(n, 2);
    assert!(!store.disk().unwrap().contains(&ks[2]), "deleted from G3");
    // Whole blocks asked for as whole still read.
    assert_eq!(read_as(&store, &ks[..2], None, 0.0).0, 2);
}
