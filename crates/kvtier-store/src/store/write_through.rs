//! G4 write-through: blocks put into the store are sent to the shared pool
//! by a background thread. Never waits: with the queue full (or the pool
//! failing, when the breaker drops batches at once) blocks are dropped and
//! counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_io::HostAllocator;

use super::store_error::StoreError;
use super::writer_thread::Writer;
use crate::metrics::StoreMetrics;
use crate::remote::{RemoteBlock, RemoteConfig, RemoteTier};
use crate::verify::BlockSpec;

/// G4 and its writer.
pub(super) struct WriteThrough {
    pub(super) tier: Arc<RemoteTier>,
    writer: Writer<RemoteBlock>,
    queued: Arc<AtomicU64>,
    max_queued: u64,
}

impl WriteThrough {
    /// Sets up G4 for blocks of `spec` and starts its writer.
    pub(super) fn open(
        config: &RemoteConfig,
        spec: BlockSpec,
        alloc: Arc<dyn HostAllocator>,
        metrics: &Arc<StoreMetrics>,
    ) -> Result<Self, StoreError> {
        let tier = Arc::new(RemoteTier::open(
            config,
            spec,
            alloc,
            metrics.g4.clone(),
            metrics.remote.clone(),
        )?);
        let queued = Arc::new(AtomicU64::new(0));
        let writer = {
            let (tier, queued, metrics) = (tier.clone(), queued.clone(), metrics.clone());
            Writer::spawn("kvtier-g4-write", move |batch: Vec<RemoteBlock>| {
                let n = batch.len() as u64;
                let bytes: u64 = batch.iter().map(|(_, _, len)| *len as u64).sum();
                let written = tier.put_many(batch) as u64;
                metrics.remote.dropped_puts.inc_by(n - written);
                queued.fetch_sub(bytes, Ordering::AcqRel);
                metrics.remote.queue_bytes.dec_by(bytes as i64);
            })?
        };
        tracing::info!("G4 pool {} (write-through, breaker)", tier.shown());
        Ok(Self {
            tier,
            writer,
            queued,
            max_queued: config.write_queue_bytes,
        })
    }

    /// Queues the leading blocks of `batch` that fit in the queue; drops
    /// and counts the rest.
    ///
    /// The head of a batch is kept rather than the whole batch refused: a
    /// batch is a prompt's blocks in order, a prefix is restored only up to
    /// its first missing block, and prompts offloaded together can be
    /// larger than the whole queue (five 4,096-token prompts of the
    /// `small` preset are 320 MiB; the default queue holds 256 MiB).
    pub(super) fn queue(&self, mut batch: Vec<RemoteBlock>, metrics: &StoreMetrics) {
        // With the breaker open the writer drops batches at once (and lets
        // one through as a probe when due), so the queue stays short.
        let room = self
            .max_queued
            .saturating_sub(self.queued.load(Ordering::Acquire));
        let (mut fits, mut bytes) = (0, 0u64);
        for (_, _, len) in &batch {
            if bytes + *len as u64 > room {
                break;
            }
            bytes += *len as u64;
            fits += 1;
        }
        let dropped = batch.len() - fits;
        if dropped > 0 {
            metrics.remote.dropped_puts.inc_by(dropped as u64);
            batch.truncate(fits);
        }
        if batch.is_empty() {
            return;
        }
        let n = batch.len() as u64;
        self.queued.fetch_add(bytes, Ordering::AcqRel);
        metrics.remote.queue_bytes.inc_by(bytes as i64);
        if !self.writer.send(batch) {
            self.queued.fetch_sub(bytes, Ordering::AcqRel);
            metrics.remote.queue_bytes.dec_by(bytes as i64);
            metrics.remote.dropped_puts.inc_by(n);
        }
    }

    /// Waits until every block queued so far was written (or dropped).
    pub(super) fn flush(&self) {
        self.writer.flush();
    }

    /// Lets the queued writes finish and stops the writer.
    pub(super) fn stop(&self) {
        self.writer.stop();
    }
}
