//! G1: the paged KV pool.
//!
//! Fixed pages of `block_tokens` tokens. Per layer, K and V each live in one
//! tensor of shape `(kv_heads * pages * block_tokens, head_dim)`, head-major:
//! head `h`, page `p` is the contiguous run of rows starting at
//! `(h * pages + p) * block_tokens`. So the pages of a run of consecutive
//! page ids are, for every head, one contiguous stretch of rows, and
//! attention reads them as one strided view ([`KvPool::context`]) with no
//! copy. A page's bytes, layer by layer, K then V, head by head, are exactly
//! a store block's payload (`[layer][k|v][kv_head][token][head_dim]`,
//! little-endian f32), so restoring a block is one copy per head and part,
//! not a conversion.
//!
//! Pages are reference counted: a full page may be shared by several
//! sequences with the same prefix (it is never written again once full).

use std::collections::BTreeSet;

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor};

use kvtier_store::{Arrangement, KvCodec, KvDtype, KvLayout};

use crate::engine_error::EngineError;

#[cfg(target_endian = "big")]
compile_error!("kvtier's KV payload is little-endian f32; big-endian hosts are not supported");

/// Index of a page in the pool.
pub type PageId = u32;

/// The G1 page pool.
#[derive(Debug)]
pub struct KvPool {
    /// The K/V memory and its shape.
    mem: PageWriter,
    free: BTreeSet<PageId>,
    refs: Vec<u32>,
}

