//! What reading one block found, one shape at every level of the read
//! path: a G3 slot read (`disk`), a G4 GET (`remote`), a read through all
//! tiers (`store::tier_reads`) and an outside engine's load (`transfer`,
//! whose [`BlockResult`](crate::BlockResult) adds what saves and cancels
//! report). The reasons are typed: a refused block says which tier refused
//! it and the [`BlockError`] its check gave; a failed read says which tier
//! failed and how.

use std::fmt;

use crate::block::BlockError;
use crate::metrics::Tier;

/// What reading one block found.
#[derive(Debug)]
pub enum BlockRead<B> {
    /// Found and verified: the block (or, where the caller keeps the
    /// buffer, `()`).
    Hit(B),
    /// No tier asked holds it.
    Miss,
    /// A tier held it but it failed its check: deleted there, never served.
    Corrupt(Refused),
    /// The read failed (an I/O error, a pool that did not answer): nothing
    /// is known about the block; it stays where it was.
    Failed(BlockFailure),
}

impl<B> BlockRead<B> {
    /// The block, for a hit.
    pub fn hit(self) -> Option<B> {
        match self {
            BlockRead::Hit(b) => Some(b),
            _ => None,
        }
    }

    /// True for a hit.
    pub fn is_hit(&self) -> bool {
        matches!(self, BlockRead::Hit(_))
    }

    /// The hit, or the outcome that is not one (around any hit type).
    pub fn try_hit<C>(self) -> Result<B, BlockRead<C>> {
        match self {
            BlockRead::Hit(b) => Ok(b),
            BlockRead::Miss => Err(BlockRead::Miss),
            BlockRead::Corrupt(r) => Err(BlockRead::Corrupt(r)),
            BlockRead::Failed(f) => Err(BlockRead::Failed(f)),
        }
    }

    /// The same outcome around another hit value.
    pub fn map<C>(self, f: impl FnOnce(B) -> C) -> BlockRead<C> {
        match self.try_hit() {
            Ok(b) => BlockRead::Hit(f(b)),
            Err(other) => other,
        }
    }
}

/// A block a tier held and refused: its check failed, so it was deleted
/// from that tier and not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The tier that held it.
    pub tier: Tier,
    /// What its check found.
    pub reason: BlockError,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.tier.name().to_uppercase(), self.reason)
    }
}

impl std::error::Error for Refused {}

/// Why reading or saving one block failed (not a refused block: see
/// [`Refused`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockFailure {
    /// A G3 read failed; the block stays indexed.
    #[error("G3 read: {message}")]
    Disk {
        /// The I/O error's kind.
        kind: std::io::ErrorKind,
        /// The I/O error's message.
        message: String,
    },
    /// The G4 pool did not answer (its [`RemoteError`](crate::RemoteError)'s
    /// message).
    #[error("{0}")]
    Pool(String),
    /// The block could not be made, coded or copied to or from the caller's
    /// memory (a non-finite value for fp8/int8, no memory for it).
    #[error("{0}")]
    Block(BlockError),
}

impl BlockFailure {
    /// A failed G3 read.
    pub fn disk(e: &std::io::Error) -> Self {
        BlockFailure::Disk {
            kind: e.kind(),
            message: e.to_string(),
        }
    }

    /// `disk`, `pool` or `block`: the kind the Python API reports.
    pub fn cause(&self) -> &'static str {
        match self {
            BlockFailure::Disk { .. } => "disk",
            BlockFailure::Pool(_) => "pool",
            BlockFailure::Block(_) => "block",
        }
    }
}
