//! G4: a KV block pool shared by many nodes, on engines operators already
//! run: Redis/Valkey (one node or a cluster, cargo feature `redis`) and
//! S3-compatible object stores (cargo feature `s3`). Both features are on by
//! default.
//!
//! [`RemoteTier`] is a blocking API, like the other tiers, over a small
//! tokio runtime of its own (two threads), so callers in any context (an
//! engine thread, a tokio blocking task, an async handler) can use it. Every
//! operation:
//!
//! * asks the circuit breaker ([`breaker`]) first; while it is open the
//!   operation is not sent at all: lookups and reads are misses, writes are
//!   dropped;
//! * runs under a time limit ([`RemoteConfig::timeout`]) per batch of at most
//!   [`RemoteConfig::batch_bytes`]; an error or a timeout is a failure for
//!   the breaker and a miss for the caller. A key that is not there is an
//!   answer, not a failure.
//!
//! The tier moves encoded blocks (header and payload, without the disk
//! padding); every value read is verified where it lands (checksums, key,
//! model, layout: [`BlockSpec::verify`]), and the
//! [`TieredStore`](crate::TieredStore) deletes one that fails. The engines
//! sit behind one trait (`backend`), one implementation per file.

mod backend;
pub mod breaker;
#[cfg(feature = "redis")]
mod redis_backend;
pub mod remote_config;
mod remote_error;
#[cfg(feature = "redis")]
mod resp_get;
#[cfg(feature = "s3")]
mod s3_backend;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_io::{AlignedBuf, HostAllocator};

pub use backend::{Fetched, Landing};
pub use breaker::{Breaker, BreakerConfig, BreakerState};
pub use remote_config::{RemoteConfig, S3Options, Target, parse_target, redact_url};
pub use remote_error::RemoteError;

use crate::key::BlockKey;
use crate::metrics::{RemoteMetrics, Tier, TierMetrics};
use crate::outcome::{BlockFailure, BlockRead, Refused};
use crate::verify::BlockSpec;
use backend::Backend;

/// A block to write through to G4: its key, its encoded bytes and how many
/// of them to send (header and payload; the padding stays home).
pub type RemoteBlock = (BlockKey, Arc<AlignedBuf>, usize);

/// The G4 tier (see the module docs). Thread-safe.
pub struct RemoteTier {
    backend: Arc<dyn Backend>,
    rt: Option<tokio::runtime::Runtime>,
    breaker: Breaker,
    key_prefix: String,
    timeout: Duration,
    in_flight: usize,
    batch_blocks: usize,
    landing: Landing,
    metrics: TierMetrics,
    remote: RemoteMetrics,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("pool", &self.backend.shown())
            .field("key_prefix", &self.key_prefix)
            .field("breaker", &self.breaker.state())
            .finish()
    }
}

impl RemoteTier {
    /// Sets up the tier for blocks of `spec` (its slot size sizes the
    /// batches and the buffers reads land in, which come from `alloc`);
    /// every value read is verified against `spec`. Does not connect: a
    /// pool that is down now is a run of misses until it is up, not an
    /// error. Fails only on a configuration that cannot work.
    pub(crate) fn open(
        config: &RemoteConfig,
        spec: BlockSpec,
        alloc: Arc<dyn HostAllocator>,
        metrics: TierMetrics,
        remote: RemoteMetrics,
    ) -> Result<Self, RemoteError> {
        let block_bytes = spec.layout.encoded_bytes();
        let target = config.target()?;
        if config.namespace.is_empty() || config.namespace.contains(['/', ' ']) {
            return Err(RemoteError::Config(format!(
                "G4 namespace {:?} must be non-empty, without '/' or spaces",
                config.namespace
            )));
        }
        let key_prefix = match &target {
            Target::S3 { prefix, .. } if !prefix.is_empty() => {
                format!("{prefix}/{}/", config.namespace)
            }
            Target::S3 { .. } => format!("{}/", config.namespace),
            _ => format!("{}:", config.namespace),
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvtier-g4")
            .enable_all()
            .build()
            .map_err(|e| RemoteError::Config(format!("cannot start the G4 runtime: {e}")))?;
        // Building some clients (object_store's HTTP client) wants a runtime.
        let backend = {
            let _guard = rt.enter();
            open_backend(config, &target)?
        };
        let batch_blocks = (config.batch_bytes / block_bytes.max(1)).clamp(1, 1 << 16) as usize;
        Ok(Self {
            backend,
            rt: Some(rt),
            breaker: Breaker::new(config.breaker),
            key_prefix,
            timeout: config.timeout,
            in_flight: config.in_flight.max(1),
            batch_blocks,
            landing: Landing {
                alloc,
                slot: usize::try_from(block_bytes).unwrap_or(usize::MAX),
                spec,
            },
            metrics,
            remote,
        })
    }

    /// The pool, as logs show it (no password).
    pub fn shown(&self) -> &str {
        self.backend.shown()
    }

    /// The breaker's state now.
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }

