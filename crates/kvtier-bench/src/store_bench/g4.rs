//! `kvtier store bench --tier g4`: G4 restore throughput through the tiered
//! store against `redis-benchmark` GET throughput for the same values, in
//! the same run.
//!
//! * The G4 side is the real restore path: a [`TieredStore`] whose only
//!   tier is G4 (no G2, no G3). `--total-bytes` of blocks with
//!   `--block-bytes` of KV payload are put (written through to the pool),
//!   flushed, then read back with `get_many` in calls of `chunk` blocks, one
//!   G4 batch per call with up to `--in-flight` GETs in flight (on one
//!   plain-TCP node: that many connections, one GET outstanding on each,
//!   as redis-benchmark's side runs). Every block is verified
//!   by the store (checksums, key, model, layout) and must come back from
//!   G4; a miss fails the run.
//! * The redis-benchmark side GETs the *same* keys: block keys are chosen so
//!   that their names in the pool are `<namespace>:<20 hex digits><12
//!   decimal digits of the block index>`, which is exactly what
//!   redis-benchmark's `__rand_int__` expands to. So it runs
//!   `redis-benchmark -c <depth> -P 1 -r <blocks> -n <requests> --csv GET
//!   <namespace>:<prefix>__rand_int__`: the same values, the same number of
//!   requests outstanding, every GET a hit, and nothing written by it.
//! * Repeats alternate the order of the two sides (G4 first on even
//!   repeats); medians are reported. GB/s are 10^9 bytes of values (block
//!   header and payload, `value_bytes`) per second.
//!
//! The blocks live under a namespace of their own
//! (`<--remote-namespace>-bench-<pid>-<4 hex digits>`), expire after
//! `--remote-ttl-secs` (default [`DEFAULT_TTL`]) even if the run is killed,
//! and are deleted at the end unless `--keep`.

use std::time::{Duration, Instant};

use crate::bench_error::{BenchError, Result, StepContext, fail};
use indicatif::ProgressBar;
use kvtier_store::block::HEADER_BYTES;
use kvtier_store::remote::{Target, parse_target, redact_url};
use kvtier_store::{
    BlockKey, KvLayout, RemoteConfig, RemoteTier, StoreConfig, StoreMetrics, Tier, TieredStore,
};

use super::block_set::bench_fingerprint;
use super::chunk_blocks;
use super::g4_report::G4BenchReport;
use super::redis_benchmark::{RedisBenchmark, find_redis_benchmark, rb_target, rb_version};
use super::slot_layout::{BYTES_PER_TOKEN, bench_layout, check_block_bytes};
use crate::common::fill::stamp_pages;
use crate::common::progress::progress_bar;
use crate::common::size::format_size;
use crate::machine::device_limit::gbps;
use crate::reporting::stats::median;

/// The goal: G4 restore at this fraction of redis-benchmark GET throughput
/// or more.
pub const GOAL_RATIO: f64 = 0.80;
/// Shortest time limit per G4 batch in the bench (large batches must not
/// trip the breaker).
const MIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Expiry of the bench's blocks unless `--remote-ttl-secs` says otherwise.
pub const DEFAULT_TTL: Duration = Duration::from_secs(3600);
/// Fewest GETs one redis-benchmark run makes: its clock ticks in
/// milliseconds, so a run must last well over one.
pub const MIN_RB_REQUESTS: u64 = 256;
/// First 10 bytes of every bench block key (the rest is the block index in
/// binary-coded decimal).
const KEY_PREFIX: &[u8; 10] = b"kvbench-g4";
/// What redis-benchmark replaces with 12 decimal digits.
const RAND_INT: &str = "__rand_int__";
/// Most blocks: 12 decimal digits.
const MAX_BLOCKS: u64 = 1_000_000_000_000;
/// Threads deleting the bench's blocks at the end.
const DELETE_THREADS: usize = 8;

