//! G3 reads: a batch of keys read with many reads in flight, each block
//! verified ([`BlockSpec::verify`](crate::verify::BlockSpec::verify)) as its
//! read completes while the others are still in flight. A block that fails
//! is a miss, dropped from the index and its header wiped; a read error is
//! a miss that leaves the block indexed.

use std::io;
use std::time::Instant;

use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, IoDone, IoOp};

use super::{DiskRead, DiskTier, ReadOutcome, failed, refused};

/// One pinned read: the request's index, its key and its slot.
pub(super) type ReadPlan = (usize, BlockKey, u32);
use crate::block::BlockError;
use crate::key::BlockKey;

impl DiskTier {
    /// Reads `reqs` (key, buffer of at least one slot) with all reads in
    /// flight at once up to the configured depth, verifies each block, and
    /// hands every buffer back. Blocks being read are pinned: they cannot be
    /// evicted or overwritten until their read completes. The buffers'
    /// contents do not matter: a read overwrites the whole slot, and a short
    /// read fails verification.
    pub fn read_many(&self, reqs: Vec<(BlockKey, AlignedBuf)>) -> Vec<DiskRead> {
        self.read_many_with(reqs, self.in_flight)
    }

    /// [`read_many`](Self::read_many) with an explicit in-flight depth.
    pub fn read_many_with(
        &self,
        reqs: Vec<(BlockKey, AlignedBuf)>,
        in_flight: usize,
    ) -> Vec<DiskRead> {
        let (mut out, plan, bufs) = self.pin_reads(reqs);
        if plan.is_empty() {
            return out.into_iter().flatten().collect();
        }
        let ops = plan
            .iter()
            .zip(bufs)
            .map(|(&(_, _, slot), buf)| {
                let (file, off) = self.locate(slot);
                IoOp::read(file, off, buf)
            })
            .collect();
        // Each block is verified as its read completes, while the rest are
        // still in flight, so checksums overlap I/O.
        let verify = |j: usize, d: &IoDone| -> Option<Result<(), BlockError>> {
            let key = plan.get(j).map(|p| p.1)?;
            d.result.as_ref().ok()?;
            Some(self.spec.verify(&d.buf, &key).map(|_| ()))
        };
        let t = Instant::now();
        let done = self.engine.run_batch_map(ops, in_flight, verify);
        self.metrics.read_seconds.observe(t.elapsed().as_secs_f64());
        let mut settled = Vec::with_capacity(plan.len());
        let mut bufs = Vec::with_capacity(plan.len());
        for (d, verified) in done {
            settled.push(match (d.result, verified) {
                (Err(e), _) => failed(&e),
                (Ok(_), Some(Ok(()))) => ReadOutcome::Hit(()),
                (Ok(_), Some(Err(e))) => refused(e),
                (Ok(_), None) => failed(&io::Error::other("read not verified")),
            });
            bufs.push(d.buf.into_owned());
        }
        self.settle_reads(&plan, settled, |_| self.slot_bytes, bufs, &mut out);
        out.into_iter().flatten().collect()
    }

