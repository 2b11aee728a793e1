//! kvtier-store: the tiered KV block store.
//!
//! Knows nothing about models: it stores fixed-size KV blocks named by
//! chained prefix hashes, in a versioned, checksummed format that every
//! tier checks the same way, across G2 host memory, G3 disk and a G4 shared
//! pool. [`TieredStore`] is the facade callers use.
//!
//! What lives where:
//!
//! * Blocks: [`key`] (chained prefix hashes, model fingerprints),
//!   [`kv_layout`] (the shape of one block, TP shards), [`block`] (the
//!   on-disk and on-wire format), [`codec`] (payloads coded to fewer bytes;
//!   `codec_stream` codes while copying), [`verify`] (the one check every
//!   tier runs).
//! * Tiers: [`memory`] (G2), [`disk`] (G3: slots, direct I/O, the saved
//!   index), [`remote`] (G4: Redis/Valkey, Cluster, S3, a circuit
//!   breaker), [`eviction`] (the policies G2 and G3 run), [`admission`] (the
//!   second-sighting filter).
//! * The store: [`store`] ([`TieredStore`]: puts, write-back, reads through
//!   the tiers in steps, layer-wise reads), [`outcome`] (what a block's
//!   read found, one type at every level), `handle` (background
//!   reads, [`Handle`]), `workers` (the store's threads).
//! * Engines that own their KV memory: [`transfer`] ([`TieredStore::load`],
//!   [`TieredStore::save`]: regions of the caller's memory, a [`Transfer`]
//!   handle, a [`BlockResult`] per block), [`layer_progress`] (which layers
//!   of a layer-wise read are in; shared with the engine's restore).
//! * [`metrics`]: the store's Prometheus counters, per tier;
//!   [`tier_tokens`]: prompt tokens served per tier, the one count type the
//!   engine, the server and the benchmarks share.

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
pub mod tier_tokens;
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
pub use tier_tokens::TierTokens;
pub use transfer::{BlockRegions, BlockResult, Transfer};
pub use verify::BlockSpec;
