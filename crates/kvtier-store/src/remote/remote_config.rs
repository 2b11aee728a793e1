//! G4 configuration: the pool's URL and the limits that keep a slow pool
//! off the request path.
//!
//! URL forms (one `--remote` flag carries all of it):
//!
//! * `redis://[user[:password]@]host:port[/db]`: Redis or Valkey, one node
//!   (`valkey://` is accepted too).
//! * `rediss://...`: the same over TLS (append `#insecure` to skip
//!   certificate checks, as the `redis` crate allows).
//! * `redis+cluster://[user[:password]@]host1:port1,host2:port2,...`: a
//!   Redis Cluster, any reachable nodes as seeds (`rediss+cluster://` for
//!   TLS).
//! * `s3://bucket[/prefix][?endpoint=http://host:port&region=r]`: an
//!   S3-compatible object store. Credentials come from [`S3Options`] or the
//!   usual `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_REGION` /
//!   `AWS_ENDPOINT_URL` environment variables; plain-HTTP endpoints are
//!   allowed (MinIO, Ceph RGW on a private network).
//!
//! Passwords are never printed: [`redact_url`] is what `Debug`, logs and
//! metrics show.

use std::time::Duration;

use super::breaker::BreakerConfig;
use super::remote_error::RemoteError;

/// S3 settings that override the environment.
#[derive(Clone, Default)]
pub struct S3Options {
    /// Endpoint URL (e.g. `http://127.0.0.1:9000`); default: AWS, or
    /// `AWS_ENDPOINT_URL`, or the URL's `endpoint` query parameter.
    pub endpoint: Option<String>,
    /// Region; default `AWS_REGION` or `us-east-1`.
    pub region: Option<String>,
    /// Access key id.
    pub access_key_id: Option<String>,
    /// Secret access key.
    pub secret_access_key: Option<String>,
}

impl std::fmt::Debug for S3Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Options")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field(
                "secret_access_key",
                &self.secret_access_key.as_ref().map(|_| "***"),
            )
            .finish()
    }
}

/// Configuration of the G4 tier.
#[derive(Clone)]
pub struct RemoteConfig {
    /// Where the pool is (see the module docs for the forms).
    pub url: String,
    /// Prefix of every key this store writes (`<namespace>:<block key>` in
    /// Redis, `<prefix>/<namespace>/<block key>` in S3). Block keys already
    /// carry the model fingerprint, layout and tenant salt; the namespace
    /// separates deployments sharing one pool.
    pub namespace: String,
    /// Time limit of one remote operation (one batch of lookups, reads or
    /// writes of at most `batch_bytes`). Past it the operation counts as a
    /// failure and its blocks as misses.
    pub timeout: Duration,
    /// Time limit of connecting.
    pub connect_timeout: Duration,
    /// Requests in flight at once within one batch.
    pub in_flight: usize,
    /// Largest batch, in bytes of block data, sent under one timeout.
    pub batch_bytes: u64,
    /// Bytes of blocks waiting for write-through before new ones are
    /// dropped (counted in `kvtier_store_remote_dropped_puts`): G4 is a
    /// cache, and a slow pool must never hold up a put.
    pub write_queue_bytes: u64,
    /// Expiry of blocks written to Redis (none: the pool's eviction policy,
    /// e.g. `maxmemory-policy allkeys-lru`, decides). Ignored for S3, where
    /// a bucket lifecycle rule does the same job.
    pub ttl: Option<Duration>,
    /// Circuit breaker settings.
    pub breaker: BreakerConfig,
    /// S3 settings (ignored for Redis).
    pub s3: S3Options,
    /// PEM file of the certificate authority that signed a `rediss://`
    /// server's certificate (a private CA); default: the public web roots.
    pub tls_ca_file: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("url", &redact_url(&self.url))
            .field("namespace", &self.namespace)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("in_flight", &self.in_flight)
            .field("batch_bytes", &self.batch_bytes)
            .field("write_queue_bytes", &self.write_queue_bytes)
            .field("ttl", &self.ttl)
            .field("breaker", &self.breaker)
            .field("s3", &self.s3)
            .field("tls_ca_file", &self.tls_ca_file)
            .finish()
    }
}

