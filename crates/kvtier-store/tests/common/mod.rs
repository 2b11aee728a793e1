//! Helpers shared by the store integration tests: a small layout, keys and
//! payloads that are pure functions of an index, store and disk configs on
//! temporary directories, and content checks.
//!
//! Every payload is a deterministic function of its key, so any block read
//! back from any tier can be verified by content alone.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvtier_io::{AlignedBuf, IoEngine, system_allocator};
use kvtier_store::block::{HEADER_BYTES, decode_block, encode_block};
use kvtier_store::metrics::TierMetrics;
use kvtier_store::store::StoredBlock;
use kvtier_store::{
    Arrangement, BlockKey, DiskConfig, DiskTier, KvDtype, KvLayout, ModelFingerprint, StoreConfig,
    TieredStore,
};
use xxhash_rust::xxh3::{xxh3_64, xxh3_128};

/// 2 (K,V) x 1 layer x 2 heads x 64 dims x 16 tokens x 4 bytes = 16 KiB of
/// payload; with the 128-byte header it takes a 20 KiB slot.
pub fn layout() -> KvLayout {
    KvLayout {
        layers: 1,
        kv_heads: 2,
        head_dim: 64,
        block_tokens: 16,
        dtype: KvDtype::F32,
        codec: kvtier_store::KvCodec::None,
        arrangement: Arrangement::KvMajor,
        shard: None,
    }
}

/// Payload bytes of [`layout`].
pub const PAYLOAD: usize = 16 * 1024;
/// Slot (encoded block) bytes of [`layout`].
pub const SLOT: u64 = 20 * 1024;

/// A layout of another slot size (32 KiB payload, 36 KiB slot).
pub fn other_size_layout() -> KvLayout {
    KvLayout {
        layers: 2,
        ..layout()
    }
}

/// A different layout with the *same* payload and slot size as [`layout`]
/// (f16 with twice the head dimension).
pub fn same_size_other_layout() -> KvLayout {
    KvLayout {
        head_dim: 128,
        dtype: KvDtype::F16,
        ..layout()
    }
}

pub fn fingerprint() -> ModelFingerprint {
    ModelFingerprint::of_bytes(b"kvtier-store integration tests")
}

/// The key of block `i` (a pure function of `i`).
pub fn key(i: u64) -> BlockKey {
    let mut input = b"kvtier-test-key/".to_vec();
    input.extend_from_slice(&i.to_le_bytes());
    BlockKey(xxh3_128(&input).to_le_bytes())
}

/// Keys of the blocks in `range`.
pub fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
    range.map(key).collect()
}

