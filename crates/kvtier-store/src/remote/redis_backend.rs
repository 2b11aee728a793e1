//! G4 on Redis or Valkey, one node or a cluster, through the `redis` crate.
//!
//! Values are whole encoded blocks under `<namespace>:<block key hex>`.
//! Every batch sends its commands concurrently over one multiplexed
//! connection (a connection manager for one node, the cluster connection
//! for a cluster), up to `in_flight` at once: the commands go out back to
//! back like a pipeline, and in a cluster each goes to the node owning its
//! slot (a `MGET` or a single pipeline would have to stay in one slot).
//! A failed connection is dropped and made again on the next operation the
//! circuit breaker lets through.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, RedisError, TlsCertificates};
use tokio::sync::Mutex;

use super::backend::{Backend, NamedValue};
use super::backend::{Fetched, Landing};
use super::remote_config::{RemoteConfig, redact_url};
use super::remote_error::RemoteError;
use super::resp_get::{FastGet, NodeAddr};
use crate::key::BlockKey;

#[derive(Clone)]
enum Conn {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn query<T: FromRedisValue>(&mut self, cmd: &Cmd) -> Result<T, RedisError> {
        match self {
            Conn::Node(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => cmd.query_async(c).await,
        }
    }
}

// One per pool, made once: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
enum Client {
    Node(redis::Client),
    Cluster(ClusterClient),
}

/// A Redis/Valkey G4 backend.
pub struct RedisBackend {
    client: Client,
    /// The hand-written read path, for a plain-TCP node.
    fast: Option<Arc<FastGet>>,
    /// Shown in errors and logs (password redacted).
    shown: String,
    conn: Mutex<Option<Conn>>,
    connect_timeout: Duration,
    response_timeout: Duration,
    ttl: Option<Duration>,
}

/// The hand-written read path for a node reached over plain TCP (TLS and
/// Unix sockets stay on the `redis` crate).
fn fast_get_for(
    client: &redis::Client,
    shown: &str,
    config: &RemoteConfig,
) -> Option<Arc<FastGet>> {
    let info = client.get_connection_info();
    let redis::ConnectionAddr::Tcp(host, port) = info.addr() else {
        return None;
    };
    let settings = info.redis_settings();
    let addr = NodeAddr {
        host_port: format!("{host}:{port}"),
        user: settings.username().map(str::to_string),
        password: settings.password().map(str::to_string),
        db: settings.db(),
    };
    Some(Arc::new(FastGet::new(
        addr,
        shown.to_string(),
        config.connect_timeout,
    )))
}

/// The private CA to trust for `rediss://`, when configured.
fn tls_certs(config: &RemoteConfig) -> Result<Option<TlsCertificates>, RemoteError> {
    let Some(path) = &config.tls_ca_file else {
        return Ok(None);
    };
    let pem = std::fs::read(path)
        .map_err(|e| RemoteError::Config(format!("G4 TLS CA file {}: {e}", path.display())))?;
    Ok(Some(TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    }))
}

/// One `CMD name` per name.
fn per_name(cmd: &str, names: &[String]) -> Vec<Cmd> {
    names
        .iter()
        .map(|n| {
            let mut c = redis::cmd(cmd);
            c.arg(n);
            c
        })
        .collect()
}

fn redis_err(shown: &str, e: &RedisError, limit: Duration) -> RemoteError {
    if e.is_timeout() {
        return RemoteError::Timeout(limit);
    }
    // The redis crate's errors name the server, never its password.
    RemoteError::Backend(format!("{shown}: {e}"))
}

impl RedisBackend {
    /// A backend for one node (`url` as the `redis` crate parses it).
    /// Connects lazily.
    pub fn node(url: &str, config: &RemoteConfig) -> Result<Self, RemoteError> {
        let shown = redact_url(url);
        let opened = match tls_certs(config)? {
            Some(certs) => redis::Client::build_with_tls(url, certs),
            None => redis::Client::open(url),
        };
        let client = opened.map_err(|e| {
            RemoteError::Config(format!(
                "G4 URL {shown}: {}",
                e.to_string().replace(url, &shown)
            ))
        })?;
        let fast = fast_get_for(&client, &shown, config);
        Ok(Self {
            client: Client::Node(client),
            fast,
            shown,
            conn: Mutex::new(None),
            connect_timeout: config.connect_timeout,
            response_timeout: config.timeout,
            ttl: config.ttl,
        })
    }