    /// The name `key` has in the pool.
    pub fn name(&self, key: &BlockKey) -> String {
        format!("{}{}", self.key_prefix, key.to_hex())
    }

    /// Runs one operation on the tier's runtime under the breaker and the
    /// time limit, and waits for it.
    fn call<T, F>(&self, op: impl FnOnce(Arc<dyn Backend>) -> F) -> Result<T, RemoteError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, RemoteError>> + Send + 'static,
    {
        let Some(rt) = &self.rt else {
            return Err(RemoteError::Unavailable);
        };
        let was = self.breaker.state();
        if !self.breaker.allow(Instant::now()) {
            return Err(RemoteError::Unavailable);
        }
        let fut = op(self.backend.clone());
        let limit = self.timeout;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        rt.spawn(async move {
            let r = tokio::time::timeout(limit, fut)
                .await
                .unwrap_or(Err(RemoteError::Timeout(limit)));
            let _ = tx.send(r);
        });
        let r = rx
            .recv()
            .unwrap_or_else(|_| Err(RemoteError::Backend("the G4 task was dropped".into())));
        match &r {
            Ok(_) => {
                self.breaker.success();
                if was != BreakerState::Closed {
                    tracing::info!("G4 {} answers again; circuit breaker closed", self.shown());
                }
            }
            Err(e) => {
                if matches!(e, RemoteError::Timeout(_)) {
                    self.remote.timeouts.inc();
                } else {
                    self.remote.errors.inc();
                }
                if self.breaker.failure(Instant::now()) {
                    tracing::warn!(
                        "G4 {} failing ({e}); circuit breaker open, serving misses",
                        self.shown()
                    );
                } else {
                    tracing::debug!("G4 {}: {e}", self.shown());
                }
            }
        }
        self.remote
            .breaker_open
            .set(i64::from(self.breaker.state() != BreakerState::Closed));
        r
    }

