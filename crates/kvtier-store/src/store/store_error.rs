//! Why a store operation failed.

use crate::block::BlockError;
use crate::disk::DiskError;
use crate::remote::RemoteError;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The configuration cannot work.
    #[error("bad store configuration: {0}")]
    Config(String),
    /// The disk tier failed to open or write.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// A block could not be encoded (wrong payload length, allocation).
    #[error(transparent)]
    Block(#[from] BlockError),
    /// The caller's memory for a load or save does not fit the blocks (a
    /// gap, an overlap, a piece past the payload, one buffer too few).
    #[error("bad block buffers: {0}")]
    Regions(String),
    /// A background task failed.
    #[error("store task failed: {0}")]
    Task(String),
    /// The G4 configuration cannot work (a pool that is down is not an
    /// error: it is misses).
    #[error(transparent)]
    Remote(#[from] RemoteError),
}