impl KvPool {
    /// A pool of `pages` pages for `layers` layers. On the CPU its memory is
    /// committed here (written once; see `Commit`), not on first use.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        block_tokens: usize,
        pages: usize,
        device: &Device,
    ) -> Result<Self, EngineError> {
        let rows = pages * kv_heads * block_tokens;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            for part in [&mut k, &mut v] {
                let t = Tensor::zeros((rows, head_dim), DType::F32, device)?;
                if device.is_cpu() {
                    t.inplace_op1(&Commit)?;
                }
                part.push(t);
            }
        }
        Ok(Self {
            mem: PageWriter {
                k,
                v,
                pages,
                kv_heads,
                block_tokens,
                head_dim,
                device: device.clone(),
            },
            free: (0..pages as PageId).collect(),
            refs: vec![0; pages],
        })
    }

    /// Tokens per page.
    pub fn block_tokens(&self) -> usize {
        self.mem.block_tokens
    }

    /// Pages in all.
    pub fn pages(&self) -> usize {
        self.mem.pages
    }

    /// Pages free now.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Bytes of one page (= one store block payload).
    pub fn page_bytes(&self) -> usize {
        2 * self.mem.k.len() * self.mem.kv_heads * self.mem.block_tokens * self.mem.head_dim * 4
    }

    /// Takes a free page (reference count 1): `after + 1` when that one is
    /// free, else the lowest free page. A sequence that passes its last page
    /// so gets consecutive pages wherever the pool allows, and attention
    /// reads consecutive pages as one view instead of copying them together
    /// ([`KvPool::context`]).
    pub fn alloc(&mut self, after: Option<PageId>) -> Option<PageId> {
        let next = after.and_then(|p| p.checked_add(1));
        let p = match next {
            Some(n) if self.free.remove(&n) => n,
            _ => self.free.pop_first()?,
        };
        self.refs[p as usize] = 1;
        Some(p)
    }

    /// Adds a reference to a page.
    pub fn retain(&mut self, page: PageId) {
        self.refs[page as usize] += 1;
    }

    /// Drops a reference; returns true when the page became unreferenced.
    /// An unreferenced page is not freed here: the owner of the prefix cache
    /// decides (it may keep it for reuse) and calls [`KvPool::free`].
    pub fn release(&mut self, page: PageId) -> bool {
        let r = &mut self.refs[page as usize];
        *r = r.saturating_sub(1);
        *r == 0
    }

    /// References held on a page.
    pub fn refs(&self, page: PageId) -> u32 {
        self.refs[page as usize]
    }

    /// Returns an unreferenced page to the free list.
    pub fn free(&mut self, page: PageId) {
        if self.refs[page as usize] == 0 {
            self.free.insert(page);
        }
    }

    fn row(&self, page: PageId, head: usize, offset: usize) -> usize {
        self.mem.row(page, head, offset)
    }

    /// Writes K and V of `t` tokens (each `(kv_heads, t, head_dim)`) for
    /// absolute positions `start..start + t` of a sequence whose pages are
    /// `table` (page `i` holds positions `i * block_tokens ..`).
    pub fn write(
        &self,
        layer: usize,
        table: &[PageId],
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), EngineError> {
        let (_, t, _) = k.dims3()?;
        let bt = self.mem.block_tokens;
        let mut done = 0;
        while done < t {
            let pos = start + done;
            let idx = pos / bt;
            let off = pos % bt;
            let len = (bt - off).min(t - done);
            let page = *table.get(idx).ok_or_else(|| {
                EngineError::PoolExhausted(format!(
                    "no page for position {pos} (table has {})",
                    table.len()
                ))
            })?;
            for h in 0..self.mem.kv_heads {
                let ks = k.get(h)?.narrow(0, done, len)?.contiguous()?;
                let vs = v.get(h)?.narrow(0, done, len)?.contiguous()?;
                let row = self.row(page, h, off);
                self.mem.k[layer].slice_set(&ks, 0, row)?;
                self.mem.v[layer].slice_set(&vs, 0, row)?;
            }
            done += len;
        }
        Ok(())
    }

    /// The K (or, `v`, V) of a sequence's `pages` at one layer, as one
    /// tensor `(kv_heads, pages * block_tokens, head_dim)`: head `h` holds the
    /// tokens of every page in order. A run of consecutive page ids is a
    /// strided view of the pool (no copy; a sequence's pages are mostly
    /// allocated in order); several runs are joined with one copy. Either
    /// way one matmul reads the whole context, where a matmul per page cost
    /// more in per-operation overhead than in arithmetic (a 4,097-token
    /// context, 17 pages, took about 45 ms per decode step on the
    /// reference VM).
    pub fn context(&self, layer: usize, pages: &[PageId], v: bool) -> candle_core::Result<Tensor> {
        let t = if v {
            &self.mem.v[layer]
        } else {
            &self.mem.k[layer]
        };
        let bt = self.mem.block_tokens;
        let all = t.reshape((self.mem.kv_heads, self.mem.pages * bt, self.mem.head_dim))?;
        let mut runs = Vec::new();
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + 1 {
                j += 1;
            }
            runs.push(all.narrow(1, pages[i] as usize * bt, (j - i) * bt)?);
            i = j;
        }
        match runs.len() {
            1 => Ok(runs.remove(0)),
            _ => Tensor::cat(&runs, 1),
        }
    }

    /// K of one page at one layer, `(kv_heads, block_tokens, head_dim)` (a view).
    pub fn page_k(&self, layer: usize, page: PageId) -> candle_core::Result<Tensor> {
        self.context(layer, &[page], false)
    }

    /// V of one page at one layer, `(kv_heads, block_tokens, head_dim)` (a view).
    pub fn page_v(&self, layer: usize, page: PageId) -> candle_core::Result<Tensor> {
        self.context(layer, &[page], true)
    }

    /// The store layout of one page: layer-major (`[layer][K|V][kv_head]
    /// [token][head_dim]`, f32), payload stored by `codec`.
    pub fn store_layout(&self, codec: KvCodec) -> KvLayout {
        KvLayout {
            layers: self.mem.k.len() as u32,
            kv_heads: self.mem.kv_heads as u32,
            head_dim: self.mem.head_dim as u32,
            block_tokens: self.mem.block_tokens as u32,
            dtype: KvDtype::F32,
            codec,
            arrangement: Arrangement::LayerMajor,
            shard: None,
        }
    }

    /// Codes a page into `out`, a store block's stored payload of `layout`
    /// (one of [`KvPool::store_layout`]'s, or a short block of one: then
    /// the page's first `layout.block_tokens` rows), written in full.
    ///
    /// On the CPU each head of each layer's K and V is coded straight out
    /// of the pool's memory (without a codec, one copy); other devices copy
    /// each part to the host first.
    pub fn export_into(
        &self,
        page: PageId,
        layout: &KvLayout,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        let run = self.check_payload(layout, out.len())?;
        let rows = layout.block_tokens as usize;
        let head_part = rows * self.mem.head_dim;
        let mut at = 0u64;
        for layer in 0..self.mem.k.len() {
            for (is_v, t) in [(false, &self.mem.k[layer]), (true, &self.mem.v[layer])] {
                let (storage, tl) = t.storage_and_layout();
                match (&*storage, tl.contiguous_offsets()) {
                    (Storage::Cpu(CpuStorage::F32(all)), Some((start, _)))
                        if crate::compute::device::host_paths(&self.mem.device) =>
                    {
                        for h in 0..self.mem.kv_heads {
                            let from = start + self.row(page, h, 0) * self.mem.head_dim;
                            let src = all.get(from..from + head_part).ok_or_else(|| {
                                EngineError::Request("page outside the pool".into())
                            })?;
                            layout.encode_into(at, bytemuck::cast_slice(src), out)?;
                            at += run;
                        }
                    }
                    _ => {
                        drop(storage);
                        let vals: Vec<f32> = self
                            .context(layer, &[page], is_v)?
                            .narrow(1, 0, rows)?
                            .flatten_all()?
                            .to_vec1()?;
                        layout.encode_into(at, bytemuck::cast_slice(&vals), out)?;
                        at += run * self.mem.kv_heads as u64;
                    }
                }
            }
        }
        Ok(())
    }

    /// A page's bytes in store-payload order (uncoded), in a new buffer.
    pub fn export(&self, page: PageId) -> Result<Vec<u8>, EngineError> {
        let mut out = vec![0u8; self.page_bytes()];
        self.export_into(page, &self.store_layout(KvCodec::None), &mut out)?;
        Ok(out)
    }

    /// Fills a page from a store block's stored payload of `layout` (a
    /// short block fills the page's first `layout.block_tokens` rows).
    ///
    /// On the CPU each head of each layer's K and V is decoded straight
    /// into the pool's memory (without a codec, one copy); other devices go
    /// through a host tensor.
    pub fn import(
        &self,
        page: PageId,
        layout: &KvLayout,
        payload: &[u8],
    ) -> Result<(), EngineError> {
        self.check_payload(layout, payload.len())?;
        self.page_writer().import_layers(
            page,
            layout,
            0..layout.layers,
            payload,
            layout.block_tokens as usize,
        )
    }

    /// The pool's memory without its page bookkeeping: what a store thread
    /// needs to decode restored layers into pages while the engine computes
    /// ([`crate::kv::layer_restore`]).
    pub(crate) fn page_writer(&self) -> PageWriter {
        self.mem.clone()
    }

    /// Element offset of token row `offset` of `page` for KV head `head` in
    /// a layer's K (or V) memory.
    pub(crate) fn row_elem(&self, page: PageId, head: usize, offset: usize) -> usize {
        self.row(page, head, offset) * self.mem.head_dim
    }

    /// Runs `f` over the K and V memory of `layer` (on the CPU; `None`
    /// elsewhere), as laid out in the module docs.
    pub(crate) fn with_layer<R>(
        &self,
        layer: usize,
        f: impl FnOnce(&[f32], &[f32]) -> R,
    ) -> Option<R> {
        let (kg, kl) = self.mem.k.get(layer)?.storage_and_layout();
        let (vg, vl) = self.mem.v.get(layer)?.storage_and_layout();
        match (&*kg, &*vg) {
            (Storage::Cpu(CpuStorage::F32(k)), Storage::Cpu(CpuStorage::F32(v))) => {
                Some(f(&k[kl.start_offset()..], &v[vl.start_offset()..]))
            }
            _ => None,
        }
    }

    /// Writes one token's K and V (`kv_heads * head_dim` values each, head
    /// by head) at absolute position `pos` of a sequence whose pages are
    /// `table`: the decode step's KV write, on the CPU.
    pub(crate) fn write_token(
        &self,
        layer: usize,
        table: &[PageId],
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError> {
        let bt = self.mem.block_tokens;
        let page = *table.get(pos / bt).ok_or_else(|| {
            EngineError::PoolExhausted(format!(
                "no page for position {pos} (table has {})",
                table.len()
            ))
        })?;
        let want = self.mem.kv_heads * self.mem.head_dim;
        if k.len() != want || v.len() != want || layer >= self.mem.k.len() {
            return Err(EngineError::Request(
                "a token's K/V does not fit the pool".into(),
            ));
        }
        let at: Vec<usize> = (0..self.mem.kv_heads)
            .map(|h| self.row_elem(page, h, pos % bt))
            .collect();
        for (t, data) in [(&self.mem.k[layer], k), (&self.mem.v[layer], v)] {
            t.inplace_op1(&WriteRows {
                at: &at,
                width: self.mem.head_dim,
                data,
            })?;
        }
        Ok(())
    }

    /// Copies the first `rows` token rows of page `src` (every layer, K and
    /// V, every head) into page `dst`: how a prompt takes the tokens it
    /// shares with a cached page without sharing the page (the rest of
    /// `dst` is then written by the prompt's own tokens).
    pub fn copy_rows(&self, src: PageId, dst: PageId, rows: usize) -> Result<(), EngineError> {
        if rows > self.mem.block_tokens
            || src as usize >= self.mem.pages
            || dst as usize >= self.mem.pages
        {
            return Err(EngineError::Request(format!(
                "cannot copy {rows} rows from page {src} to page {dst} of {} pages of {} tokens",
                self.mem.pages, self.mem.block_tokens
            )));
        }
        if rows == 0 || src == dst {
            return Ok(());
        }
        for t in self.mem.k.iter().chain(&self.mem.v) {
            for h in 0..self.mem.kv_heads {
                let (from, to) = (self.row(src, h, 0), self.row(dst, h, 0));
                if crate::compute::device::host_paths(&self.mem.device) {
                    t.inplace_op1(&CopyRows {
                        from: from * self.mem.head_dim,
                        to: to * self.mem.head_dim,
                        len: rows * self.mem.head_dim,
                    })?;
                } else {
                    // A copy of just those rows: a narrowed view shares
                    // `t`'s storage, which slice_set refuses.
                    let part = t.narrow(0, from, rows)?.force_contiguous()?;
                    t.slice_set(&part, 0, to)?;
                }
            }
        }
        Ok(())
    }

    /// Checks that `layout` is this pool's page (any codec) and `len` its
    /// stored payload; returns the logical bytes of one head's run of one
    /// part (`block_tokens * head_dim` f32).
    fn check_payload(&self, layout: &KvLayout, len: usize) -> Result<u64, EngineError> {
        let rows = layout.block_tokens as usize;
        if rows > self.mem.block_tokens
            || layout.with_tokens(self.mem.block_tokens as u32) != self.store_layout(layout.codec)
        {
            return Err(EngineError::Request(format!(
                "KV blocks of {layout} do not fit pages of {}",
                self.store_layout(layout.codec)
            )));
        }
        if len as u64 != layout.stored_payload_bytes() {
            return Err(EngineError::Request(format!(
                "KV block of {len} bytes does not fit pages of {} bytes",
                layout.stored_payload_bytes()
            )));
        }
        Ok((rows * self.mem.head_dim * 4) as u64)
    }
}

