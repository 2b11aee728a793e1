//! G3 writes: a batch of encoded blocks written to reserved slots with many
//! writes in flight; wipes of slots whose blocks must not come back after a
//! restart; removal; sync.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, IoOp};

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
            let mut slots = self.slots.lock();
            for (&(i, slot), d) in planned.iter().zip(done) {
                let key = blocks[i].0;
                match d.result {
                    Ok(_) => {
                        slots.written(slot, key);
                        self.metrics.written_bytes.inc_by(self.slot_bytes as u64);
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
            drop(slots);
            if !failed.is_empty() {
                self.wipe(&failed);
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
    }

    /// Drops `key` from the index (its slot becomes free once unpinned).
    pub fn remove(&self, key: &BlockKey) -> bool {
        let mut slots = self.slots.lock();
        let removed = slots.remove(key);
        self.set_occupancy(&slots);
        removed
    }

    /// Makes every completed write durable (`fdatasync` on each segment).
    pub fn sync(&self) -> io::Result<()> {
        for files in &self.segments {
            for f in files {
                f.sync_data()?;
            }
        }
        Ok(())
    }
}
