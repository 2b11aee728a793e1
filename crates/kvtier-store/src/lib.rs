//! kvtier-store: the tiered KV block store.
//!
//! Knows nothing about models: it stores fixed-size KV blocks named by
//! chained prefix hashes ([`key`]), in a versioned, checksummed format
//! ([`block`]), across G2 host memory, G3 disk and G4 shared-pool
//! ([`remote`]: Redis/Valkey, S3) tiers.

pub mod admission;
pub mod block;
pub mod disk;
pub mod key;
pub mod layout;
pub mod memory;
pub mod metrics;
pub mod policy;
pub mod remote;
pub mod store;

pub use block::BlockError;
pub use disk::{DiskConfig, DiskError, DiskTier};
pub use key::{BlockKey, KeyChain, ModelFingerprint};
pub use layout::{KvDtype, KvLayout};
pub use metrics::{RemoteMetrics, StoreMetrics, Tier};
pub use remote::{RemoteConfig, RemoteError, RemoteTier};
pub use store::{
    PrefixLookup, PutReport, StoreConfig, StoreError, StoreStats, StoredBlock, TieredStore,
};
