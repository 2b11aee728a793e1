//! G3 write-back: blocks G2 evicts that G3 lacks are queued ([`Pending`])
//! and written by a background thread, never on a reader's path; a flush
//! writes every block G3 lacks and syncs the segments.

use std::sync::Arc;
use std::time::Duration;

use kvtier_io::AlignedBuf;

use super::g3_sync::G3Sync;
use super::pending::Pending;
use super::store_error::StoreError;
use super::writer_thread::{WRITE_BATCH, Writer};
use crate::disk::{DiskError, DiskTier, PutOutcome};
use crate::key::BlockKey;
use crate::memory::{MemoryTier, Owner};
use crate::metrics::StoreMetrics;

/// A block to write back: its key and encoded bytes.
pub(super) type LocalBlock = (BlockKey, Arc<AlignedBuf>);

/// G3, its writer, and the bounded write-back of G2 ([`G3Sync`]).
pub(super) struct WriteBack {
    /// First, so it is stopped (and lets go of the writer) before the rest
    /// is dropped.
    sync: Option<G3Sync>,
    pub(super) disk: Arc<DiskTier>,
    pub(super) pending: Arc<Pending>,
    writer: Arc<Writer<LocalBlock>>,
}

impl WriteBack {
    /// Starts the writer for `disk`; at most about `max_bytes` wait in the
    /// queue. With `sync`, `owner`'s blocks that live only in G2 are
    /// written to G3 within about that long ([`G3Sync`]).
    pub(super) fn open(
        disk: Arc<DiskTier>,
        memory: Arc<MemoryTier>,
        owner: Owner,
        max_bytes: u64,
        sync: Option<Duration>,
        metrics: Arc<StoreMetrics>,
    ) -> Result<Self, StoreError> {
        let pending = Arc::new(Pending::new(max_bytes));
        let writer = {
            let (disk, pending, memory) = (disk.clone(), pending.clone(), memory.clone());
            Arc::new(Writer::spawn("kvtier-writeback", move |batch| {
                write_back(&disk, &memory, &pending, &metrics, batch);
            })?)
        };
        let sync = match sync {
            Some(every) if !every.is_zero() => {
                Some(G3Sync::spawn(every, memory, owner, writer.clone())?)
            }
            _ => None,
        };
        Ok(Self {
            sync,
            disk,
            pending,
            writer,
        })
    }

    /// Queues `batch` for G3. With `drop_over`, blocks past the queue's
    /// bound are dropped (counted) instead of queued.
    pub(super) fn demote(&self, batch: Vec<LocalBlock>, drop_over: bool, metrics: &StoreMetrics) {
        let added = self.pending.add(batch, drop_over, metrics);
        if added.is_empty() {
            return;
        }
        if !self.writer.send(added.clone()) {
            // Closed: nothing will write these; do not leave them queued.
            tracing::warn!(
                "store closed; {} evicted blocks not written to G3",
                added.len()
            );
            self.pending.done(&added, metrics);
        }
    }

    /// Writes `dirty` (blocks G3 lacks) and everything queued, then syncs.
    pub(super) fn flush(&self, dirty: Vec<LocalBlock>) -> Result<(), StoreError> {
        if !dirty.is_empty() {
            self.writer.send(dirty);
        }
        if !self.writer.flush() {
            return Err(StoreError::Task(
                "the write-back thread is gone before the flush".into(),
            ));
        }
        self.disk
            .sync()
            .map_err(|e| StoreError::Disk(DiskError::Io(e)))
    }

    /// Stops the sync thread, lets the queued writes finish and stops the
    /// writer.
    pub(super) fn stop(&self) {
        if let Some(s) = &self.sync {
            s.stop();
        }
        self.writer.stop();
    }

    /// True once [`stop`](Self::stop) ran.
    pub(super) fn is_stopped(&self) -> bool {
        self.writer.is_stopped()
    }
}

fn write_back(
    disk: &DiskTier,
    memory: &MemoryTier,
    pending: &Pending,
    metrics: &StoreMetrics,
    batch: Vec<LocalBlock>,
) {
    for chunk in batch.chunks(WRITE_BATCH) {
        for ((key, _), r) in chunk.iter().zip(disk.put_many(chunk)) {
            match r {
                Ok(PutOutcome::Written) | Ok(PutOutcome::Present) => memory.mark_persisted(key),
                Err(e) => tracing::warn!("write-back of {key} to G3 failed: {e}"),
            }
        }
        pending.done(chunk, metrics);
    }
}
