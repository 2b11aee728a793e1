//! The seam between [`RemoteTier`](super::RemoteTier) (breaker, time limits,
//! batching, metrics) and the engines G4 runs on: one [`Backend`] trait and
//! one implementation per engine, each in its own file and behind its cargo
//! feature (`redis_backend`, `s3_backend`), and what they share: where
//! read values land and how they are checked ([`Landing`]). The tier's
//! `open_backend` is the only place that knows which implementations were
//! compiled in.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator};

use super::remote_error::RemoteError;
use crate::block::BlockError;
use crate::key::BlockKey;
use crate::verify::BlockSpec;

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

/// What a backend's read gives for one key: absent, a checked block, or
/// why the value there was refused. [`RemoteTier`](super::RemoteTier)
/// turns it into a [`BlockRead`](crate::BlockRead).
pub type Fetched = Option<Result<AlignedBuf, BlockError>>;

/// Where values read from the pool land (block buffers of `slot` bytes from
/// `alloc`) and how they are checked ([`BlockSpec::verify`]). Backends check
/// each value as it lands, so on the hand-written read path checking
/// overlaps the replies still arriving on other connections.
#[derive(Clone)]
pub struct Landing {
    pub(crate) alloc: Arc<dyn HostAllocator>,
    pub(crate) slot: usize,
    pub(crate) spec: BlockSpec,
}

impl Landing {
    /// Checks a value already in a block buffer (its length the value's,
    /// its capacity at least a slot) and extends it to a whole local block
    /// (zero padding); `Err` says why it was refused.
    pub(crate) fn check(
        &self,
        key: &BlockKey,
        mut buf: AlignedBuf,
    ) -> Result<AlignedBuf, BlockError> {
        let len = buf.len();
        self.spec.verify(&buf, key)?;
        if buf.capacity() < self.slot {
            return Err(BlockError::TooShort {
                needed: self.slot,
                got: buf.capacity(),
            });
        }
        buf.set_len(self.slot);
        buf[len..].fill(0);
        Ok(buf)
    }

    /// Copies a value into a block buffer, then checks it.
    pub(crate) fn land(
        &self,
        key: &BlockKey,
        value: &[u8],
    ) -> Result<Result<AlignedBuf, BlockError>, RemoteError> {
        let buf = to_block_buf(value, &self.alloc, self.slot)?;
        Ok(self.check(key, buf))
    }

    /// [`land`](Self::land) for every present value, in key order.
    pub(crate) fn land_all<V: AsRef<[u8]>>(
        &self,
        values: Vec<Option<V>>,
        keys: &[BlockKey],
    ) -> Result<Vec<Fetched>, RemoteError> {
        values
            .into_iter()
            .zip(keys)
            .map(|(v, k)| v.map(|v| self.land(k, v.as_ref())).transpose())
            .collect()
    }
}

/// A value read from the pool, copied into a block buffer of `slot` bytes
/// from `alloc` with its length set to the value's (the rest is zeroed by
/// [`Landing::check`]). A value longer than a block comes back empty, so it
/// fails verification.
pub(crate) fn to_block_buf(
    value: &[u8],
    alloc: &Arc<dyn HostAllocator>,
    slot: usize,
) -> Result<AlignedBuf, RemoteError> {
    if value.len() > slot {
        return Ok(AlignedBuf::empty());
    }
    let mut buf = AlignedBuf::for_overwrite_in(alloc, slot, DIRECT_IO_ALIGN)
        .map_err(|e| RemoteError::Backend(format!("no memory for a G4 block: {e}")))?;
    buf[..value.len()].copy_from_slice(value);
    buf.set_len(value.len());
    Ok(buf)
}