    /// Which of `keys` the pool holds. On any failure the unanswered keys
    /// are reported absent.
    pub fn contains_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.batch_blocks) {
            let names: Vec<String> = chunk.iter().map(|k| self.name(k)).collect();
            let n = self.in_flight;
            match self.call(move |b| async move { b.exists(&names, n).await }) {
                Ok(found) => out.extend(found),
                Err(_) => break,
            }
        }
        out.resize(keys.len(), false);
        out
    }

    /// Reads `keys`, each into a block buffer and checked: a hit, a miss, a
    /// value refused by its check, or (from the first batch the pool did not
    /// answer on, or while its breaker is open) a failed read.
    pub fn get_many(&self, keys: &[BlockKey]) -> Vec<BlockRead<AlignedBuf>> {
        self.get_batches(keys, false)
    }

    /// [`get_many`](Self::get_many) for the keys of a prefix: no batch is
    /// sent after one that held a miss (the prefix ends there, the keys
    /// after it are misses), so a long prompt whose prefix is short in the
    /// pool costs one batch, not one per key. One GET per key, no EXISTS
    /// first.
    pub fn get_leading(&self, keys: &[BlockKey]) -> Vec<BlockRead<AlignedBuf>> {
        self.get_batches(keys, true)
    }

    fn get_batches(&self, keys: &[BlockKey], stop_at_miss: bool) -> Vec<BlockRead<AlignedBuf>> {
        let mut out: Vec<BlockRead<AlignedBuf>> = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.batch_blocks) {
            let names: Vec<String> = chunk.iter().map(|k| self.name(k)).collect();
            let (n, landing, chunk) = (self.in_flight, self.landing.clone(), chunk.to_vec());
            let t = Instant::now();
            match self.call(move |b| async move { b.get(&names, &chunk, n, &landing).await }) {
                Ok(values) => {
                    self.metrics.read_seconds.observe(t.elapsed().as_secs_f64());
                    let bytes: usize = values.iter().flatten().flatten().map(AlignedBuf::len).sum();
                    self.metrics.read_bytes.inc_by(bytes as u64);
                    let missed = values.iter().any(|v| !matches!(v, Some(Ok(_))));
                    out.extend(values.into_iter().map(|v| match v {
                        Some(Ok(buf)) => BlockRead::Hit(buf),
                        Some(Err(reason)) => BlockRead::Corrupt(Refused {
                            tier: Tier::G4,
                            reason,
                        }),
                        None => BlockRead::Miss,
                    }));
                    if stop_at_miss && missed {
                        break;
                    }
                }
                Err(e) => {
                    let why = BlockFailure::Pool(format!("G4 {}: {e}", self.shown()));
                    out.resize_with(keys.len(), || BlockRead::Failed(why.clone()));
                    break;
                }
            }
        }
        out.resize_with(keys.len(), || BlockRead::Miss);
        out
    }

    /// Writes `blocks`; returns how many were written. Stops at the first
    /// failed batch (logged and counted); the caller counts the rest.
    pub fn put_many(&self, blocks: Vec<RemoteBlock>) -> usize {
        let mut blocks = blocks;
        let mut written = 0;
        while !blocks.is_empty() {
            let rest = blocks.split_off(blocks.len().min(self.batch_blocks));
            let items: Vec<(String, Arc<AlignedBuf>, usize)> = blocks
                .into_iter()
                .map(|(k, buf, len)| {
                    let len = len.min(buf.len());
                    (self.name(&k), buf, len)
                })
                .collect();
            let bytes: usize = items.iter().map(|(_, _, len)| len).sum();
            let count = items.len();
            let n = self.in_flight;
            let t = Instant::now();
            match self.call(move |b| async move { b.put(items, n).await }) {
                Ok(()) => {
                    self.metrics
                        .write_seconds
                        .observe(t.elapsed().as_secs_f64());
                    self.metrics.written_bytes.inc_by(bytes as u64);
                    self.metrics.written_blocks.inc_by(count as u64);
                    written += count;
                }
                Err(e) => {
                    if !matches!(e, RemoteError::Unavailable) {
                        self.metrics.put_errors.inc();
                    }
                    return written;
                }
            }
            blocks = rest;
        }
        written
    }

    /// Deletes `key` from the pool (a block that failed verification), best
    /// effort.
    pub fn delete(&self, key: &BlockKey) {
        let name = self.name(key);
        if let Err(e) = self.call(move |b| async move { b.delete(&name).await }) {
            tracing::debug!("deleting corrupt G4 block {key} failed: {e}");
        }
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        // Never blocks and never panics, even when dropped inside another
        // runtime's async context.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// The backend for `target`, or why this build has none.
fn open_backend(config: &RemoteConfig, target: &Target) -> Result<Arc<dyn Backend>, RemoteError> {
    let _ = config;
    match target {
        #[cfg(feature = "redis")]
        Target::Redis(url) => Ok(Arc::new(redis_backend::RedisBackend::node(url, config)?)),
        #[cfg(feature = "redis")]
        Target::RedisCluster(nodes) => Ok(Arc::new(redis_backend::RedisBackend::cluster(
            nodes, config,
        )?)),
        #[cfg(feature = "s3")]
        Target::S3 {
            bucket,
            endpoint,
            region,
            ..
        } => Ok(Arc::new(s3_backend::S3Backend::new(
            bucket,
            endpoint.as_deref(),
            region.as_deref(),
            &config.s3,
            config.connect_timeout,
            config.timeout,
        )?)),
        #[allow(unreachable_patterns)]
        other => Err(RemoteError::Config(format!(
            "G4 {other:?}: this kvtier was built without the cargo feature for it \
             (`redis` or `s3`)"
        ))),
    }
}
