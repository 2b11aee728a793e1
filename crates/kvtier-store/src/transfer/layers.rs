//! Layer-wise loads into the caller's memory: [`TieredStore::load_layers`]
//! reads as [`TieredStore::load`] does (a result per block, every block
//! verified, hits from below G2 promoted), but decodes each block's layers
//! into the caller's memory as they land (`store/layer_reads.rs` hands
//! them over: G2 and G4 hits whole, G3 reads cut at layer boundaries and
//! issued layer-major), and [`Transfer::wait_layer`] returns once one layer
//! of every block is in, so the caller can run that layer's compute while
//! the later layers are still being read.
//!
//! What lands is not verified yet: a block is verified once all of it is
//! in. So, unlike a plain load, a block reported `corrupt` may have been
//! written (with bytes that failed their check): a caller must not keep
//! anything computed from a block whose result is not a hit. vLLM's
//! connector reports such a block as a load error, and vLLM then drops the
//! step's output for its request and recomputes the block. Misses and
//! failed reads are never written.
//!
//! A layer of a block counts as in once it has been decoded into the
//! caller's memory, or once the block's chunk is done (nothing more will
//! land for it: a miss, a failed read). After a cancel, a block of which no
//! layer was written reports `cancelled`; the others report what happened
//! to them.

use std::ops::Range;

use super::{BlockRegions, Shared, Transfer, Work, layer_span};
use crate::codec::CodecError;
use crate::key::BlockKey;
use crate::kv_layout::KvLayout;
use crate::metrics::Tier;
use crate::store::{LayerSink, StoreError, TieredStore};

/// Decodes the layers handed over for one chunk's blocks into the caller's
/// memory and records them as in.
pub(super) struct IntoRegions<'a> {
    layout: KvLayout,
    /// The chunk's first block in the transfer.
    first: usize,
    dests: &'a [BlockRegions],
    shared: &'a Shared,
}

// SAFETY: `BlockRegions` holds raw pointers into the caller's memory and is
// not `Sync`. This sink writes a block's memory only for the (block, layer)
// pairs it is handed, each handed over at most once (`LayerSink::layers`),
// so two threads never write the same bytes, and the memory outlives the
// chunk's read (`BlockRegions::from_raw`'s contract).
unsafe impl Sync for IntoRegions<'_> {}
// SAFETY: as for `Sync`: the sink is only used within the chunk's read.
unsafe impl Send for IntoRegions<'_> {}

impl<'a> IntoRegions<'a> {
    /// The sink of the chunk whose first block is `first` in the transfer.
    pub(super) fn new(
        layout: KvLayout,
        first: usize,
        dests: &'a [BlockRegions],
        shared: &'a Shared,
    ) -> Self {
        Self {
            layout,
            first,
            dests,
            shared,
        }
    }
}

impl LayerSink for IntoRegions<'_> {
    fn layers(&self, index: usize, layers: Range<u32>, stored: &[u8]) {
        let Some(dest) = self.dests.get(index) else {
            return;
        };
        match dest.fill_layers(&self.layout, layers.clone(), stored) {
            Ok(()) => {
                if let Some(p) = &mut self.shared.state.lock().layers {
                    p.land(self.first + index, layers);
                }
                self.shared.finished.notify_all();
            }
            // Decoded again from the verified block at the chunk's end,
            // which reports the error if it persists.
            Err(e) => tracing::debug!("layers {layers:?} of block {index} not decoded: {e}"),
        }
    }

    fn planned(&self, _tiers: &[Tier]) {}
}

impl TieredStore {
    /// [`load`](Self::load), layer by layer: each block's layers are
    /// decoded into `dests` as they land, and [`Transfer::wait_layer`]
    /// tells when a layer of every block is in (see `transfer/layers.rs`:
    /// a block that fails its check may have been written, so nothing
    /// computed from a block whose result is not a hit may be kept).
    pub fn load_layers(
        &self,
        keys: Vec<BlockKey>,
        dests: Vec<BlockRegions>,
        notify: Option<Box<dyn FnOnce() + Send>>,
    ) -> Result<Transfer, StoreError> {
        self.transfer(keys, dests, notify, Work::LoadLayers)
    }
}

/// Decodes the layers `missing` of a verified block's stored payload into
/// `dest`: the layers no hand-over brought (whole, if none did).
pub(super) fn fill_missing(
    layout: &KvLayout,
    dest: &BlockRegions,
    missing: &[u32],
    stored: &[u8],
) -> Result<(), CodecError> {
    if missing.len() == layout.layers as usize {
        return dest.fill_from(layout, stored);
    }
    for &l in missing {
        let one = layer_span(layout, l..l + 1)
            .and_then(|span| layout.stored_range(span))
            .and_then(|s| stored.get(s.start as usize..s.end as usize))
            .ok_or_else(|| CodecError::Shape(format!("layer {l} of {layout} is not contiguous")))?;
        dest.fill_layers(layout, l..l + 1, one)?;
    }
    Ok(())
}
