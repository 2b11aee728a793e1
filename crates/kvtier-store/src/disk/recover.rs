//! G3's index rebuilt at open: every slot's header is read (4 KiB each, many
//! in flight) and a slot whose header decodes, has this tier's slot size and
//! a key not seen yet is indexed; every other slot is free. Whole blocks are
//! verified when read, not here.

use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, IoOp};

use super::{DiskError, DiskTier};
use crate::block::{BlockHeader, HEADER_BYTES};

/// Headers read per batch.
const CHUNK: u32 = 1024;

impl DiskTier {
    /// Reads every slot header and rebuilds the index.
    pub(super) fn rebuild_index(&self) -> Result<(), DiskError> {
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
                let indexed = header.is_some_and(|h| {
                    h.encoded_len() == self.slot_bytes && slots.recover(slot, h.key)
                });
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