/// The pool's K/V memory and its shape: owned by the [`KvPool`], and as a
/// clone (the same tensors, shared) a handle to fill restored pages from
/// another thread ([`KvPool::page_writer`]).
#[derive(Debug, Clone)]
pub(crate) struct PageWriter {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    pages: usize,
    kv_heads: usize,
    block_tokens: usize,
    head_dim: usize,
    device: Device,
}

impl PageWriter {
    /// Row of token `offset` of `page` for KV head `head` in a layer's K
    /// (or V) tensor (see the module docs).
    fn row(&self, page: PageId, head: usize, offset: usize) -> usize {
        (head * self.pages + page as usize) * self.block_tokens + offset
    }

    /// Fills the first `rows` token rows of layers `layers` of `page` from
    /// `stored`, those layers' stored bytes of a block of `layout` (one of
    /// the pool's store layouts, or a short block of one; one layer's bytes
    /// are a one-layer block's payload), each head of each part decoded
    /// straight into the pool's memory on the CPU. `rows` is at most the
    /// block's; the page's rows after them are left as they are.
    pub(crate) fn import_layers(
        &self,
        page: PageId,
        layout: &KvLayout,
        layers: std::ops::Range<u32>,
        stored: &[u8],
        rows: usize,
    ) -> Result<(), EngineError> {
        let one = KvLayout {
            layers: 1,
            ..*layout
        };
        let per = one.stored_payload_bytes() as usize;
        let count = layers.len();
        if layers.end as usize > self.k.len()
            || page as usize >= self.pages
            || per == 0
            || stored.len() != per * count
            || rows > layout.block_tokens as usize
            || layout.block_tokens as usize > self.block_tokens
        {
            return Err(EngineError::Request(format!(
                "{} stored bytes of {rows} rows of layers {layers:?} do not fit page {page} of {} \
                 layers of {} rows",
                stored.len(),
                self.k.len(),
                self.block_tokens
            )));
        }
        if !crate::compute::device::host_paths(&self.device) {
            return self.import_to_device(page, &one, (layers, rows), stored);
        }
        let run = (layout.block_tokens as usize * self.head_dim * 4) as u64;
        for (layer, bytes) in layers.zip(stored.chunks_exact(per)) {
            let layer = layer as usize;
            let mut at = 0u64;
            for t in [&self.k[layer], &self.v[layer]] {
                for h in 0..self.kv_heads {
                    t.inplace_op1(&WritePage {
                        offset: self.row(page, h, 0) * self.head_dim,
                        elems: rows * self.head_dim,
                        layout: &one,
                        stored: bytes,
                        from: at,
                    })?;
                    at += run;
                }
            }
        }
        Ok(())
    }

