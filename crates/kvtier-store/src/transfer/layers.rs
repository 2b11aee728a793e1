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

/// Which layers of which blocks of a layer-wise load are in.
pub(super) struct LayerProgress {
    layers: usize,
    /// Per block, per layer: decoded into the caller's memory.
    landed: Vec<bool>,
    /// Per block: nothing more will land (its chunk is done).
    settled: Vec<bool>,
    /// Per layer: blocks that have neither landed it nor settled.
    waiting: Vec<usize>,
}

impl LayerProgress {
    pub(super) fn new(blocks: usize, layers: u32) -> Self {
        let layers = layers as usize;
        Self {
            layers,
            landed: vec![false; blocks * layers],
            settled: vec![false; blocks],
            waiting: vec![blocks; layers],
        }
    }

    /// Layers `layers` of `block` are in the caller's memory.
    fn land(&mut self, block: usize, layers: Range<u32>) {
        let settled = self.settled.get(block).copied().unwrap_or(true);
        for l in layers.map(|l| l as usize).filter(|&l| l < self.layers) {
            if let Some(done) = self.landed.get_mut(block * self.layers + l)
                && !*done
            {
                *done = true;
                if !settled {
                    self.waiting[l] -= 1;
                }
            }
        }
    }

    /// Nothing more lands for `blocks`.
    pub(super) fn settle(&mut self, blocks: Range<usize>) {
        for b in blocks {
            let Some(s) = self.settled.get_mut(b) else {
                continue;
            };
            if std::mem::replace(s, true) {
                continue;
            }
            for l in 0..self.layers {
                if !self.landed[b * self.layers + l] {
                    self.waiting[l] -= 1;
                }
            }
        }
    }

    /// True once layer `layer` of every block is in (or will not come);
    /// true for a layer past the last.
    pub(super) fn ready(&self, layer: u32) -> bool {
        self.waiting
            .get(layer as usize)
            .is_none_or(|&waiting| waiting == 0)
    }

    /// The layers of `block` not in the caller's memory yet.
    pub(super) fn missing(&self, block: usize) -> Vec<u32> {
        (0..self.layers)
            .filter(|&l| {
                !self
                    .landed
                    .get(block * self.layers + l)
                    .copied()
                    .unwrap_or(false)
            })
            .map(|l| l as u32)
            .collect()
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_is_ready_once_every_block_landed_it_or_settled() {
        let mut p = LayerProgress::new(3, 2);
        assert!(!p.ready(0) && !p.ready(1));
        assert!(p.ready(2), "no layer 2: nothing to wait for");
        p.land(0, 0..1);
        p.land(1, 0..2);
        assert!(!p.ready(0), "block 2 has not landed layer 0");
        p.land(2, 0..1);
        assert!(p.ready(0) && !p.ready(1));
        // Landing twice counts once.
        p.land(2, 0..1);
        assert_eq!(p.waiting, vec![0, 2]);
        assert_eq!(p.missing(0), vec![1]);
        // Block 0 will not land layer 1 (its chunk is done): only block 2
        // is waited for now; settling again changes nothing.
        p.settle(0..1);
        p.settle(0..1);
        assert!(!p.ready(1));
        p.settle(1..3);
        assert!(p.ready(1));
        assert_eq!(p.waiting, vec![0, 0]);
        // A late hand-over of a settled block changes no count.
        p.land(0, 1..2);
        assert_eq!(p.waiting, vec![0, 0]);
    }
}
