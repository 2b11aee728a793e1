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
//!
//! Here: the pool, its pages' bookkeeping and the writes and reads of the
//! forward pass. A page as a store block (export, import, whole or layer
//! by layer): `page_block.rs`; the in-place operations on the pool's CPU
//! memory: `inplace.rs`.

mod inplace;
mod page_block;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use self::inplace::{Commit, CopyRows, WriteRows};
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
    /// more in per-operation overhead than in arithmetic (docs/decisions.md,
    /// "The engine").
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
}