    /// [`import_layers`](Self::import_layers) where the pool is not in host
    /// memory (a GPU): the first `rows` rows of every part of those layers
    /// are decoded into one host buffer and cross to the device in one
    /// copy; each head's rows are then placed by a copy on the device,
    /// rather than each head crossing on its own (an allocation and a round
    /// trip each). `stored` has been checked to hold `layers` whole, each
    /// `one`'s payload, and `rows` to fit a page.
    fn import_to_device(
        &self,
        page: PageId,
        one: &KvLayout,
        (layers, rows): (std::ops::Range<u32>, usize),
        stored: &[u8],
    ) -> Result<(), EngineError> {
        // Called on the store's threads too (layer-wise restores).
        crate::compute::device::bind_to_thread(&self.device)?;
        let run = one.block_tokens as usize * self.head_dim * 4;
        let used = rows * self.head_dim * 4;
        let per_layer = 2 * self.kv_heads;
        let per = one.stored_payload_bytes() as usize;
        let parts = layers.len() * per_layer;
        if parts * used == 0 {
            return Ok(());
        }
        let mut host = vec![0u8; parts * used];
        for (bytes, out) in stored
            .chunks_exact(per)
            .zip(host.chunks_exact_mut(per_layer * used))
        {
            for (i, part) in out.chunks_exact_mut(used).enumerate() {
                one.decode_into(bytes, (i * run) as u64, part)?;
            }
        }
        let all = Tensor::from_raw_buffer(
            &host,
            DType::F32,
            &[parts * rows, self.head_dim],
            &self.device,
        )?;
        let mut part = 0;
        for layer in layers {
            for t in [&self.k[layer as usize], &self.v[layer as usize]] {
                for h in 0..self.kv_heads {
                    let src = all.narrow(0, part * rows, rows)?;
                    t.slice_set(&src, 0, self.row(page, h, 0))?;
                    part += 1;
                }
            }
        }
        Ok(())
    }
}