impl RemoteConfig {
    /// Defaults for `url`: namespace `kvtier`, 2 s per operation, 1 s to
    /// connect, 64 requests in flight, 64 MiB batches, a 256 MiB
    /// write-through queue, no expiry, the default breaker.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            namespace: "kvtier".into(),
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(1),
            in_flight: 64,
            batch_bytes: 64 << 20,
            write_queue_bytes: 256 << 20,
            ttl: None,
            breaker: BreakerConfig::default(),
            s3: S3Options::default(),
            tls_ca_file: None,
        }
    }

    /// Parses the URL into a backend target, checking everything that can
    /// be checked without a connection.
    pub fn target(&self) -> Result<Target, RemoteError> {
        parse_target(&self.url)
    }
}

/// Which backend a URL names.
#[derive(Clone, PartialEq, Eq)]
pub enum Target {
    /// One Redis/Valkey node (its URL as the `redis` crate takes it).
    Redis(String),
    /// Redis Cluster seed nodes, each as a `redis://` or `rediss://` URL.
    RedisCluster(Vec<String>),
    /// An S3 bucket, a key prefix inside it (no leading or trailing `/`),
    /// and an endpoint from the URL's query, if any.
    S3 {
        /// Bucket name.
        bucket: String,
        /// Key prefix (may be empty).
        prefix: String,
        /// `endpoint` query parameter.
        endpoint: Option<String>,
        /// `region` query parameter.
        region: Option<String>,
    },
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Redis(u) => write!(f, "Redis({})", redact_url(u)),
            Target::RedisCluster(us) => {
                let us: Vec<String> = us.iter().map(|u| redact_url(u)).collect();
                write!(f, "RedisCluster({us:?})")
            }
            Target::S3 {
                bucket,
                prefix,
                endpoint,
                region,
            } => f
                .debug_struct("S3")
                .field("bucket", bucket)
                .field("prefix", prefix)
                .field("endpoint", endpoint)
                .field("region", region)
                .finish(),
        }
    }
}

fn bad(url: &str, why: impl std::fmt::Display) -> RemoteError {
    RemoteError::Config(format!("G4 URL {}: {why}", redact_url(url)))
}

/// Parses a G4 URL (see the module docs).
pub fn parse_target(url: &str) -> Result<Target, RemoteError> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(bad(url, "expected scheme://..."));
    };
    match scheme {
        "redis" | "rediss" | "valkey" | "valkeys" => {
            if rest.is_empty() {
                return Err(bad(url, "no host"));
            }
            Ok(Target::Redis(url.to_string()))
        }
        "redis+cluster" | "rediss+cluster" | "valkey+cluster" | "valkeys+cluster" => {
            let node_scheme = scheme.trim_end_matches("+cluster");
            let (auth, hosts) = match rest.rsplit_once('@') {
                Some((a, h)) => (Some(a), h),
                None => (None, rest),
            };
            let (hosts, fragment) = match hosts.split_once('#') {
                Some((h, f)) => (h, Some(f)),
                None => (hosts, None),
            };
            let hosts = hosts.trim_end_matches('/');
            let nodes: Vec<String> = hosts
                .split(',')
                .filter(|h| !h.is_empty())
                .map(|h| {
                    let mut u = format!("{node_scheme}://");
                    if let Some(a) = auth {
                        u.push_str(a);
                        u.push('@');
                    }
                    u.push_str(h);
                    if let Some(f) = fragment {
                        u.push('#');
                        u.push_str(f);
                    }
                    u
                })
                .collect();
            if nodes.is_empty() {
                return Err(bad(url, "no cluster nodes"));
            }
            if let Some(h) = hosts.split(',').find(|h| h.contains('/')) {
                return Err(bad(
                    url,
                    format!("cluster node {h} has a path (no database numbers in a cluster)"),
                ));
            }
            Ok(Target::RedisCluster(nodes))
        }
        "s3" => {
            let (path, query) = match rest.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (rest, None),
            };
            let (bucket, prefix) = match path.split_once('/') {
                Some((b, p)) => (b, p.trim_matches('/')),
                None => (path, ""),
            };
            if bucket.is_empty() {
                return Err(bad(url, "no bucket"));
            }
            let mut endpoint = None;
            let mut region = None;
            for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
                match pair.split_once('=') {
                    Some(("endpoint", v)) if !v.is_empty() => endpoint = Some(v.to_string()),
                    Some(("region", v)) if !v.is_empty() => region = Some(v.to_string()),
                    _ => {
                        return Err(bad(
                            url,
                            format!("unknown query parameter {pair:?} (endpoint=, region=)"),
                        ));
                    }
                }
            }
            Ok(Target::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.to_string(),
                endpoint,
                region,
            })
        }
        other => Err(bad(
            url,
            format!("unknown scheme {other:?} (redis, rediss, redis+cluster, s3)"),
        )),
    }
}