/// What the G4 bench measures (`kvtier store bench --tier g4`).
#[derive(Debug, Clone)]
pub struct G4BenchOptions {
    /// The pool; its namespace is the base of the bench's own
    /// (`<namespace>-bench-<pid>-<hex>`), its time limit at least 30 s per
    /// batch, its expiry [`DEFAULT_TTL`] unless set.
    pub remote: RemoteConfig,
    /// Bytes of blocks to put and read back (must fit in the pool's
    /// memory).
    pub total_bytes: u64,
    /// KV payload bytes of one block (the value in the pool is 128 bytes
    /// more, the block header).
    pub block_bytes: u64,
    /// In-flight depths; only the largest is used: G4 GETs in flight, and
    /// as many redis-benchmark clients.
    pub in_flight: Vec<u32>,
    /// Times to run each side; the median is reported.
    pub repeat: u32,
    /// Blocks per store read call (one G4 batch) (default: the G3 rule).
    pub chunk_blocks: Option<u32>,
    /// Leave the blocks in the pool instead of deleting them.
    pub keep: bool,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl G4BenchOptions {
    /// `kvtier store bench --tier g4`'s defaults against `remote`.
    pub fn new(remote: RemoteConfig) -> Self {
        Self {
            remote,
            total_bytes: super::G4_DEFAULT_TOTAL_BYTES,
            block_bytes: 2 << 20,
            in_flight: vec![1, 4, 16, 32],
            repeat: 3,
            chunk_blocks: None,
            keep: false,
            progress: true,
        }
    }
}

/// The bench layout whose payload is exactly `payload_bytes` (the shape of
/// [`super::slot_layout`]: one layer, 8 KV heads of 128 in bf16, 4 KiB per
/// token).
pub fn g4_layout(payload_bytes: u64) -> Result<KvLayout, String> {
    check_block_bytes(payload_bytes)?;
    let layout = bench_layout(payload_bytes / BYTES_PER_TOKEN)?;
    if layout.payload_bytes() != payload_bytes {
        return Err(format!(
            "internal error: layout {layout} has {} payload bytes, not {payload_bytes}",
            layout.payload_bytes()
        ));
    }
    Ok(layout)
}

/// The key of G4 bench block `i` (below `MAX_BLOCKS`): `KEY_PREFIX`,
/// then `i` as 12 binary-coded decimal digits, so its hex form ends in
/// `format!("{i:012}")`, as redis-benchmark writes `__rand_int__`.
pub fn g4_key(i: u64) -> BlockKey {
    let mut k = [0u8; 16];
    k[..10].copy_from_slice(KEY_PREFIX);
    let mut n = i;
    for byte in k[10..].iter_mut().rev() {
        let lo = (n % 10) as u8;
        n /= 10;
        let hi = (n % 10) as u8;
        n /= 10;
        *byte = (hi << 4) | lo;
    }
    BlockKey(k)
}

/// The redis-benchmark key template naming block `i` for every `i`, given
/// how the pool names block 0; `None` if names are not of that form.
fn key_template(name_of_block_0: &str) -> Option<String> {
    let stem = name_of_block_0.strip_suffix("000000000000")?;
    Some(format!("{stem}{RAND_INT}"))
}

/// `len` pseudo-random bytes (splitmix64; the same every run).
fn pseudo_random(len: usize) -> Vec<u8> {
    let mut state = 0x6b76_7469_6572_6734_u64;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Timed results of the measuring phase.
struct Samples {
    put_gbps: f64,
    g4_gbps: Vec<f64>,
    g4_per_sec: Vec<f64>,
    rb_gbps: Vec<f64>,
    rb_rps: Vec<f64>,
}

/// Why blocks did not come back, for errors.
fn pool_health(m: &StoreMetrics) -> String {
    format!(
        "G4 errors {}, timeouts {}; run with --log kvtier_store=debug for details",
        m.remote.errors.get(),
        m.remote.timeouts.get()
    )
}

/// Puts blocks `0..n`, keeping the write-through queue under half of
/// `queue_limit` (puts never wait for it: a full queue drops), and flushes.
/// GB/s of values put.
fn put_set(
    store: &TieredStore,
    payload_bytes: usize,
    n: u64,
    queue_limit: u64,
    pb: &ProgressBar,
) -> Result<f64> {
    let value_bytes = (HEADER_BYTES + payload_bytes) as u64;
    let mut payload = pseudo_random(payload_bytes);
    let metrics = store.metrics();
    let t = Instant::now();
    for i in 0..n {
        let queued = u64::try_from(metrics.remote.queue_bytes.get()).unwrap_or(0);
        if queued + value_bytes > queue_limit / 2 {
            store.flush().step("waiting for the G4 write-through")?;
        }
        stamp_pages(&mut payload, i);
        store
            .put_many(&[(g4_key(i), &payload)])
            .with_step(|| format!("putting bench block {i}"))?;
        pb.inc(value_bytes);
    }
    store.flush().step("waiting for the G4 write-through")?;
    let secs = t.elapsed().as_secs_f64();
    let dropped = metrics.remote.dropped_puts.get();
    if dropped > 0 {
        fail!(
            "the G4 pool did not take {dropped} of {n} blocks ({}); a full pool \
             (maxmemory below {} of values?) refuses writes: try a smaller --total-bytes",
            pool_health(metrics),
            format_size(n * value_bytes)
        );
    }
    Ok(gbps(n * value_bytes, secs))
}

/// Reads blocks `0..n` back through the store in calls of `chunk`; every
/// one must be a verified G4 hit carrying its own stamp. Seconds taken.
fn restore_pass(store: &TieredStore, n: u64, chunk: u64, pb: &ProgressBar) -> Result<f64> {
    let value_bytes = HEADER_BYTES as u64 + store.layout().stored_payload_bytes();
    let mut missing = 0u64;
    let mut first_bad: Option<String> = None;
    let t = Instant::now();
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        let keys: Vec<BlockKey> = (start..end).map(g4_key).collect();
        for (i, got) in (start..end).zip(store.get_many(&keys)) {
            let why = match &got {
                None => Some("missing".to_string()),
                Some(b) if b.tier != Tier::G4 => Some(format!("read from {:?}", b.tier)),
                Some(b) if b.payload().get(..8) != Some(&i.to_le_bytes()[..]) => {
                    Some("another block's payload".to_string())
                }
                Some(_) => None,
            };
            if let Some(why) = why {
                missing += 1;
                first_bad.get_or_insert_with(|| format!("block {i}: {why}"));
            }
        }
        pb.inc((end - start) * value_bytes);
        start = end;
    }
    let secs = t.elapsed().as_secs_f64();
    if let Some(first) = first_bad {
        fail!(
            "{missing} of {n} blocks were not restored from G4 (first: {first}): evicted by \
             the pool's maxmemory policy, expired, or the pool failed ({})",
            pool_health(store.metrics())
        );
    }
    Ok(secs)
}

/// Deletes blocks `0..n` from the pool (several threads) and counts the
/// ones still there afterwards.
fn delete_set(remote: &RemoteTier, n: u64) -> u64 {
    let keys: Vec<BlockKey> = (0..n).map(g4_key).collect();
    let per = keys.len().div_ceil(DELETE_THREADS).max(1);
    std::thread::scope(|s| {
        for part in keys.chunks(per) {
            s.spawn(move || part.iter().for_each(|k| remote.delete(k)));
        }
    });
    remote
        .contains_many(&keys)
        .into_iter()
        .filter(|&b| b)
        .count() as u64
}

/// A namespace no other run shares: `<base>-bench-<pid>-<4 hex digits>`.
fn run_namespace(base: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mix = (u64::from(nanos) ^ u64::from(std::process::id()).rotate_left(17))
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    format!(
        "{base}-bench-{}-{:04x}",
        std::process::id(),
        (mix >> 48) as u16
    )
}

/// Runs the G4 bench (see the module docs) and returns its report.
pub fn run_g4(opts: &G4BenchOptions) -> Result<G4BenchReport> {
    let mut rc = opts.remote.clone();
    let url = rc.url.clone();
    let shown = redact_url(&url);
    let target = parse_target(&url).map_err(BenchError::other)?;
    let payload_bytes = opts.block_bytes;
    let layout = g4_layout(payload_bytes).map_err(BenchError::Failed)?;
    let value_bytes = HEADER_BYTES as u64 + payload_bytes;
    let total_bytes = opts.total_bytes;
    let blocks = total_bytes / value_bytes;
    if blocks == 0 {
        fail!(
            "--total-bytes {} holds no block of {} payload ({value_bytes} bytes in the pool)",
            format_size(total_bytes),
            format_size(payload_bytes)
        );
    }
    if blocks >= MAX_BLOCKS {
        fail!("--total-bytes {total_bytes} makes {blocks} blocks; at most {MAX_BLOCKS} - 1");
    }
    let in_flight = opts
        .in_flight
        .iter()
        .copied()
        .max()
        .ok_or_else(|| BenchError::Failed("--in-flight needs at least one depth".into()))?;
    let slot = layout.encoded_bytes();
    let chunk = chunk_blocks(in_flight, slot, blocks, opts.chunk_blocks);

    // redis-benchmark first: a missing binary fails before anything is
    // written to the pool.
    let (rb, rb_skipped) = match &target {
        Target::Redis(_) => {
            let bin = find_redis_benchmark()?;
            let requests = blocks.max(MIN_RB_REQUESTS);
            let rb = RedisBenchmark {
                version: rb_version(&bin),
                bin,
                target: rb_target(&url).map_err(BenchError::Failed)?,
                template: String::new(),
                requests,
                clients: in_flight,
                keyspace: blocks,
                timeout: Duration::from_secs(120)
                    + Duration::from_secs_f64((requests * value_bytes) as f64 / 1e7),
            };
            (Some(rb), None)
        }
        Target::RedisCluster(_) => (
            None,
            Some("a Redis Cluster URL: redis-benchmark measures one node (G4 side only)"),
        ),
        Target::S3 { .. } => (
            None,
            Some("an S3 pool: redis-benchmark measures Redis (G4 side only)"),
        ),
    };

    let namespace = run_namespace(&rc.namespace);
    rc.namespace = namespace.clone();
    rc.timeout = rc.timeout.max(MIN_TIMEOUT);
    rc.in_flight = in_flight as usize;
    rc.batch_bytes = chunk * slot;
    rc.write_queue_bytes = rc.write_queue_bytes.max(4 * slot);
    rc.ttl = Some(rc.ttl.unwrap_or(DEFAULT_TTL));
    let queue_limit = rc.write_queue_bytes;
    let mut config = StoreConfig::new(layout, bench_fingerprint());
    config.memory_bytes = 0;
    config.disk = None;
    config.persist_on_close = false;
    config.remote = Some(rc);
    let store = TieredStore::open(config).step("opening the G4 store")?;
    let remote = store
        .remote()
        .ok_or_else(|| BenchError::Failed("the store opened without G4".into()))?;
    let template = key_template(&remote.name(&g4_key(0)))
        .filter(|t| {
            let last = blocks - 1;
            t.replace(RAND_INT, &format!("{last:012}")) == remote.name(&g4_key(last))
        })
        .ok_or_else(|| {
            BenchError::Failed(format!(
                "internal error: G4 key {} does not end in the block index",
                remote.name(&g4_key(0))
            ))
        })?;
    let rb = rb.map(|rb| RedisBenchmark { template, ..rb });
    tracing::info!(
        "G4 bench: {blocks} blocks of {} ({layout}) at {shown}, namespace {namespace}, \
         {in_flight} in flight, {chunk} blocks per call",
        format_size(payload_bytes)
    );

    // Fail fast on a pool that does not answer.
    let _ = remote.contains_many(&[g4_key(0)]);
    let m = store.metrics();
    if m.remote.errors.get() + m.remote.timeouts.get() > 0 {
        fail!("cannot reach the G4 pool {shown} ({})", pool_health(m));
    }

    let repeats = u64::from(opts.repeat);
    let rb_bytes = rb.as_ref().map_or(0, |r| r.requests * value_bytes);
    let set_bytes = blocks * value_bytes;
    let pb = progress_bar(set_bytes + repeats * (set_bytes + rb_bytes), !opts.progress);
    let measured = (|| -> Result<Samples> {
        pb.set_message("putting blocks into G4");
        let put_gbps = put_set(&store, payload_bytes as usize, blocks, queue_limit, &pb)?;
        let mut s = Samples {
            put_gbps,
            g4_gbps: Vec::new(),
            g4_per_sec: Vec::new(),
            rb_gbps: Vec::new(),
            rb_rps: Vec::new(),
        };
        for rep in 0..opts.repeat {
            let g4_first = rep % 2 == 0;
            for side in 0..2 {
                if (side == 0) == g4_first {
                    pb.set_message(format!("G4 restore ({}/{})", rep + 1, opts.repeat));
                    let secs = restore_pass(&store, blocks, chunk, &pb)?;
                    tracing::debug!("G4 restore: {:.3} GB/s", gbps(set_bytes, secs));
                    s.g4_gbps.push(gbps(set_bytes, secs));
                    s.g4_per_sec.push(blocks as f64 / secs.max(1e-9));
                } else if let Some(rb) = &rb {
                    pb.set_message(format!("redis-benchmark ({}/{})", rep + 1, opts.repeat));
                    let rps = rb.run()?;
                    let g = rps * value_bytes as f64 / 1e9;
                    tracing::debug!("redis-benchmark GET: {rps:.1} rps, {g:.3} GB/s");
                    s.rb_rps.push(rps);
                    s.rb_gbps.push(g);
                    pb.inc(rb_bytes);
                }
            }
        }
        Ok(s)
    })();
    let keys_left = if opts.keep {
        None
    } else {
        pb.set_message("deleting the bench blocks");
        Some(delete_set(remote, blocks))
    };
    pb.finish_and_clear();
    let s = measured?;
    if let Some(n) = keys_left.filter(|&n| n > 0) {
        tracing::warn!(
            "{n} bench blocks could not be deleted from {shown}; they expire on their own \
             (namespace {namespace})"
        );
    }

    let g4 = median(&s.g4_gbps);
    let rb_gbps = rb.as_ref().map(|_| median(&s.rb_gbps));
    let ratio = rb_gbps.filter(|&r| r > 0.0).map(|r| g4 / r);
    let report = G4BenchReport {
        redis_benchmark_get_gbps: rb_gbps,
        g4_get_gbps: g4,
        value_bytes,
        ratio,
        goal_ratio: GOAL_RATIO,
        goal_met: ratio.map(|r| r >= GOAL_RATIO),
        tier: "g4",
        remote: shown,
        namespace,
        payload_bytes,
        blocks,
        total_bytes: set_bytes,
        in_flight,
        chunk_blocks: chunk,
        repeat: opts.repeat,
        g4_get_per_sec: median(&s.g4_per_sec),
        g4_samples_gbps: s.g4_gbps,
        g4_put_gbps: s.put_gbps,
        redis_benchmark_rps: rb.as_ref().map(|_| median(&s.rb_rps)),
        redis_benchmark_samples_gbps: s.rb_gbps,
        redis_benchmark_requests: rb.as_ref().map(|r| r.requests),
        redis_benchmark_clients: rb.as_ref().map(|r| r.clients),
        redis_benchmark_pipeline: rb.as_ref().map(|_| 1),
        redis_benchmark_keyspace: rb.as_ref().map(|r| r.keyspace),
        redis_benchmark_bin: rb.as_ref().map(|r| r.bin.display().to_string()),
        redis_benchmark_version: rb.as_ref().and_then(|r| r.version.clone()),
        redis_benchmark_skipped: rb_skipped.map(str::to_string),
        g4_errors: m.remote.errors.get(),
        g4_timeouts: m.remote.timeouts.get(),
        kept: opts.keep,
        keys_left,
    };
    drop(store);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_end_in_the_decimal_index() {
        let k = g4_key(1234).to_hex();
        assert!(k.ends_with("000000001234"), "{k}");
        assert!(g4_key(999_999_999_999).to_hex().ends_with("999999999999"));
        assert_eq!(&g4_key(0).0[..10], KEY_PREFIX);
        assert_ne!(g4_key(1), g4_key(10));
        let name = format!("ns:{}", g4_key(0).to_hex());
        let t = key_template(&name).unwrap();
        assert!(t.starts_with("ns:") && t.ends_with(RAND_INT), "{t}");
        assert_eq!(
            t.replace(RAND_INT, "000000000077"),
            format!("ns:{}", g4_key(77).to_hex())
        );
        assert_eq!(key_template("ns:abc"), None);
    }

    #[test]
    fn layout_payload_is_the_block_bytes() {
        for bytes in [8u64 << 10, 256 << 10, 2 << 20, 16 << 20, 1 << 30] {
            assert_eq!(g4_layout(bytes).unwrap().payload_bytes(), bytes);
        }
        assert!(g4_layout(1000).is_err());
    }

    #[test]
    fn payloads_differ_per_block_and_run_to_run_the_same() {
        let a = pseudo_random(10_000);
        assert_eq!(a, pseudo_random(10_000));
        assert!(a.iter().filter(|&&b| b == 0).count() < 200);
        let mut p = a.clone();
        stamp_pages(&mut p, 5);
        assert_eq!(&p[4096..4104], &5u64.to_le_bytes());
        assert_eq!(&p[8..4096], &a[8..4096]);
    }

    #[test]
    fn namespaces_are_fresh() {
        let n = run_namespace("kvtier");
        assert!(
            n.starts_with(&format!("kvtier-bench-{}-", std::process::id())),
            "{n}"
        );
    }
}