    /// A backend for a cluster, from seed node URLs. Connects lazily.
    pub fn cluster(nodes: &[String], config: &RemoteConfig) -> Result<Self, RemoteError> {
        let shown = nodes
            .iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(",");
        let mut builder = ClusterClient::builder(nodes.iter().map(String::as_str))
            .connection_timeout(config.connect_timeout)
            .response_timeout(config.timeout)
            .retries(1);
        if let Some(certs) = tls_certs(config)? {
            builder = builder.certs(certs);
        }
        let client = builder
            .build()
            .map_err(|e| RemoteError::Config(format!("G4 cluster {shown}: {e}")))?;
        Ok(Self {
            client: Client::Cluster(client),
            fast: None,
            shown,
            conn: Mutex::new(None),
            connect_timeout: config.connect_timeout,
            response_timeout: config.timeout,
            ttl: config.ttl,
        })
    }

    async fn conn(&self) -> Result<Conn, RemoteError> {
        let mut guard = self.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let made = match &self.client {
            Client::Node(client) => {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.response_timeout))
                    .set_number_of_retries(1);
                client
                    .get_connection_manager_with_config(cfg)
                    .await
                    .map(Conn::Node)
            }
            Client::Cluster(client) => client.get_async_connection().await.map(Conn::Cluster),
        };
        let conn = made.map_err(|e| redis_err(&self.shown, &e, self.connect_timeout))?;
        *guard = Some(conn.clone());
        Ok(conn)
    }

    /// Forgets the connection after a failure, so the next operation makes
    /// a fresh one.
    async fn reset(&self) {
        *self.conn.lock().await = None;
    }

    async fn run_all<T: FromRedisValue + Send + 'static>(
        &self,
        cmds: Vec<Cmd>,
        in_flight: usize,
    ) -> Result<Vec<T>, RemoteError> {
        let conn = self.conn().await?;
        let results: Vec<Result<T, RedisError>> = stream::iter(cmds)
            .map(|cmd| {
                let mut c = conn.clone();
                async move { c.query::<T>(&cmd).await }
            })
            .buffered(in_flight.max(1))
            .collect()
            .await;
        let mut out = Vec::with_capacity(results.len());
        for r in results {
            match r {
                Ok(v) => out.push(v),
                Err(e) => {
                    self.reset().await;
                    return Err(redis_err(&self.shown, &e, self.response_timeout));
                }
            }
        }
        Ok(out)
    }
}

impl Backend for RedisBackend {
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
            let cmds = per_name("EXISTS", names);
            let counts: Vec<i64> = self.run_all(cmds, in_flight).await?;
            Ok(counts.into_iter().map(|n| n > 0).collect())
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
            if let Some(fast) = &self.fast {
                return fast.clone().get(names, keys, in_flight, landing).await;
            }
            let cmds = per_name("GET", names);
            let values: Vec<Option<Vec<u8>>> = self.run_all(cmds, in_flight).await?;
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
            let cmds = items
                .iter()
                .map(|(n, buf, len)| {
                    let mut c = redis::cmd("SET");
                    c.arg(n).arg(&buf[..*len]);
                    if let Some(ttl) = self.ttl {
                        c.arg("PX").arg(ttl.as_millis().max(1) as u64);
                    }
                    c
                })
                .collect();
            let _: Vec<redis::Value> = self.run_all(cmds, in_flight).await?;
            Ok(())
        })
    }

    /// Deletes `name` (a block that failed verification).
    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), RemoteError>> {
        Box::pin(async move {
            let _: Vec<i64> = self
                .run_all(per_name("DEL", &[name.to_string()]), 1)
                .await?;
            Ok(())
        })
    }
}
