//! A G1 page as a store block: the store layout of a page, a page coded
//! into a block's payload (export) and decoded back (import), whole or
//! layer by layer from another thread ([`PageWriter`]).

use candle_core::{CpuStorage, DType, Storage, Tensor};

use kvtier_store::{Arrangement, KvCodec, KvDtype, KvLayout};

use super::inplace::WritePage;
use super::{KvPool, PageId, PageWriter};
use crate::engine_error::EngineError;

impl KvPool {
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

impl PageWriter {
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
    pub(super) fn import_to_device(
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
