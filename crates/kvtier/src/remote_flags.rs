//! The G4 flags shared by `serve`, `prefill` and `store bench --tier g4`.

use std::time::Duration;

use clap::Args;
use kvtier_store::RemoteConfig;

/// Where the shared G4 pool is and how long to wait for it.
#[derive(Debug, Clone, Args)]
pub struct RemoteFlags {
    /// G4 pool shared with other nodes: `redis://[user:pass@]host:port`,
    /// `rediss://...` (TLS), `redis+cluster://host:port,host:port`, or
    /// `s3://bucket/prefix?endpoint=http://host:port` (S3 credentials from
    /// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY). Passwords are never
    /// printed.
    #[arg(long, value_name = "URL", env = "KVTIER_REMOTE")]
    pub remote: Option<String>,

    /// Key namespace in the G4 pool (deployments sharing one pool keep
    /// apart by it; tenants by --tenant-salt).
    #[arg(long, value_name = "NAME", default_value = "kvtier")]
    pub remote_namespace: String,

    /// Time limit of one G4 operation in milliseconds; past it the blocks
    /// are misses (recomputed) and the failure counts toward the circuit
    /// breaker.
    #[arg(long, value_name = "MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub remote_timeout_ms: u64,

    /// Expiry of blocks written to a Redis pool, in seconds [default: none,
    /// the pool's maxmemory policy decides].
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub remote_ttl_secs: Option<u64>,

    /// PEM file of the certificate authority that signed a `rediss://`
    /// pool's certificate (a private CA) [default: the public web roots].
    #[arg(long, value_name = "FILE")]
    pub remote_tls_ca: Option<std::path::PathBuf>,
}

impl RemoteFlags {
    /// The G4 configuration, when `--remote` is given.
    pub fn config(&self) -> Option<RemoteConfig> {
        let url = self.remote.as_ref()?;
        let mut c = RemoteConfig::new(url.clone());
        c.namespace = self.remote_namespace.clone();
        c.timeout = Duration::from_millis(self.remote_timeout_ms);
        c.ttl = self.remote_ttl_secs.map(Duration::from_secs);
        c.tls_ca_file = self.remote_tls_ca.clone();
        Some(c)
    }
}