    /// Pins the slot of each request's key (a miss, or a buffer smaller
    /// than a slot, is settled at once in the first result); the rest come
    /// back as a plan (request index, key, slot) with their buffers, each
    /// set to a slot's length.
    pub(super) fn pin_reads(
        &self,
        reqs: Vec<(BlockKey, AlignedBuf)>,
    ) -> (Vec<Option<DiskRead>>, Vec<ReadPlan>, Vec<AlignedBuf>) {
        let mut out: Vec<Option<DiskRead>> = (0..reqs.len()).map(|_| None).collect();
        let mut plan = Vec::new();
        let mut bufs = Vec::new();
        let mut slots = self.slots.lock();
        for (i, (key, mut buf)) in reqs.into_iter().enumerate() {
            let outcome = if buf.capacity() < self.slot_bytes && slots.slot_of(&key).is_some() {
                failed(&io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "read buffer smaller than a G3 slot",
                ))
            } else if let Some(slot) = slots.pin(&key) {
                buf.set_len(self.slot_bytes);
                plan.push((i, key, slot));
                bufs.push(buf);
                continue;
            } else {
                self.metrics.misses.inc();
                ReadOutcome::Miss
            };
            out[i] = Some(DiskRead { key, buf, outcome });
        }
        (out, plan, bufs)
    }

    /// Unpins the slots of `plan` after their reads found `outcomes`
    /// (a corrupt block is dropped from the index and its header wiped),
    /// counts them (`read(j)` bytes for the hit of `plan[j]`), and puts
    /// each buffer the engine handed back into `out`.
    pub(super) fn settle_reads(
        &self,
        plan: &[ReadPlan],
        outcomes: Vec<ReadOutcome>,
        read: impl Fn(usize) -> usize,
        bufs: Vec<Option<AlignedBuf>>,
        out: &mut [Option<DiskRead>],
    ) {
        let mut wipe: Vec<u32> = Vec::new();
        let mut slots = self.slots.lock();
        for (j, ((&(i, key, slot), outcome), buf)) in
            plan.iter().zip(outcomes).zip(bufs).enumerate()
        {
            let corrupt = matches!(outcome, ReadOutcome::Corrupt(_));
            if slots.unpin(slot, &key, corrupt, &mut wipe)
                && let ReadOutcome::Corrupt(e) = &outcome
            {
                tracing::warn!(
                    "G3 block {key} failed verification ({}); deleting it",
                    e.reason
                );
                self.metrics.corrupt_blocks.inc();
            }
            match &outcome {
                ReadOutcome::Hit(()) => {
                    self.metrics.hits.inc();
                    self.metrics.read_bytes.inc_by(read(j) as u64);
                }
                ReadOutcome::Corrupt(_) => {
                    self.metrics.misses.inc();
                }
                ReadOutcome::Failed(e) => {
                    tracing::warn!("G3 read of {key} failed: {e}");
                    self.metrics.misses.inc();
                }
                ReadOutcome::Miss => {}
            }
            if let (Some(buf), Some(slot_out)) = (buf, out.get_mut(i)) {
                *slot_out = Some(DiskRead { key, buf, outcome });
            }
        }
        self.set_occupancy(&slots);
        drop(slots);
        if !wipe.is_empty() {
            self.wipe(&wipe);
        }
    }

    /// A read buffer of one slot from the allocation hook (empty when the
    /// allocation fails: its read then fails, and is a miss).
    pub(super) fn slot_buffer(&self) -> AlignedBuf {
        AlignedBuf::for_overwrite_in(&self.alloc, self.slot_bytes, DIRECT_IO_ALIGN).unwrap_or_else(
            |e| {
                tracing::warn!("G3 read buffer allocation failed: {e}");
                AlignedBuf::empty()
            },
        )
    }

    /// Matches the reads of `keys` back up by key (the engine drops only a
    /// result whose buffer it lost), in the order of `keys`.
    pub(super) fn in_key_order(
        keys: &[BlockKey],
        reads: Vec<DiskRead>,
    ) -> Vec<(ReadOutcome, AlignedBuf)> {
        let mut out: Vec<(ReadOutcome, AlignedBuf)> = Vec::with_capacity(keys.len());
        let mut reads = reads.into_iter().peekable();
        for key in keys {
            match reads.next_if(|r| r.key == *key) {
                Some(r) => out.push((r.outcome, r.buf)),
                None => out.push((
                    failed(&io::Error::other("the read's buffer was lost")),
                    AlignedBuf::empty(),
                )),
            }
        }
        out
    }

    /// Reads blocks into buffers from the allocation hook; `None` for a miss
    /// (including a corrupt block, which is deleted).
    pub fn get_many(&self, keys: &[BlockKey]) -> Vec<Option<AlignedBuf>> {
        self.read_outcomes(keys)
            .into_iter()
            .map(|(outcome, buf)| matches!(outcome, ReadOutcome::Hit(())).then_some(buf))
            .collect()
    }

    /// Reads blocks into buffers from the allocation hook, with what each
    /// read found, in the order of `keys`.
    pub fn read_outcomes(&self, keys: &[BlockKey]) -> Vec<(ReadOutcome, AlignedBuf)> {
        let reqs = keys.iter().map(|key| (*key, self.slot_buffer())).collect();
        Self::in_key_order(keys, self.read_many(reqs))
    }
}
