//! G4 on an S3-compatible object store (AWS S3, MinIO, Ceph RGW), through
//! `object_store`.
//!
//! One object per block, `<prefix>/<namespace>/<block key hex>`; lookups
//! are `HEAD`s, reads `GET`s, all of a batch in flight at once (up to
//! `in_flight`). Retries are left to kvtier's breaker (object_store's own
//! retry loop is limited to one quick retry), so a dead endpoint turns into
//! misses within the operation timeout.

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{ClientOptions, ObjectStoreExt, PutPayload, RetryConfig};

use super::backend::{Backend, NamedValue};
use super::backend::{Fetched, Landing};
use super::remote_config::S3Options;
use super::remote_error::RemoteError;
use crate::key::BlockKey;

/// An S3 G4 backend.
pub struct S3Backend {
    store: AmazonS3,
    shown: String,
}

/// Object paths, owned (the futures of a batch must not borrow the names).
fn paths(names: &[String]) -> Vec<Path> {
    names.iter().map(|n| Path::from(n.as_str())).collect()
}

fn s3_err(shown: &str, e: &object_store::Error) -> RemoteError {
    RemoteError::Backend(format!("{shown}: {e}"))
}

impl S3Backend {
    /// A backend for `bucket` (objects under `prefix`), configured from
    /// `opts`, then the URL's query, then the environment.
    pub fn new(
        bucket: &str,
        endpoint: Option<&str>,
        region: Option<&str>,
        opts: &S3Options,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Result<Self, RemoteError> {
        let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
        let endpoint = opts.endpoint.as_deref().or(endpoint);
        if let Some(ep) = endpoint {
            b = b.with_endpoint(ep);
        }
        if let Some(r) = opts.region.as_deref().or(region) {
            b = b.with_region(r);
        }
        if let Some(k) = &opts.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(s) = &opts.secret_access_key {
            b = b.with_secret_access_key(s);
        }
        let http = endpoint.is_some_and(|e| e.starts_with("http://"));
        let client = ClientOptions::new()
            .with_allow_http(http)
            .with_connect_timeout(connect_timeout)
            .with_timeout(timeout);
        let retry = RetryConfig {
            max_retries: 1,
            retry_timeout: timeout,
            ..RetryConfig::default()
        };
        let shown = format!(
            "s3://{bucket}{}",
            endpoint.map_or(String::new(), |e| format!(" at {e}"))
        );
        let store = b
            .with_client_options(client)
            .with_retry(retry)
            // Path-style requests (`endpoint/bucket/key`): what MinIO and
            // most S3-compatible servers expect.
            .with_virtual_hosted_style_request(false)
            .build()
            .map_err(|e| RemoteError::Config(format!("G4 {shown}: {e}")))?;
        Ok(Self { store, shown })
    }

    /// Runs `op` on every item, up to `in_flight` at once, results in
    /// order; the first error fails the batch.
    async fn each<I, T, Fut>(
        &self,
        items: Vec<I>,
        in_flight: usize,
        op: impl FnMut(I) -> Fut,
    ) -> Result<Vec<T>, RemoteError>
    where
        Fut: Future<Output = Result<T, object_store::Error>>,
    {
        let results: Vec<Result<T, object_store::Error>> = stream::iter(items)
            .map(op)
            .buffered(in_flight.max(1))
            .collect()
            .await;
        results
            .into_iter()
            .map(|r| r.map_err(|e| s3_err(&self.shown, &e)))
            .collect()
    }
}

impl Backend for S3Backend {
    fn shown(&self) -> &str {
        &self.shown
    }

    /// Which of `names` exist.
    fn exists<'a>(
        &'a self,
        names: &'a [String],
        in_flight: usize,
    ) -> BoxFuture<'a, Result<Vec<bool>, RemoteError>> {
        Box::pin(async move {
            self.each(paths(names), in_flight, |p| async move {
                match self.store.head(&p).await {
                    Ok(_) => Ok(true),
                    Err(object_store::Error::NotFound { .. }) => Ok(false),
                    Err(e) => Err(e),
                }
            })
            .await
        })
    }

    /// The values of `names` (the names of `keys`), each landed and
    /// checked by `landing`.
    fn get<'a>(
        &'a self,
        names: &'a [String],
        keys: &'a [BlockKey],
        in_flight: usize,
        landing: &'a Landing,
    ) -> BoxFuture<'a, Result<Vec<Fetched>, RemoteError>> {
        Box::pin(async move {
            let values = self
                .each(paths(names), in_flight, |p| async move {
                    match self.store.get(&p).await {
                        Ok(r) => r.bytes().await.map(Some),
                        Err(object_store::Error::NotFound { .. }) => Ok(None),
                        Err(e) => Err(e),
                    }
                })
                .await?;
            landing.land_all(values, keys)
        })
    }

    /// Writes every `(name, value)`.
    fn put(
        &self,
        items: Vec<NamedValue>,
        in_flight: usize,
    ) -> BoxFuture<'_, Result<(), RemoteError>> {
        Box::pin(async move {
            self.each(items, in_flight, |(n, buf, len)| async move {
                let payload = PutPayload::from(buf[..len].to_vec());
                self.store
                    .put(&Path::from(n.as_str()), payload)
                    .await
                    .map(|_| ())
            })
            .await
            .map(|_| ())
        })
    }

    /// Deletes `name` (a block that failed verification).
    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), RemoteError>> {
        Box::pin(async move {
            self.store
                .delete(&Path::from(name))
                .await
                .map_err(|e| s3_err(&self.shown, &e))
        })
    }
}
