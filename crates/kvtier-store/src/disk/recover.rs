//! G3's index rebuilt at open: from the saved index when it is whole
//! ([`super::saved_index`]), else by reading every slot's header (4 KiB
//! each, many in flight): a slot whose header decodes, has this tier's slot
//! size and a key not seen yet is indexed; every other slot is free. Whole
//! blocks are verified when read, not here. Either way a fresh checkpoint
//! is written.

use std::path::PathBuf;

use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, IoOp};

use super::saved_index::{self, SavedIndex, Shape};
use super::{DiskError, DiskTier};
use crate::block::{BlockHeader, HEADER_BYTES};

/// Headers read per batch.
const CHUNK: u32 = 1024;

impl DiskTier {
    /// Rebuilds the index (saved, else scanned, always scanned when a
    /// segment had to be extended: `resized`), then saves it afresh.
    pub(super) fn recover_index(&mut self, resized: Option<PathBuf>) -> Result<(), DiskError> {
        let shape = Shape::new(
            self.slots.lock().len() as u32,
            self.slot_bytes as u64,
            self.slots_per_segment,
            &self.dirs,
        );
        let dir = self.dirs[0].clone();
        let loaded = match resized {
            Some(p) => Err(saved_index::Unusable::Resized(p)),
            None => saved_index::load(&dir, shape),
        };
        let epoch = match loaded {
            Ok(l) => {
                let mut slots = self.slots.lock();
                slots.load(&l.entries);
                self.set_occupancy(&slots);
                self.recovery = Recovery::Saved {
                    blocks: l.entries.len(),
                    replayed: l.replayed,
                };
                l.epoch
            }
            Err(why) => {
                if dir.join(saved_index::INDEX_FILE).exists() {
                    tracing::warn!("G3 saved index not used ({why}); scanning every slot");
                }
                self.rebuild_index()?;
                self.recovery = Recovery::Scanned {
                    why: why.to_string(),
                };
                0
            }
        };
        let entries = self.slots.lock().entries();
        self.saved = Some(SavedIndex::start(&dir, shape, epoch + 1, &entries));
        Ok(())
    }

    /// Reads every slot header and rebuilds the index.
    fn rebuild_index(&self) -> Result<(), DiskError> {
        let mut slots = self.slots.lock();
        let total = slots.len() as u32;
        let mut pool: Vec<AlignedBuf> = Vec::new();
        let mut start = 0u32;
        while start < total {
            let end = (start + CHUNK).min(total);
            let mut ops = Vec::with_capacity((end - start) as usize);
            for slot in start..end {
                let buf = match pool.pop() {
                    Some(mut b) => {
                        b.set_len(DIRECT_IO_ALIGN);
                        b
                    }
                    None => {
                        AlignedBuf::for_overwrite_in(&self.alloc, DIRECT_IO_ALIGN, DIRECT_IO_ALIGN)
                            .map_err(|e| DiskError::Alloc(e.to_string()))?
                    }
                };
                let (file, off) = self.locate(slot);
                ops.push(IoOp::read(file, off, buf));
            }
            for (i, done) in self
                .engine
                .run_batch(ops, self.in_flight)
                .into_iter()
                .enumerate()
            {
                let slot = start + i as u32;
                let header = match &done.result {
                    Ok(n) if *n >= HEADER_BYTES => {
                        BlockHeader::decode(&done.buf[..HEADER_BYTES]).ok()
                    }
                    _ => None,
                };
                let indexed = header
                    .is_some_and(|h| self.spec.takes(&h.layout) && slots.recover(slot, h.key));
                if !indexed {
                    slots.recover_free(slot);
                }
                if let Some(b) = done.buf.into_owned() {
                    pool.push(b);
                }
            }
            start = end;
        }
        slots.recovered();
        self.set_occupancy(&slots);
        Ok(())
    }
}

/// How the index was rebuilt at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// From the checkpoint and its journal.
    Saved {
        /// Blocks indexed.
        blocks: usize,
        /// Journal records replayed.
        replayed: u64,
    },
    /// By reading every slot header.
    Scanned {
        /// Why the saved index was not used.
        why: String,
    },
}
