//! G3 writes: a batch of encoded blocks written to reserved slots with many
//! writes in flight; wipes of slots whose blocks must not come back after a
//! restart; removal; sync.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, IoOp};

use super::saved_index::Change;
use super::slots::Reserve;
use super::{DiskError, DiskTier, PutOutcome};
use crate::key::BlockKey;

impl DiskTier {
    /// Writes encoded blocks (each exactly one slot long), all in flight at
    /// once up to the configured depth. Blocks already stored are skipped.
    /// A failed write frees its slot and damages nothing already stored.
    pub fn put_many(
        &self,
        blocks: &[(BlockKey, Arc<AlignedBuf>)],
    ) -> Vec<Result<PutOutcome, DiskError>> {
        let mut results: Vec<Option<Result<PutOutcome, DiskError>>> =
            (0..blocks.len()).map(|_| None).collect();
        let mut planned: Vec<(usize, u32)> = Vec::new();
        {
            let mut slots = self.slots.lock();
            for (i, (key, buf)) in blocks.iter().enumerate() {
                if buf.len() != self.slot_bytes {
                    results[i] = Some(Err(DiskError::WrongSize {
                        got: buf.len(),
                        slot: self.slot_bytes,
                    }));
                    continue;
                }
                match slots.reserve(*key) {
                    Reserve::Slot { slot, evicted } => {
                        if evicted {
                            self.metrics.evictions.inc();
                        }
                        planned.push((i, slot));
                    }
                    Reserve::Present => results[i] = Some(Ok(PutOutcome::Present)),
                    Reserve::Full => results[i] = Some(Err(DiskError::Full)),
                }
            }
        }
        if !planned.is_empty() {
            // Taken before written: after a crash mid-write the slot is
            // free, not indexed under what it held.
            let taken: Vec<Change> = planned.iter().map(|&(_, s)| Change::Take(s)).collect();
            self.journal(&taken);
            let ops = planned
                .iter()
                .map(|&(i, slot)| {
                    let (file, off) = self.locate(slot);
                    IoOp::write_shared(file, off, blocks[i].1.clone())
                })
                .collect();
            let t = Instant::now();
            let done = self.engine.run_batch(ops, self.in_flight);
            self.metrics
                .write_seconds
                .observe(t.elapsed().as_secs_f64());
            let mut failed = Vec::new();
            let mut put = Vec::new();
            let mut slots = self.slots.lock();
            for (&(i, slot), d) in planned.iter().zip(done) {
                let key = blocks[i].0;
                match d.result {
                    Ok(_) => {
                        slots.written(slot, key);
                        put.push(Change::Put(slot, key));
                        self.metrics.written_bytes.inc_by(self.slot_bytes as u64);
                        self.metrics.written_blocks.inc();
                        results[i] = Some(Ok(PutOutcome::Written));
                    }
                    Err(e) => {
                        slots.write_failed(&key);
                        failed.push(slot);
                        self.metrics.put_errors.inc();
                        results[i] = Some(Err(DiskError::Io(e)));
                    }
                }
            }
            self.set_occupancy(&slots);
            let blocks_now = slots.blocks();
            drop(slots);
            self.journal(&put);
            if !failed.is_empty() {
                self.wipe(&failed);
            }
            if self
                .saved
                .as_ref()
                .is_some_and(|s| s.checkpoint_due(blocks_now))
            {
                self.checkpoint();
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(DiskError::Full)))
            .collect()
    }

    /// Zeroes the header page of reserved slots so deleted (or partly
    /// written) blocks do not come back at the next open, then frees them.
    pub(super) fn wipe(&self, slots: &[u32]) {
        let mut ops = Vec::new();
        for &slot in slots {
            let (file, off) = self.locate(slot);
            match AlignedBuf::zeroed_in(&self.alloc, DIRECT_IO_ALIGN, DIRECT_IO_ALIGN) {
                Ok(buf) => ops.push(IoOp::write(file, off, buf)),
                Err(e) => tracing::warn!("cannot wipe G3 slot {slot}: {e}"),
            }
        }
        for d in self.engine.run_batch(ops, self.in_flight) {
            if let Err(e) = d.result {
                tracing::warn!("wiping a corrupt G3 slot failed: {e}");
            }
        }
        self.slots.lock().wiped(slots);
        let freed: Vec<Change> = slots.iter().map(|&s| Change::Free(s)).collect();
        self.journal(&freed);
    }

    /// Drops `key` from the index and wipes its slot's header once no read
    /// holds it (the wipe is journaled), so the block does not come back at
    /// the next open: for blocks refused after they were read whole.
    pub fn remove(&self, key: &BlockKey) -> bool {
        let mut wipe = Vec::new();
        let mut slots = self.slots.lock();
        let removed = slots.remove(key, &mut wipe);
        self.set_occupancy(&slots);
        drop(slots);
        if !wipe.is_empty() {
            self.wipe(&wipe);
        }
        removed
    }

    /// Makes every completed write durable (`fdatasync` on each segment),
    /// then writes a checkpoint of the index (synced), so the next open
    /// reads it instead of the slots.
    pub fn sync(&self) -> io::Result<()> {
        for files in &self.segments {
            for f in files {
                f.sync_data()?;
            }
        }
        self.checkpoint();
        Ok(())
    }
}
