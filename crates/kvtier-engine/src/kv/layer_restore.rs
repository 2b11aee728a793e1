//! Layer-wise restore: a restored prefix's layers are decoded into its G1
//! pages as they land, on the store's threads, and the forward pass that
//! computes the rest of the prompt waits at each layer only for that
//! layer (`RestoreSink::wait_layer`), so layer `l`'s attention runs while
//! layers after it are still being read. TTFT then tends to the larger of
//! the restore and the suffix's compute instead of their sum.
//!
//! Only a sequence begun while the engine ran nothing else joins a step
//! before its read is done. Beside other sequences the layers still land
//! in the pages on the store's threads, and the sequence is attached once
//! the read is done and checked. The scheduler's thread then copies
//! nothing, and no decode waits on the disk.
//!
//! Beside other sequences the sink asks the store's read to yield the CPU
//! to their decode steps ([`crate::EngineOptions::restore_yield`], passed
//! on as `LayerSink::yield_factor`): the store sleeps a multiple of the
//! time each piece took to decode here, and asks a G4 pool for one block
//! at a time with the same pause after each GET. On a host with few cores
//! the restore's work otherwise lands, all of it, on the one or two steps
//! its read overlaps.
//!
//! What lands is not verified yet (the store verifies each block once all
//! of it is in: `kvtier_store::LayerSink`). Nothing computed from it is
//! served before that: the step that used it checks the read's result
//! before it hands back any logits, and a block that failed (or could not
//! be decoded) cuts the prefix there: the step's work is dropped and the
//! rest of the prompt is recomputed (`Engine::step`).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_store::{KvLayout, LayerProgress, LayerSink, Tier};
use parking_lot::{Condvar, Mutex};

use crate::kv::kv_pool::{PageId, PageWriter};

/// What has landed of a layer-wise restore.
#[derive(Debug)]
struct Landed {
    /// The tiers of the leading run the store will hand over, once known.
    planned: Option<Vec<Tier>>,
    /// Which layers of which blocks are in their pages; a block a layer of
    /// which could not be decoded is settled (nothing more is waited for).
    progress: LayerProgress,
    /// The store's read is done (its handle holds the verified blocks).
    done: bool,
    /// When it was done.
    done_at: Option<Instant>,
    /// How long the forward pass has waited in [`RestoreSink::wait_layer`].
    waited: Duration,
}

impl Landed {
    /// The plan, once known: empty when the read ended without one.
    fn plan(&self) -> Option<Vec<Tier>> {
        match (&self.planned, self.done) {
            (Some(p), _) => Some(p.clone()),
            (None, true) => Some(Vec::new()),
            (None, false) => None,
        }
    }
}

/// Receives a restore's layers from the store into G1 pages (one per key
/// asked for) and lets the forward pass wait for each layer.
pub(crate) struct RestoreSink {
    writer: PageWriter,
    layout: KvLayout,
    pages: Vec<PageId>,
    /// Token rows the last page holds: fewer than a block when the prefix
    /// ends with a partial block (its tail, a short block in the store);
    /// the others hold a block.
    last_rows: usize,
    landed: Mutex<Landed>,
    changed: Condvar,
    /// How much the store's read yields the CPU (`LayerSink::yield_factor`).
    yield_factor: f64,
    /// Runs once the plan is known. A scheduler asleep until the read is
    /// done would otherwise attach the sequence only then, and the forward
    /// pass would overlap none of the read.
    on_planned: Arc<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for RestoreSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreSink")
            .field("pages", &self.pages)
            .field("last_rows", &self.last_rows)
            .field("landed", &self.landed)
            .field("yield_factor", &self.yield_factor)
            .finish_non_exhaustive()
    }
}

