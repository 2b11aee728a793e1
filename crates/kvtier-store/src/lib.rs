//! kvtier-store: the tiered KV block store.
//!
//! Knows nothing about models: it stores fixed-size KV blocks named by
//! chained prefix hashes ([`key`]), in a versioned, checksummed format
//! ([`block`], its payload optionally coded to fewer bytes: [`codec`])
//! that every tier checks the same way ([`verify`]), across G2
//! host memory ([`memory`]), G3 disk ([`disk`]) and a G4 shared pool
//! ([`remote`]: Redis/Valkey, S3), with eviction policies ([`eviction`])
//! and an admission filter ([`admission`]). [`TieredStore`] ([`store`]) is
//! the facade callers use; [`Handle`] is how its background reads report.
//! Engines that own their KV memory load and save through [`transfer`]
//! ([`TieredStore::load`], [`TieredStore::save`]: regions of the caller's
//! memory, a [`Transfer`] handle, a [`BlockResult`] per block).

pub mod admission;
pub mod block;
pub mod codec;
mod codec_stream;
pub mod disk;
pub mod eviction;
mod handle;
pub mod key;
pub mod kv_layout;
pub mod layer_progress;
pub mod memory;
pub mod metrics;
pub mod outcome;
pub mod remote;
pub mod store;
pub mod transfer;
pub mod verify;
mod workers;

pub use block::{BlockBuf, BlockError};
pub use codec::{CodecError, KvCodec};
pub use disk::{DiskConfig, DiskError, DiskTier, Recovery};
pub use handle::Handle;
pub use key::{BlockKey, KeyChain, ModelFingerprint};
pub use kv_layout::{Arrangement, KvDtype, KvLayout, LayoutError, Part, TpShard};
pub use layer_progress::LayerProgress;
pub use metrics::{MetricsFormat, RemoteMetrics, StoreMetrics, Tier};
pub use outcome::{BlockFailure, BlockRead, Refused};
pub use remote::{RemoteConfig, RemoteError, RemoteTier};
pub use store::{
    DEFAULT_G3_SYNC, LayerSink, PrefixLookup, PutReport, SharedMemory, StoreConfig, StoreError,
    StoreStats, StoredBlock, TieredStore, WarmProgress,
};
pub use transfer::{BlockRegions, BlockResult, Transfer};
pub use verify::BlockSpec;
