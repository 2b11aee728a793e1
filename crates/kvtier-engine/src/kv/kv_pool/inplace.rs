//! The in-place operations on the pool's CPU memory: committing it,
//! decoding a stored page into it, writing and copying rows.

use candle_core::{CpuStorage, InplaceOp1, Layout};

use kvtier_store::KvLayout;

/// Writes every page of a CPU tensor's memory once (with zeros), so the
/// pool is resident from the start.
///
/// A zeroed allocation is only reserved: each 4 KiB page faults in on its first
/// write. Left lazy, those faults land on the scheduler thread when a restored
/// prefix is first copied into fresh pages, and on a VM where first touch is
/// slow they took most of the attach's time. Committing the pool up front (as
/// llama.cpp clears its KV buffer at start) costs the same faults once, at
/// load, and fails early when the memory is not there.
pub(super) struct Commit;

impl InplaceOp1 for Commit {
    fn name(&self) -> &'static str {
        "kvtier-commit-pool"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        match storage {
            CpuStorage::F32(all) => all.fill(0.0),
            _ => return Err(candle_core::Error::Msg("KV pool is not f32".into())),
        }
        Ok(())
    }
}

/// Decodes one head of one part of a stored page (`elems` f32 from
/// logical payload byte `from` of `stored`) into a CPU tensor's memory at
/// element `offset` (of its contiguous storage), in place: the one copy of
/// a page import, which is also its decode.
pub(super) struct WritePage<'a> {
    pub(super) offset: usize,
    pub(super) elems: usize,
    pub(super) layout: &'a KvLayout,
    pub(super) stored: &'a [u8],
    pub(super) from: u64,
}

impl InplaceOp1 for WritePage<'_> {
    fn name(&self) -> &'static str {
        "kvtier-write-page"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (all, range) = crate::compute::gemv::f32_in_place(storage, layout, "KV pool")?;
        let start = range.start;
        let from = start + self.offset;
        let dst = all
            .get_mut(from..from + self.elems)
            .ok_or_else(|| candle_core::Error::Msg("page outside the pool".into()))?;
        self.layout
            .decode_into(self.stored, self.from, bytemuck::cast_slice_mut(dst))
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// Writes `data` (`at.len()` rows of `width` values) into a CPU tensor's
/// memory, row `i` at element `at[i]` (of its contiguous storage).
pub(super) struct WriteRows<'a> {
    pub(super) at: &'a [usize],
    pub(super) width: usize,
    pub(super) data: &'a [f32],
}

impl InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "kvtier-write-rows"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (all, range) = crate::compute::gemv::f32_in_place(storage, layout, "KV pool")?;
        let start = range.start;
        for (&at, row) in self.at.iter().zip(self.data.chunks_exact(self.width)) {
            let from = start + at;
            all.get_mut(from..from + self.width)
                .ok_or_else(|| candle_core::Error::Msg("row outside the pool".into()))?
                .copy_from_slice(row);
        }
        Ok(())
    }
}

/// Copies `len` elements of a CPU tensor's memory from element `from` to
/// element `to` (of its contiguous storage), in place.
pub(super) struct CopyRows {
    pub(super) from: usize,
    pub(super) to: usize,
    pub(super) len: usize,
}

impl InplaceOp1 for CopyRows {
    fn name(&self) -> &'static str {
        "kvtier-copy-rows"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (all, range) = crate::compute::gemv::f32_in_place(storage, layout, "KV pool")?;
        let start = range.start;
        let (from, to) = (start + self.from, start + self.to);
        if from.max(to) + self.len > all.len() {
            return Err(candle_core::Error::Msg("rows outside the pool".into()));
        }
        all.copy_within(from..from + self.len, to);
        Ok(())
    }
}
