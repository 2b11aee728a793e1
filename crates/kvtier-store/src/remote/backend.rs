//! The seam between [`RemoteTier`](super::RemoteTier) (breaker, time limits,
//! batching, metrics) and the engines G4 runs on: one [`Backend`] trait and
//! one implementation per engine, each in its own file and behind its cargo
//! feature (`redis_backend`, `s3_backend`). [`open`] is the only place that
//! knows which implementations were compiled in.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use kvtier_io::AlignedBuf;

use super::config::{RemoteConfig, Target};
use super::{Fetched, Landing, RemoteError};
use crate::key::BlockKey;

/// A value to write: its name in the pool, its buffer and how many of the
/// buffer's bytes to send.
pub(crate) type NamedValue = (String, Arc<AlignedBuf>, usize);

/// One engine a G4 pool lives on. Every call is one batch, run on the
/// tier's runtime under its breaker and time limit; a key that is absent is
/// an answer (`false`, `None`), a failure of the engine is an `Err`.
pub(crate) trait Backend: Send + Sync {
    /// The pool as logs show it (no password).
    fn shown(&self) -> &str;

    /// Which of `names` exist.
    fn exists<'a>(
        &'a self,
        names: &'a [String],
        in_flight: usize,
    ) -> BoxFuture<'a, Result<Vec<bool>, RemoteError>>;

    /// The values of `names` (the names of `keys`), in order, each landed in
    /// a block buffer and checked by `landing`.
    fn get<'a>(
        &'a self,
        names: &'a [String],
        keys: &'a [BlockKey],
        in_flight: usize,
        landing: &'a Landing,
    ) -> BoxFuture<'a, Result<Vec<Fetched>, RemoteError>>;

    /// Writes every value.
    fn put(
        &self,
        items: Vec<NamedValue>,
        in_flight: usize,
    ) -> BoxFuture<'_, Result<(), RemoteError>>;

    /// Deletes `name` (a block that failed verification).
    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), RemoteError>>;
}

/// The backend for `target`, or why this build has none.
pub(crate) fn open(
    config: &RemoteConfig,
    target: &Target,
) -> Result<Arc<dyn Backend>, RemoteError> {
    let _ = config;
    match target {
        #[cfg(feature = "redis")]
        Target::Redis(url) => Ok(Arc::new(super::redis_backend::RedisBackend::node(
            url, config,
        )?)),
        #[cfg(feature = "redis")]
        Target::RedisCluster(nodes) => Ok(Arc::new(super::redis_backend::RedisBackend::cluster(
            nodes, config,
        )?)),
        #[cfg(feature = "s3")]
        Target::S3 {
            bucket,
            endpoint,
            region,
            ..
        } => Ok(Arc::new(super::s3_backend::S3Backend::new(
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