/// Writes every page of a CPU tensor's memory once (with zeros), so the
/// pool is resident from the start.
///
/// A zeroed allocation is only reserved: each 4 KiB page faults in on its
/// first write. Left lazy, those faults land on the scheduler thread when a
/// restored prefix is first copied into fresh pages: 16 MiB of attach took
/// 7-8 ms on the reference VM, 1 ms once resident. Committing the pool up
/// front (as llama.cpp clears its KV buffer at start) costs the same faults
/// once, at load, and fails early when the memory is not there.
struct Commit;

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
struct WritePage<'a> {
    offset: usize,
    elems: usize,
    layout: &'a KvLayout,
    stored: &'a [u8],
    from: u64,
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
struct WriteRows<'a> {
    at: &'a [usize],
    width: usize,
    data: &'a [f32],
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
struct CopyRows {
    from: usize,
    to: usize,
    len: usize,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// K of one page of 2 heads x 3 tokens x 4 dims: 0, 1, ..., 23.
    fn ramp() -> Tensor {
        Tensor::arange(0f32, 24., &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap()
    }

    #[test]
    fn a_sequence_gets_the_page_after_its_last_when_free_else_the_lowest() {
        let mut pool = KvPool::new(1, 1, 2, 2, 6, &Device::Cpu).unwrap();
        let a = pool.alloc(None).unwrap();
        let b = pool.alloc(None).unwrap();
        assert_eq!((a, b), (0, 1));
        assert!(pool.release(a));
        pool.free(a);
        // 2 follows 1; 0 is free again but not next to anything asked for.
        assert_eq!(pool.alloc(Some(1)), Some(2));
        assert_eq!(pool.alloc(Some(2)), Some(3));
        // 4 would follow 3 but a new sequence takes the lowest free page.
        assert_eq!(pool.alloc(None), Some(0));
        assert_eq!(pool.alloc(Some(0)), Some(4), "1 is taken: the lowest free");
        assert_eq!(pool.alloc(Some(5)), Some(5));
        assert_eq!(pool.alloc(Some(5)), None, "all six in use");
        assert_eq!(pool.free_pages(), 0);
    }

    #[test]
    fn a_page_exported_into_a_buffer_imports_into_another_page_unchanged() {
        let pool = KvPool::new(2, 2, 4, 3, 4, &Device::Cpu).unwrap();
        let k = ramp();
        let v = (&k * -1.0).unwrap();
        for layer in 0..2 {
            pool.write(layer, &[1], 0, &k, &v).unwrap();
        }
        let plain = pool.store_layout(KvCodec::None);
        let mut block = vec![0xAAu8; pool.page_bytes()];
        pool.export_into(1, &plain, &mut block).unwrap();
        assert_eq!(block, pool.export(1).unwrap());
        let first: Vec<f32> = bytemuck::cast_slice(&block[..96]).to_vec();
        assert_eq!(
            first,
            (0..24).map(|x| x as f32).collect::<Vec<_>>(),
            "layer 0 K first"
        );
        pool.import(3, &plain, &block).unwrap();
        for layer in 0..2 {
            let got = pool.page_k(layer, 3).unwrap().flatten_all().unwrap();
            let want = k.flatten_all().unwrap();
            assert_eq!(
                got.to_vec1::<f32>().unwrap(),
                want.to_vec1::<f32>().unwrap()
            );
            let got = pool.page_v(layer, 3).unwrap().flatten_all().unwrap();
            assert_eq!(
                got.to_vec1::<f32>().unwrap(),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
        assert!(
            pool.import(0, &plain, &block[1..]).is_err(),
            "a short payload"
        );
        let other = KvLayout {
            block_tokens: 4,
            ..plain
        };
        assert!(pool.import(0, &other, &block).is_err(), "another page size");
        // The first two token rows of page 3 into page 0: those rows equal,
        // the third row untouched (zero).
        pool.copy_rows(3, 0, 2).unwrap();
        for layer in 0..2 {
            let got: Vec<f32> = pool
                .page_k(layer, 0)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let src: Vec<f32> = pool
                .page_k(layer, 3)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for h in 0..2 {
                let at = |r: usize| h * 12 + r * 4;
                assert_eq!(
                    got[at(0)..at(2)],
                    src[at(0)..at(2)],
                    "layer {layer} head {h}"
                );
                assert_eq!(got[at(2)..at(3)], [0.0; 4], "row 2 not copied");
            }
        }
        assert!(pool.copy_rows(3, 0, 4).is_err(), "more rows than a page");
        assert!(pool.export_into(0, &plain, &mut block[..8]).is_err());
    }

    #[test]
    fn a_coded_page_comes_back_within_its_codec_bound() {
        let pool = KvPool::new(2, 2, 4, 3, 4, &Device::Cpu).unwrap();
        let k = ramp();
        let k = ((k - 11.5).unwrap() * 0.3).unwrap();
        let v = (&k * -2.0).unwrap();
        for layer in 0..2 {
            pool.write(layer, &[1], 0, &k, &v).unwrap();
        }
        let want = pool.export(1).unwrap();
        let want: &[f32] = bytemuck::cast_slice(&want);
        for codec in [KvCodec::Bf16, KvCodec::Fp8E4m3, KvCodec::Int8] {
            let layout = pool.store_layout(codec);
            let mut stored = vec![0u8; layout.stored_payload_bytes() as usize];
            assert!(
                stored.len() < pool.page_bytes(),
                "{codec} stores fewer bytes"
            );
            pool.export_into(1, &layout, &mut stored).unwrap();
            pool.import(2, &layout, &stored).unwrap();
            let got = pool.export(2).unwrap();
            let got: &[f32] = bytemuck::cast_slice(&got);
            // Each 4-value row's scale is its own largest magnitude.
            for (w, g) in want.chunks(4).zip(got.chunks(4)) {
                let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in w.iter().zip(g) {
                    let bound = match codec {
                        KvCodec::Bf16 => x.abs() / 256.0,
                        KvCodec::Fp8E4m3 => x.abs() / 16.0 + amax / 448.0 / 1024.0,
                        _ => amax / 127.0 / 2.0 * 1.001,
                    };
                    assert!((x - y).abs() <= bound, "{codec}: {x} came back as {y}");
                }
            }
            assert!(
                pool.import(2, &layout, &stored[..stored.len() - 1])
                    .is_err()
            );
        }
    }

    /// A pool of 3 layers, 2 heads, 3-row pages of 4 dims, page 1 written
    /// with a different ramp in each layer.
    fn three_layers_in_page_1() -> KvPool {
        let pool = KvPool::new(3, 2, 4, 3, 4, &Device::Cpu).unwrap();
        let k = ramp();
        for layer in 0..3 {
            let kl = ((&k - 7.0).unwrap() * (0.25 + layer as f64)).unwrap();
            pool.write(layer, &[1], 0, &kl, &(&kl * -0.5).unwrap())
                .unwrap();
        }
        pool
    }

    #[test]
    fn the_device_import_places_every_head_as_the_in_place_one_does() {
        // The path a GPU pool takes (one host buffer, one copy, heads
        // placed by slice_set), run on CPU tensors against the in-place
        // path, with and without a codec, one layer and a run of layers,
        // a whole block and a tail of fewer rows.
        let pool = three_layers_in_page_1();
        let w = pool.page_writer();
        let zeros = pool.export(0).unwrap();
        let plain = pool.store_layout(KvCodec::None);
        for codec in [KvCodec::None, KvCodec::Int8] {
            let layout = pool.store_layout(codec);
            let mut stored = vec![0u8; layout.stored_payload_bytes() as usize];
            pool.export_into(1, &layout, &mut stored).unwrap();
            let per = stored.len() / 3;
            let one = KvLayout {
                layers: 1,
                ..layout
            };
            w.import_layers(2, &layout, 0..3, &stored, 3).unwrap();
            let whole = pool.export(2).unwrap();
            assert_ne!(whole, zeros, "{codec}");
            for rows in [3, 1, 0] {
                for page in [2, 3] {
                    pool.import(page, &plain, &zeros).unwrap();
                }
                w.import_layers(2, &layout, 0..3, &stored, rows).unwrap();
                w.import_to_device(3, &one, (0..1, rows), &stored[..per])
                    .unwrap();
                w.import_to_device(3, &one, (1..3, rows), &stored[per..])
                    .unwrap();
                let got = pool.export(2).unwrap();
                assert_eq!(got, pool.export(3).unwrap(), "{codec}, {rows} rows");
                // Each part (a layer's K or V of one head: 3 rows of 4 f32)
                // holds the whole import's first rows, then what was there.
                for (part, (g, w)) in got.chunks(48).zip(whole.chunks(48)).enumerate() {
                    assert_eq!(g[..rows * 16], w[..rows * 16], "{codec}, part {part}");
                    assert!(
                        g[rows * 16..].iter().all(|&b| b == 0),
                        "{codec}, part {part}"
                    );
                }
            }
            assert!(
                w.import_layers(2, &layout, 0..3, &stored, 4).is_err(),
                "more rows than a page"
            );
        }
    }

    #[test]
    fn a_short_block_holds_a_pages_first_rows_and_fills_only_those() {
        // A prompt's tail is stored as a short block: the page's first
        // rows only, every codec; it comes back into those rows and leaves
        // the rest of the page alone.
        let pool = three_layers_in_page_1();
        let plain = pool.store_layout(KvCodec::None);
        let zeros = pool.export(0).unwrap();
        for codec in [
            KvCodec::None,
            KvCodec::Bf16,
            KvCodec::Fp8E4m3,
            KvCodec::Int8,
        ] {
            let full = pool.store_layout(codec);
            let mut whole = vec![0u8; full.stored_payload_bytes() as usize];
            pool.export_into(1, &full, &mut whole).unwrap();
            pool.import(3, &full, &whole).unwrap();
            let restored_whole = pool.export(3).unwrap();
            for rows in [1u32, 2] {
                let short = full.with_tokens(rows);
                let mut stored = vec![0u8; short.stored_payload_bytes() as usize];
                assert!(stored.len() < whole.len(), "{codec}");
                pool.export_into(1, &short, &mut stored).unwrap();
                pool.import(2, &plain, &zeros).unwrap();
                pool.import(2, &short, &stored).unwrap();
                let got = pool.export(2).unwrap();
                // Each part: 3 rows of 4 f32; the first `rows` as a whole
                // block's restore gives them, the rest untouched.
                let used = rows as usize * 16;
                for (part, (g, w)) in got.chunks(48).zip(restored_whole.chunks(48)).enumerate() {
                    assert_eq!(g[..used], w[..used], "{codec}, {rows} rows, part {part}");
                    assert!(g[used..].iter().all(|&b| b == 0), "{codec}, part {part}");
                }
                assert!(pool.import(2, &short, &stored[1..]).is_err());
                assert!(pool.import(2, &full, &stored).is_err());
            }
            assert!(
                pool.export_into(1, &full.with_tokens(4), &mut whole)
                    .is_err(),
                "more rows than a page"
            );
        }
    }
}