/// `url` with any password replaced by `***` (also in every node of a
/// cluster URL). The only form in which a G4 URL is shown.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.rsplit_once('@') {
        Some((auth, hosts)) => {
            let user = auth.split_once(':').map_or(auth, |(u, _)| u);
            if auth.contains(':') {
                format!("{scheme}://{user}:***@{hosts}")
            } else {
                // A lone field before `@` is a password to the redis crate
                // when the user is empty; treat it as secret.
                format!("{scheme}://***@{hosts}")
            }
        }
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_scheme() {
        assert_eq!(
            parse_target("redis://127.0.0.1:6379").ok(),
            Some(Target::Redis("redis://127.0.0.1:6379".into()))
        );
        assert_eq!(
            parse_target("rediss+cluster://u:p@a:1,b:2/#insecure").ok(),
            Some(Target::RedisCluster(vec![
                "rediss://u:p@a:1#insecure".into(),
                "rediss://u:p@b:2#insecure".into()
            ]))
        );
        assert_eq!(
            parse_target("s3://bkt/some/prefix/?endpoint=http://127.0.0.1:9000&region=eu").ok(),
            Some(Target::S3 {
                bucket: "bkt".into(),
                prefix: "some/prefix".into(),
                endpoint: Some("http://127.0.0.1:9000".into()),
                region: Some("eu".into()),
            })
        );
        assert_eq!(
            parse_target("s3://bkt").ok(),
            Some(Target::S3 {
                bucket: "bkt".into(),
                prefix: String::new(),
                endpoint: None,
                region: None,
            })
        );
    }

    #[test]
    fn rejects_bad_urls_without_showing_the_password() {
        for url in [
            "",
            "127.0.0.1:6379",
            "http://x",
            "redis://",
            "redis+cluster://u:secret@",
            "redis+cluster://u:secret@a:1/0",
            "s3://",
            "s3://b?endpoint",
            "s3://b?colour=red",
        ] {
            let e = parse_target(url).expect_err(url).to_string();
            assert!(!e.contains("secret"), "{e}");
            assert!(e.contains("G4 URL"), "{e}");
        }
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("redis://user:pw@h:1/0"),
            "redis://user:***@h:1/0"
        );
        assert_eq!(redact_url("redis://pw@h:1"), "redis://***@h:1");
        assert_eq!(
            redact_url("redis+cluster://u:p@a:1,b:2"),
            "redis+cluster://u:***@a:1,b:2"
        );
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        let cfg = RemoteConfig::new("rediss://admin:hunter2@h:1");
        assert!(!format!("{cfg:?}").contains("hunter2"));
        let mut cfg = RemoteConfig::new("s3://b");
        cfg.s3.secret_access_key = Some("hunter2".into());
        assert!(!format!("{cfg:?}").contains("hunter2"));
    }
}
