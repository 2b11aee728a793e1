//! Layer-wise prefix reads: [`TieredStore::read_prefix_layered`] reads a
//! prefix as [`read_prefix`](TieredStore::read_prefix) does (one pass, every
//! block verified, G3 and G4 hits promoted into G2), and also hands each
//! block's layers to a [`LayerSink`] as they land, so an engine can start a
//! layer's attention while later layers are still being read.
//!
//! * G2 hits and G4 hits are handed over whole, as soon as they are found.
//! * G3 hits are read in parts cut at layer boundaries (rounded up to
//!   4 KiB, at least [`MIN_PART_BYTES`] each), issued part-major across the
//!   prefix (`DiskTier::read_in_parts`): layer 0 of every block is asked for
//!   before layer 1 of any.
//! * What a sink is handed is not verified yet. Each block is verified once
//!   all of it is in, and the read's result lists only the blocks that
//!   passed, in prefix order: a caller must not serve anything made from a
//!   block the result lacks (kvtier's engine recomputes from there).
//!
//! Layers are handed over only for layouts that keep a layer contiguous
//! (layer-major, layer-fused, latent); a kv-major block is handed over
//! whole once all of it has landed.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::{StoredBlock, TieredStore};
use crate::block::HEADER_BYTES;
use crate::handle::Handle;
use crate::key::BlockKey;
use crate::kv_layout::KvLayout;
use crate::metrics::Tier;

/// Smallest part of a G3 slot read on its own: smaller layers are read
/// together (many small reads cost more than they overlap).
pub const MIN_PART_BYTES: usize = 128 * 1024;

/// Where [`TieredStore::read_prefix_layered`] hands each block's layers.
pub trait LayerSink: Send + Sync {
    /// Layers `layers` of the block at `index` (of the keys asked for) have
    /// landed: `stored` is their stored bytes (coded as the store's layout
    /// says; one layer's bytes are a one-layer block's payload, of the
    /// tail's rows for a short last block). Not
    /// verified yet (see the module docs). Runs on a store thread, possibly
    /// on several at once for different layers or blocks; each (block,
    /// layer) is handed over at most once.
    fn layers(&self, index: usize, layers: Range<u32>, stored: &[u8]);

    /// At most the blocks `0..tiers.len()` will be handed over: the leading
    /// run some tier holds, and which tier each is read from. Called once
    /// per read, before it is done (a block of that run can still fail its
    /// read or its check).
    fn planned(&self, tiers: &[Tier]);

    /// How much the read yields the CPU to other work (0, the default:
    /// it does not; negative or not finite: neither). Above 0, after each
    /// hand-over ([`layers`](Self::layers)) the reading thread sleeps this
    /// many times as long as the hand-over took, and the G4 blocks of a
    /// prefix are asked for one at a time, each handed over as it arrives,
    /// with a pause of this many times the GET and its hand-over after
    /// each, so a pool's server on the same host does not send the whole
    /// prefix in one burst. Each pause is at most [`MAX_PAUSE`]. The plan
    /// ([`planned`](Self::planned)) then comes after the G4 blocks: a sink
    /// that yields must not wait for it.
    fn yield_factor(&self) -> f64 {
        0.0
    }
}

/// Longest pause of a yielding read: a factor set far too high slows a
/// read down, never stops it.
pub const MAX_PAUSE: Duration = Duration::from_millis(20);

/// Sleeps `k` times `took`, at most [`MAX_PAUSE`]; not at all for a `k`
/// that is not finite and above 0.
pub(super) fn pause(took: Duration, k: f64) {
    if k.is_finite() && k > 0.0 {
        let secs = (took.as_secs_f64() * k).min(MAX_PAUSE.as_secs_f64());
        std::thread::sleep(Duration::from_secs_f64(secs));
    }
}

/// A sink whose every hand-over is followed by a [`pause`] of its own
/// `yield_factor` times the hand-over's time.
pub(super) struct Paced<'a>(pub(super) &'a dyn LayerSink);

impl LayerSink for Paced<'_> {
    fn layers(&self, index: usize, layers: Range<u32>, stored: &[u8]) {
        let t = Instant::now();
        self.0.layers(index, layers, stored);
        pause(t.elapsed(), self.0.yield_factor());
    }

    fn planned(&self, tiers: &[Tier]) {
        self.0.planned(tiers);
    }

    fn yield_factor(&self) -> f64 {
        self.0.yield_factor()
    }
}

/// Where a layout's layers sit in its stored payload, for handing them
/// over: `None` when a layer is not contiguous (kv-major).
pub(super) struct LayerSpans {
    /// Stored bytes of one layer.
    layer: usize,
    /// Layers in a block.
    layers: u32,
}

impl LayerSpans {
    pub(super) fn of(layout: &KvLayout) -> Option<Self> {
        let first = layout.layer_range(0)?;
        let stored = layout.stored_range(first)?;
        Some(Self {
            layer: usize::try_from(stored.end - stored.start).ok()?,
            layers: layout.layers,
        })
    }

    /// Slot offsets to cut a G3 read at: each layer boundary rounded up
    /// to 4 KiB, parts at least [`MIN_PART_BYTES`].
    pub(super) fn cuts(&self) -> Vec<usize> {
        let align = kvtier_io::DIRECT_IO_ALIGN;
        let mut cuts: Vec<usize> = Vec::new();
        for l in 1..self.layers as usize {
            let cut = (HEADER_BYTES + l * self.layer).div_ceil(align) * align;
            if cut - cuts.last().copied().unwrap_or(0) >= MIN_PART_BYTES {
                cuts.push(cut);
            }
        }
        cuts
    }

    /// Hands the sink the layers of block `index` that end inside the
    /// newly landed slot bytes `new` (`slot`: the slot's landed start).
    pub(super) fn hand_over(
        &self,
        sink: &dyn LayerSink,
        index: usize,
        new: Range<usize>,
        slot: &[u8],
    ) {
        let end_of = |l: usize| HEADER_BYTES + (l + 1) * self.layer;
        let n = self.layers as usize;
        let first = (0..n).find(|&l| end_of(l) > new.start);
        let past = (0..n).find(|&l| end_of(l) > new.end).unwrap_or(n);
        if let Some(first) = first
            && first < past
            && let Some(stored) = slot.get(HEADER_BYTES + first * self.layer..end_of(past - 1))
        {
            sink.layers(index, first as u32..past as u32, stored);
        }
    }
}

impl TieredStore {
    /// [`read_prefix`](Self::read_prefix), handing each block's layers to
    /// `sink` as they land (see the module docs), on the store's reader
    /// threads: returns at once; `notify` runs when the handle is done. The
    /// handle's blocks are the verified leading run, as `read_prefix`'s.
    /// With `tail_rows`, the last key is a short block of that many token
    /// rows ([`new_short_block`](Self::new_short_block)): its layers are
    /// that many rows each, and only its bytes are read.
    pub fn read_prefix_layered(
        &self,
        keys: Vec<BlockKey>,
        tail_rows: Option<u32>,
        sink: std::sync::Arc<dyn LayerSink>,
        notify: impl FnOnce() + Send + 'static,
    ) -> Handle<Vec<StoredBlock>> {
        self.read_prefix_on_readers(keys, tail_rows, Some(sink), notify)
    }
}