/// The payload of `key`: `len` bytes from a splitmix64 stream seeded by the
/// key's hash.
pub fn payload_for(key: &BlockKey, len: usize) -> Vec<u8> {
    let mut state = xxh3_64(&key.0);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The payload of `key` for [`layout`].
pub fn payload(key: &BlockKey) -> Vec<u8> {
    payload_for(key, PAYLOAD)
}

/// `(key, payload)` pairs for `keys`, owned.
pub fn blocks(keys: &[BlockKey]) -> Vec<(BlockKey, Vec<u8>)> {
    keys.iter().map(|k| (*k, payload(k))).collect()
}

/// Puts `keys` (with their payloads) into `store`.
pub fn put(store: &TieredStore, keys: &[BlockKey]) -> kvtier_store::PutReport {
    let owned = blocks(keys);
    let refs: Vec<(BlockKey, &[u8])> = owned.iter().map(|(k, p)| (*k, p.as_slice())).collect();
    store.put_many(&refs).expect("put_many")
}

/// Asserts that `block` holds exactly the payload of its key.
pub fn assert_content(block: &StoredBlock) {
    let want = payload_for(&block.key, block.payload().len());
    assert_eq!(
        block.payload().len(),
        PAYLOAD,
        "block {} has a payload of the wrong length",
        block.key
    );
    assert!(
        block.payload() == want.as_slice(),
        "block {} (from {:?}) holds bytes that are not its key's payload",
        block.key,
        block.tier
    );
    // The encoded block must verify as a whole too.
    let (header, p) =
        decode_block(block.encoded(), Some(&block.key)).expect("stored block decodes");
    assert_eq!(header.key, block.key);
    assert_eq!(p, want.as_slice());
}

/// Asserts that every entry of `got` is a hit for the matching key of
/// `keys`, with the right bytes, and returns the tiers.
pub fn assert_all_hits(keys: &[BlockKey], got: &[Option<StoredBlock>]) -> Vec<kvtier_store::Tier> {
    assert_eq!(keys.len(), got.len(), "one result per key");
    keys.iter()
        .zip(got)
        .map(|(k, b)| {
            let b = b
                .as_ref()
                .unwrap_or_else(|| panic!("key {k} should be a hit"));
            assert_eq!(&b.key, k, "result in the wrong position");
            assert_content(b);
            b.tier
        })
        .collect()
}

/// A G3 config on `dir` of `slots` slots of [`SLOT`] bytes, with segments
/// of `segment_slots` slots.
pub fn disk_config(dir: &Path, slots: u64, segment_slots: u64) -> DiskConfig {
    let mut dc = DiskConfig::new(vec![dir.to_path_buf()], slots * SLOT, layout());
    dc.segment_bytes = segment_slots * SLOT;
    dc.in_flight = 8;
    dc
}

/// A store config: G2 of `memory_slots` blocks; G3 of `disk_slots` on `dir`
/// when given.
pub fn store_config(dir: Option<&Path>, memory_slots: u64, disk_slots: u64) -> StoreConfig {
    let mut c = StoreConfig::new(layout(), fingerprint());
    c.memory_bytes = memory_slots * SLOT;
    c.disk = dir.map(|d| disk_config(d, disk_slots, 16));
    c.admission_window = 4096;
    c.writeback_max_bytes = 64 * SLOT;
    // Tests that count G3 writes need G3 to change only on eviction, flush
    // or close; the timed sync has its own tests (store_g3_sync.rs).
    c.g3_sync = None;
    c
}

pub fn open(config: StoreConfig) -> TieredStore {
    TieredStore::open(config).expect("open store")
}

/// Opens a bare G3 tier on `config` with its own metrics (returned too).
pub fn open_disk(config: DiskConfig) -> (DiskTier, TierMetrics) {
    let metrics = TierMetrics::default();
    let tier = DiskTier::open(
        config,
        IoEngine::shared().clone(),
        system_allocator(),
        metrics.clone(),
    )
    .expect("open disk tier");
    (tier, metrics)
}

/// The encoded block of `key` (layout [`layout`]), ready for `DiskTier`.
pub fn encoded(key: &BlockKey) -> Arc<AlignedBuf> {
    Arc::new(
        encode_block(
            *key,
            fingerprint(),
            layout(),
            0,
            &payload(key),
            &system_allocator(),
        )
        .expect("encode"),
    )
}

/// Panics unless `bytes` is the complete, verified encoded block of `key`
/// with the key's payload.
pub fn assert_encoded(key: &BlockKey, bytes: &[u8]) {
    let (header, p) = decode_block(bytes, Some(key))
        .unwrap_or_else(|e| panic!("block {key} does not verify: {e}"));
    assert_eq!(header.key, *key);
    assert!(
        p == payload(key).as_slice(),
        "block {key} verifies but holds another payload"
    );
    assert_eq!(p.len() + HEADER_BYTES, PAYLOAD + HEADER_BYTES);
}

/// The value of the series `name{tier="<tier>"}` in Prometheus text.
pub fn metric(text: &str, name: &str, tier: &str) -> f64 {
    let prefix = format!("{name}{{tier=\"{tier}\"}} ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no series {prefix:?} in:\n{text}"));
    line[prefix.len()..]
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("bad value in {line:?}: {e}"))
}

/// The segment directory of a store rooted at `root` with [`layout`].
pub fn slot_dir(root: &Path) -> PathBuf {
    DiskTier::slot_dir(root, &layout())
}

/// Flips every bit of the byte at `offset` in `path`, with plain buffered
/// I/O, and syncs the file.
pub fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open segment for the flip");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).expect("read byte");
    b[0] ^= 0xff;
    f.write_all_at(&b, offset).expect("write byte");
    f.sync_all().expect("sync segment");
}

/// A small deterministic PRNG (xorshift64*), for workload choices.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}