impl RestoreSink {
    /// A sink filling `pages` (the `i`-th key's layers into `pages[i]`) of
    /// blocks of `layout`, the last of them `last_rows` token rows (the
    /// rest whole); the store's read yields the CPU by
    /// `yield_factor` (`LayerSink::yield_factor`: after each piece decoded
    /// here it sleeps that many times as long as the piece took; 0,
    /// negative or not finite: never); `on_planned` runs (on a store
    /// thread) once the store has said which blocks it will hand over.
    pub(crate) fn new(
        writer: PageWriter,
        layout: KvLayout,
        (pages, last_rows): (Vec<PageId>, usize),
        yield_factor: f64,
        on_planned: Arc<dyn Fn() + Send + Sync>,
    ) -> Self {
        let n = pages.len();
        Self {
            writer,
            layout,
            last_rows,
            yield_factor,
            on_planned,
            landed: Mutex::new(Landed {
                planned: None,
                progress: LayerProgress::new(n, layout.layers),
                done: false,
                done_at: None,
                waited: Duration::ZERO,
            }),
            pages,
            changed: Condvar::new(),
        }
    }

    /// The pages, one per key asked for.
    pub(crate) fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// The store's read is done: wakes every waiter.
    pub(crate) fn finish(&self) {
        let mut st = self.landed.lock();
        st.done = true;
        st.done_at = Some(Instant::now());
        self.changed.notify_all();
    }

    /// Waits until the store's read is done.
    pub(crate) fn wait_done(&self) {
        let mut st = self.landed.lock();
        while !st.done {
            self.changed.wait(&mut st);
        }
    }

    /// When the read was done, if it is.
    pub(crate) fn done_at(&self) -> Option<Instant> {
        self.landed.lock().done_at
    }

    /// The tiers of the leading run the store will hand over, once known
    /// (empty when the read ended without saying).
    pub(crate) fn planned(&self) -> Option<Vec<Tier>> {
        self.landed.lock().plan()
    }

    /// Waits for [`planned`](Self::planned).
    pub(crate) fn wait_planned(&self) -> Vec<Tier> {
        let mut st = self.landed.lock();
        loop {
            if let Some(plan) = st.plan() {
                return plan;
            }
            self.changed.wait(&mut st);
        }
    }

    /// Waits until layer `layer` of each of the first `blocks` blocks is in
    /// its page (or could not be), or the read is done.
    /// The time spent waiting adds to [`waited`](Self::waited).
    pub(crate) fn wait_layer(&self, layer: usize, blocks: usize) {
        let mut st = self.landed.lock();
        let mut since: Option<Instant> = None;
        loop {
            let ready = st.done
                || u32::try_from(layer).map_or(true, |l| st.progress.ready_within(l, blocks));
            if ready {
                if let Some(t) = since {
                    st.waited += t.elapsed();
                }
                return;
            }
            since.get_or_insert_with(Instant::now);
            self.changed.wait(&mut st);
        }
    }

    /// How long [`wait_layer`](Self::wait_layer) has waited in all: the
    /// part of the restore the forward pass did not overlap.
    pub(crate) fn waited(&self) -> Duration {
        self.landed.lock().waited
    }

    /// The first of the leading `blocks` a layer of which could not be
    /// decoded into its page.
    pub(crate) fn first_failed(&self, blocks: usize) -> Option<usize> {
        self.landed.lock().progress.first_settled(blocks)
    }
}

impl LayerSink for RestoreSink {
    fn layers(&self, index: usize, layers: Range<u32>, stored: &[u8]) {
        let Some(&page) = self.pages.get(index) else {
            return;
        };
        // The last block may be short (the prompt's tail, stored with only
        // its rows).
        let layout = if index + 1 == self.pages.len() {
            self.layout.with_tokens(self.last_rows as u32)
        } else {
            self.layout
        };
        let rows = layout.block_tokens as usize;
        let result = self
            .writer
            .import_layers(page, &layout, layers.clone(), stored, rows);
        let mut st = self.landed.lock();
        match result {
            Ok(()) => st.progress.land(index, layers),
            Err(e) => {
                tracing::warn!("restoring layers {layers:?} of block {index} failed: {e}");
                st.progress.settle(index..index + 1);
            }
        }
        self.changed.notify_all();
    }

    fn planned(&self, tiers: &[Tier]) {
        {
            let mut st = self.landed.lock();
            st.planned = Some(tiers.iter().copied().take(self.pages.len()).collect());
            self.changed.notify_all();
        }
        (self.on_planned)();
    }

    fn yield_factor(&self) -> f64 {
        self.yield_factor
    }
}
