//! Prefix restore: [`Engine::begin`] attaches a prompt's G1 hits and starts
//! one background read of the rest of its cached prefix from the store
//! (the store's reader threads look each key up once, read G3 and G4 with
//! all reads in flight and verify every block, while the caller's thread
//! goes on); [`Engine::attach`] takes the blocks read into G1 pages, one copy
//! each, all at once or ([`Engine::attach_some`]) a bounded number of bytes
//! at a time between the scheduler's steps. The rest of the prompt is computed by
//! [`Engine::step`].
//!
//! By default ([`crate::EngineOptions::layerwise_restore`]) the read is
//! layer-wise instead ([`crate::kv::layer_restore`]): its layers are decoded
//! into pages taken at `begin`, on the store's threads, so `attach` only
//! puts those pages in the table. A sequence begun alone is attached as
//! soon as the store knows what it will hand over, and its first step
//! waits at each layer for that layer.
//!
//! Reuse is token-granular: of a prompt of `n` tokens, everything but the
//! last token (whose logits must be computed) can come from cache.
//!
//! * Full blocks by key, from G1 pages or the store.
//! * The tail after them, fewer than a block: from the store by its partial
//!   key (a repeated prompt; [`kvtier_store::KeyChain::partial`]), or from
//!   any G1 page below the last full block that starts with the same tokens
//!   ([`crate::kv::prefix_cache::PrefixCache::best_child`]): its rows are
//!   copied into the prompt's own page.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use kvtier_store::{BlockKey, Handle, StoredBlock, Tier};

use crate::engine_error::EngineError;
use crate::kv::kv_pool::PageId;
use crate::kv::layer_restore::RestoreSink;
use crate::serving::engine::{Engine, Seq, SeqId};
use kvtier_store::TierTokens;

/// What [`Engine::begin`] started for a sequence.
#[derive(Debug)]
pub(crate) struct Begun {
    /// When `begin` was called.
    started: Instant,
    /// Prompt tokens attached from G1 pages.
    cached: TierTokens,
    /// Keys being read from the store, in prefix order: full blocks, then
    /// possibly the tail's partial key (see `tail`).
    keys: Vec<BlockKey>,
    /// The prompt's reusable tail after its full blocks: its partial key
    /// and its length, when `keys` ends with it.
    tail: Option<(BlockKey, usize)>,
    /// Table length when the store's blocks start.
    first_read: usize,
    /// The store read of `keys`, if one was needed.
    read: Option<Handle<Vec<StoredBlock>>>,
    /// When that read finished (set by its completion callback).
    read_done: Arc<OnceLock<Instant>>,
    /// The blocks read and not yet copied into G1, once the read is done.
    blocks: Option<VecDeque<StoredBlock>>,
    /// Seconds the read took (from `begin` to its completion).
    read_seconds: f64,
    /// What was copied into G1 so far.
    attached: Attached,
    /// A layer-wise read's destination, with the pages it fills, one per
    /// key ([`crate::kv::layer_restore`]).
    layered: Option<Arc<RestoreSink>>,
    /// The forward pass may start before that read is done: the sequence
    /// was the engine's only one when it began.
    gated: bool,
}

impl Begun {
    /// Gives up: a store read in flight is cancelled. A layer-wise read's
    /// pages are handed back (to release), once the read no longer writes
    /// them.
    pub(crate) fn cancel(self) -> Vec<PageId> {
        if let Some(read) = self.read {
            read.cancel();
            if self.layered.is_some() {
                let _ = read.wait();
            }
        }
        self.layered.map(|s| s.pages().to_vec()).unwrap_or_default()
    }
}

/// A layer-wise restore attached to a sequence and not verified yet: its
/// pages are in the sequence's table (from `first` on) but not in G1's
/// index, and nothing computed from them is served before
/// [`Engine::settle_layered`] has checked the read's result.
#[derive(Debug)]
pub(crate) struct LayeredAttach {
    sink: Arc<RestoreSink>,
    read: Option<Handle<Vec<StoredBlock>>>,
    /// Table index of the first restored page.
    first: usize,
    /// The keys restored, in order (the last may be the tail's).
    keys: Vec<BlockKey>,
    /// The tier of each.
    tiers: Vec<Tier>,
    /// The tail's partial key and length, when `keys` ends with it.
    tail: Option<(BlockKey, usize)>,
    /// When `begin` started the read.
    started: Instant,
}

impl LayeredAttach {
    /// What the forward pass waits on: the sink and how many blocks.
    pub(crate) fn gate(&self) -> (Arc<RestoreSink>, usize) {
        (self.sink.clone(), self.keys.len())
    }
}

/// What [`Engine::attach`] took from the caches for a sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Attached {
    /// Prompt tokens served from cache, by tier.
    pub cached: TierTokens,
    /// KV bytes restored from the store.
    pub restored_bytes: u64,
    /// Seconds the store read took, plus the copies into G1.
    pub restore_seconds: f64,
    /// Seconds the forward pass waited for restored layers to land (a
    /// layer-wise restore's part not overlapped by compute; 0 for a
    /// restore done before the forward pass started).
    pub layer_wait_seconds: f64,
    /// Prompt tokens left to compute.
    pub to_compute: usize,
    /// The store's blocks were restored layer by layer, the forward pass
    /// starting before the read was done ([`crate::kv::layer_restore`]).
    pub layer_wise: bool,
}

impl Engine {
    /// Starts a sequence without waiting on the store: checks the prompt,
    /// attaches the G1 pages of its cached prefix and starts one background
    /// read of the rest of the prefix from the store. `on_progress` runs
    /// (on a store thread) once that read is done, or at once when none was
    /// needed; until then [`restore_done`](Self::restore_done) is false. For
    /// a layer-wise restore it also runs once the store knows which blocks
    /// it will hand over, when [`restore_started`](Self::restore_started)
    /// may turn true: a caller that sleeps between its checks attaches the
    /// sequence then, and its forward pass overlaps the rest of the read.
    /// Then [`attach`](Self::attach) the restored blocks and compute the
    /// rest with [`step`](Self::step)s (or [`finish`](Self::finish) to give
    /// up).
    pub fn begin(
        &mut self,
        prompt: &[u32],
        on_progress: impl Fn() + Send + Sync + 'static,
    ) -> Result<SeqId, EngineError> {
        self.begin_salted(prompt, b"", on_progress)
    }

    /// [`begin`](Self::begin) with the request's own `salt` in its block
    /// keys (`KeyChain::salted`, docs/keys.md "Request salts"): a tenant's
    /// or a `cache_salt`'s prefixes are found only by requests with the
    /// same salt, in G1 and in every store tier. Empty: the engine's chain.
    pub fn begin_salted(
        &mut self,
        prompt: &[u32],
        salt: &[u8],
        on_progress: impl Fn() + Send + Sync + 'static,
    ) -> Result<SeqId, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::Request("empty prompt".into()));
        }
        if prompt.len() >= self.model.max_positions() {
            return Err(EngineError::Request(format!(
                "prompt of {} tokens leaves no room in the {}-token context",
                prompt.len(),
                self.model.max_positions()
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut begun = Begun {
            started: Instant::now(),
            cached: TierTokens::default(),
            keys: Vec::new(),
            tail: None,
            first_read: 0,
            read: None,
            read_done: Arc::new(OnceLock::new()),
            blocks: None,
            read_seconds: 0.0,
            attached: Attached::default(),
            layered: None,
            gated: false,
        };
        let read_done = begun.read_done.clone();
        let on_progress: Arc<dyn Fn() + Send + Sync> = Arc::new(on_progress);
        let progress = on_progress.clone();
        let mut notify: Option<Box<dyn FnOnce() + Send>> = Some(Box::new(move || {
            let _ = read_done.set(Instant::now());
            progress();
        }));
        let chain = self.keychain.salted(salt);
        self.seqs.insert(
            id,
            Seq {
                tokens: prompt.to_vec(),
                table: Vec::new(),
                computed: 0,
                keys: Vec::new(),
                chain,
                prefill: None,
                layered: None,
                attached: None,
                tail_stored: false,
            },
        );
        if self.opts.prefix_reuse
            && let Err(e) = self.find_cached(id, &mut begun, &mut notify, &on_progress)
        {
            self.finish(id);
            return Err(e);
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.prefill = Some(begun);
        }
        if let Some(notify) = notify {
            notify();
        }
        Ok(id)
    }

    /// Attaches a new sequence's G1 hits and starts the store read of the
    /// rest of its cached prefix (taking `notify` for it; a layer-wise
    /// read also calls `planned` once its plan is known), or, when G1
    /// holds it all or there is no store, copies the tail from G1 now.
    fn find_cached(
        &mut self,
        id: SeqId,
        begun: &mut Begun,
        notify: &mut Option<Box<dyn FnOnce() + Send>>,
        planned: &Arc<dyn Fn() + Send + Sync>,
    ) -> Result<(), EngineError> {
        let bt = self.opts.block_tokens;
        let Some(seq) = self.seqs.get(&id) else {
            return Ok(());
        };
        // Never the last prompt token: its logits must be computed.
        let reusable = seq.tokens.len() - 1;
        let full = reusable / bt;
        let keys = seq.chain.keys(&seq.tokens[..full * bt]);
        let tail = &seq.tokens[full * bt..reusable];
        let tail_key = (!tail.is_empty()).then(|| {
            let prev = keys.last().copied().unwrap_or_else(|| seq.chain.seed());
            (seq.chain.partial(&prev, tail), tail.len())
        });
        let mut hits = Vec::new();
        for key in &keys {
            let Some(page) = self.g1.get(key) else { break };
            self.pool.retain(page);
            self.g1.mark_busy(page);
            hits.push(page);
        }
        let h = hits.len();
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.table = hits;
            seq.keys = keys[..h].to_vec();
            seq.computed = h * bt;
        }
        begun.cached.g1 = h * bt;
        let mut rest = keys[h..].to_vec();
        // G1 alone serves it when it holds every full block and the whole
        // tail; else the store is asked first, and G1's pages serve what it
        // lacks of the tail once its read is done.
        let tail_len = tail_key.map_or(0, |(_, n)| n);
        let g1_covers = rest.is_empty() && self.g1_tail_len(id, reusable) == tail_len;
        if self.store.is_some()
            && !g1_covers
            && (!rest.is_empty() || tail_key.is_some())
            && let Some(notify) = notify.take()
        {
            if let Some((k, _)) = tail_key {
                rest.push(k);
            }
            let alone = self.seqs.len() == 1;
            let last_rows = tail_key.map_or(bt, |(_, n)| n);
            let sink = self.layer_sink(id, (rest.len(), last_rows), alone, planned.clone());
            begun.gated = sink.is_some() && alone;
            let Some(store) = &self.store else {
                return Ok(());
            };
            // The tail is a short block in the store: only its rows.
            let tail_rows = tail_key.map(|(_, n)| n as u32);
            begun.read = Some(match &sink {
                Some(sink) => {
                    let done = sink.clone();
                    store.read_prefix_layered(rest.clone(), tail_rows, sink.clone(), move || {
                        done.finish();
                        notify();
                    })
                }
                None => store.read_prefix_async(rest.clone(), tail_rows, notify),
            });
            begun.layered = sink;
            begun.first_read = h;
            begun.tail = tail_key;
            begun.keys = rest;
            return Ok(());
        }
        begun.cached.g1 += self.attach_g1_tail(id, reusable)?;
        Ok(())
    }

    /// How many of `id`'s next tokens (up to `upto`) a G1 page below its
    /// last full block holds (0 when it is not at a block boundary).
    fn g1_tail_len(&self, id: SeqId, upto: usize) -> usize {
        let bt = self.opts.block_tokens;
        let Some(seq) = self.seqs.get(&id) else {
            return 0;
        };
        if seq.computed >= upto || !seq.computed.is_multiple_of(bt) {
            return 0;
        }
        let parent = seq.keys.last().copied().unwrap_or_else(|| seq.chain.seed());
        self.g1
            .best_child(&parent, &seq.tokens[seq.computed..upto])
            .map_or(0, |(_, n)| n)
    }

    /// Copies into a fresh page of `id` the rows of the G1 page below its
    /// last full block that shares the most of its next tokens (up to
    /// `upto`); returns how many tokens that served (0: none, or no page
    /// free for it: they are computed instead).
    fn attach_g1_tail(&mut self, id: SeqId, upto: usize) -> Result<usize, EngineError> {
        let bt = self.opts.block_tokens;
        let Some(seq) = self.seqs.get(&id) else {
            return Ok(0);
        };
        if seq.computed >= upto || !seq.computed.is_multiple_of(bt) {
            return Ok(0);
        }
        let parent = seq.keys.last().copied().unwrap_or_else(|| seq.chain.seed());
        let Some((src, n)) = self.g1.best_child(&parent, &seq.tokens[seq.computed..upto]) else {
            return Ok(0);
        };
        let last = seq.table.last().copied();
        // The source page must survive taking a free page for the copy.
        self.pool.retain(src);
        self.g1.mark_busy(src);
        let copied = match self.alloc_page(last) {
            Ok(dst) => match self.pool.copy_rows(src, dst, n) {
                Ok(()) => {
                    if let Some(seq) = self.seqs.get_mut(&id) {
                        seq.table.push(dst);
                        seq.computed += n;
                    }
                    n
                }
                Err(e) => {
                    self.release_page(dst);
                    self.release_page(src);
                    return Err(e);
                }
            },
            Err(_) => 0,
        };
        self.release_page(src);
        Ok(copied)
    }

    /// True once the store read [`begin`](Self::begin) started for `id` is
    /// done (or none was needed): [`attach`](Self::attach) will not wait on
    /// the store.
    pub fn restore_done(&self, id: SeqId) -> bool {
        self.seqs
            .get(&id)
            .and_then(|s| s.prefill.as_ref())
            .and_then(|b| b.read.as_ref())
            .is_none_or(Handle::is_done)
    }

    /// True once [`attach`](Self::attach) can take `id` without waiting for all
    /// of its store read: a layer-wise restore ([`crate::kv::layer_restore`])
    /// begun while `id` was the engine's only sequence, whose store knows which
    /// blocks it will hand over. Its forward pass then waits for each layer as
    /// it goes.
    pub fn restore_started(&self, id: SeqId) -> bool {
        self.seqs
            .get(&id)
            .and_then(|s| s.prefill.as_ref())
            .filter(|b| b.gated)
            .and_then(|b| b.layered.as_ref())
            .is_some_and(|sink| sink.planned().is_some())
    }

    /// What `id`'s prefix restore took from the caches, once attached;
    /// final once its first token's logits are out (a layer-wise restore
    /// is verified then, and a block that failed is counted out).
    pub fn attached(&self, id: SeqId) -> Option<Attached> {
        self.seqs.get(&id).and_then(|s| s.attached)
    }

    /// Pages for a layer-wise read of `n` blocks after `id`'s table (the
    /// last of them `last_rows` token rows: the prompt's tail), when the
    /// pool has them; `None` reads whole blocks, copied into G1 by
    /// [`attach`](Self::attach), instead. The store's threads decode each
    /// layer into these pages as it lands, so attaching them copies nothing
    /// on the scheduler's thread. Only a sequence begun `alone` (`gated`)
    /// joins a step before its read is done: a forward pass that waits on
    /// the store must not hold up anyone's decode. Beside others, the
    /// store's threads yield to their steps
    /// ([`crate::EngineOptions::restore_yield`]).
    fn layer_sink(
        &mut self,
        id: SeqId,
        (n, last_rows): (usize, usize),
        alone: bool,
        on_planned: Arc<dyn Fn() + Send + Sync>,
    ) -> Option<Arc<RestoreSink>> {
        if !self.opts.layerwise_restore || n == 0 {
            return None;
        }
        let mut last = self.seqs.get(&id)?.table.last().copied();
        let mut pages = Vec::with_capacity(n);
        for _ in 0..n {
            match self.alloc_page(last) {
                Ok(p) => {
                    pages.push(p);
                    last = Some(p);
                }
                Err(_) => {
                    for p in pages {
                        self.pool.release(p);
                        self.pool.free(p);
                    }
                    return None;
                }
            }
        }
        let writer = self.pool.page_writer();
        let yield_factor = if alone { 0.0 } else { self.opts.restore_yield };
        Some(Arc::new(RestoreSink::new(
            writer,
            self.kv_layout,
            (pages, last_rows),
            yield_factor,
            on_planned,
        )))
    }

    /// [`attach`](Self::attach) for a layer-wise restore: waits only for
    /// the store to say which blocks it hands over, puts their pages in the
    /// table (unverified: see [`LayeredAttach`]) and hands the rest back.
    fn attach_layered(&mut self, id: SeqId) -> Result<Attached, EngineError> {
        let bt = self.opts.block_tokens;
        let stored = self.kv_layout.stored_payload_bytes();
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Err(EngineError::Request(format!("unknown sequence {id}")));
        };
        let Some(mut begun) = seq.prefill.take() else {
            return Err(EngineError::Request(format!(
                "sequence {id} has no prefill begun"
            )));
        };
        let Some(sink) = begun.layered.take() else {
            return Err(EngineError::Request(format!(
                "sequence {id} has no layer-wise read"
            )));
        };
        if !begun.gated {
            sink.wait_done();
        }
        let mut tiers = sink.wait_planned();
        tiers.truncate(begun.keys.len());
        let n = tiers.len();
        let first = seq.table.len();
        let mut attached = Attached {
            cached: begun.cached,
            layer_wise: begun.gated,
            ..Attached::default()
        };
        for (i, tier) in tiers.iter().enumerate() {
            let key = begun.keys[i];
            let tail = begun.tail.filter(|(k, _)| *k == key).map(|(_, n)| n);
            let tokens = tail.unwrap_or(bt);
            seq.table.push(sink.pages()[i]);
            if tail.is_none() {
                seq.keys.push(key);
            } else {
                seq.tail_stored = true;
            }
            seq.computed += tokens;
            let bytes = match tail {
                Some(n) => self.kv_layout.with_tokens(n as u32).stored_payload_bytes(),
                None => stored,
            };
            count_restored(&mut attached, *tier, tokens, bytes);
        }
        begun.keys.truncate(n);
        seq.layered = Some(LayeredAttach {
            sink: sink.clone(),
            read: begun.read.take(),
            first,
            keys: std::mem::take(&mut begun.keys),
            tiers,
            tail: begun.tail,
            started: begun.started,
        });
        for &page in &sink.pages()[n..] {
            self.pool.release(page);
            self.pool.free(page);
        }
        // Whatever the store lacked of the tail, a G1 page may hold.
        let reusable = self.seqs.get(&id).map_or(0, |s| s.tokens.len() - 1);
        attached.cached.g1 += self.attach_g1_tail(id, reusable)?;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Err(EngineError::Request(format!("unknown sequence {id}")));
        };
        attached.to_compute = seq.tokens.len() - seq.computed;
        attached.restore_seconds = begun.started.elapsed().as_secs_f64();
        seq.attached = Some(attached);
        if !begun.gated {
            // The read is done: checked before anything is computed on it.
            self.settle_layered(id);
            return self
                .attached(id)
                .ok_or_else(|| EngineError::Request(format!("unknown sequence {id}")));
        }
        Ok(attached)
    }

    /// Checks a layer-wise restore of `id` once its forward pass has used
    /// it: waits for the store's read, and puts the verified pages in G1's
    /// index. False when a block failed (its read, its check, or its
    /// decode): the prefix is cut before it, everything after (this step's
    /// work included) is dropped, and the rest of the prompt is recomputed.
    /// True when all held, or there was nothing to check.
    pub(crate) fn settle_layered(&mut self, id: SeqId) -> bool {
        let bt = self.opts.block_tokens;
        let stored = self.kv_layout.stored_payload_bytes();
        let Some(l) = self.seqs.get_mut(&id).and_then(|s| s.layered.take()) else {
            return true;
        };
        let blocks = l.read.and_then(Handle::wait).unwrap_or_default();
        let n = l.keys.len();
        let verified = blocks
            .iter()
            .zip(&l.keys)
            .take_while(|(b, k)| b.key == **k)
            .count();
        let good = verified.min(l.sink.first_failed(n).unwrap_or(n));
        let done = l.sink.done_at().unwrap_or_else(Instant::now);
        let Some(seq) = self.seqs.get_mut(&id) else {
            return true;
        };
        if let Some(a) = seq.attached.as_mut() {
            a.restore_seconds = done.duration_since(l.started).as_secs_f64();
            a.layer_wait_seconds = l.sink.waited().as_secs_f64();
        }
        if good == n {
            for i in 0..n {
                let at = l.first + i;
                if l.tail.is_some_and(|(k, _)| k == l.keys[i]) {
                    continue;
                }
                let parent = match at.checked_sub(1) {
                    Some(p) => seq.keys[p],
                    None => seq.chain.seed(),
                };
                let page = seq.table[at];
                self.g1
                    .insert(l.keys[i], page, parent, &seq.tokens[at * bt..(at + 1) * bt]);
            }
            return true;
        }
        tracing::warn!(
            "sequence {id}: {} of {n} restored blocks failed a check; recomputing from there",
            n - good
        );
        let keep = l.first + good;
        let dropped = seq.table.split_off(keep.min(seq.table.len()));
        seq.keys.truncate(keep);
        seq.computed = keep * bt;
        seq.tail_stored = false;
        if let Some(a) = seq.attached.as_mut() {
            let g1 = a.cached.g1.min(l.first * bt);
            a.cached = TierTokens {
                g1,
                ..TierTokens::default()
            };
            a.restored_bytes = 0;
            for &tier in &l.tiers[..good] {
                count_restored(a, tier, bt, stored);
            }
            a.to_compute = seq.tokens.len() - seq.computed;
        }
        for page in dropped {
            self.release_page(page);
        }
        false
    }

    /// Takes the blocks the store read for a sequence [`begin`](Self::begin)
    /// started (waiting for the read if it is still running) into fresh G1
    /// pages, one copy each. What is left of the prompt is computed by
    /// [`step`](Self::step)s ([`Attached::to_compute`] tokens, at least the
    /// last one). On an error the sequence is finished.
    pub fn attach(&mut self, id: SeqId) -> Result<Attached, EngineError> {
        let mut unlimited = u64::MAX;
        self.attach_some(id, &mut unlimited)?
            .ok_or_else(|| EngineError::Request(format!("sequence {id}: restore unfinished")))
    }

    /// [`attach`](Self::attach), a few blocks at a time: copies restored
    /// blocks while `budget` (bytes) lasts, at least one when it is not
    /// zero, and takes what it copied off the budget. `Some` once every
    /// block is in G1. The scheduler spreads a long prefix's copies over its
    /// steps this way (a 4,096-token prefix of the `small` preset is 64 MiB,
    /// a short copy into the committed pool; a 32,768-token one eight times
    /// that).
    pub fn attach_some(
        &mut self,
        id: SeqId,
        budget: &mut u64,
    ) -> Result<Option<Attached>, EngineError> {
        let Some(begun) = self.seqs.get_mut(&id).and_then(|s| s.prefill.as_mut()) else {
            self.finish(id);
            return Err(EngineError::Request(format!(
                "sequence {id} has no prefill begun"
            )));
        };
        if begun.layered.is_some() {
            return self.attach_layered(id).map(Some);
        }
        if begun.blocks.is_none() {
            begun.attached.cached = begun.cached;
            let blocks = match begun.read.take() {
                Some(read) => {
                    let blocks = read.wait().unwrap_or_default();
                    // The read's own time, not how long the caller took to
                    // come back for it.
                    let done = begun.read_done.get().copied().unwrap_or_else(Instant::now);
                    begun.read_seconds = done.duration_since(begun.started).as_secs_f64();
                    blocks
                }
                None => Vec::new(),
            };
            begun.blocks = Some(blocks.into());
        }
        let t = Instant::now();
        while *budget > 0 {
            let Some(begun) = self.seqs.get_mut(&id).and_then(|s| s.prefill.as_mut()) else {
                break;
            };
            let next = begun.blocks.as_mut().and_then(VecDeque::pop_front);
            let Some(block) = next else { break };
            let bytes = block.payload().len() as u64;
            if !self.attach_block(id, block) {
                // The rest of the prefix is recomputed.
                if let Some(b) = self.seqs.get_mut(&id).and_then(|s| s.prefill.as_mut()) {
                    b.blocks = Some(VecDeque::new());
                }
                break;
            }
            *budget = budget.saturating_sub(bytes);
        }
        let pending = self
            .seqs
            .get(&id)
            .and_then(|s| s.prefill.as_ref())
            .is_some_and(|b| b.blocks.as_ref().is_some_and(|b| !b.is_empty()));
        if pending {
            if let Some(b) = self.seqs.get_mut(&id).and_then(|s| s.prefill.as_mut()) {
                b.attached.restore_seconds += t.elapsed().as_secs_f64();
            }
            return Ok(None);
        }
        // Whatever the store lacked of the tail, a G1 page may hold.
        let reusable = self.seqs.get(&id).map_or(0, |s| s.tokens.len() - 1);
        let copied = self.attach_g1_tail(id, reusable)?;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Ok(None);
        };
        let to_compute = seq.tokens.len() - seq.computed;
        let Some(begun) = seq.prefill.as_mut() else {
            return Ok(None);
        };
        begun.attached.cached.g1 += copied;
        begun.attached.restore_seconds += t.elapsed().as_secs_f64();
        let mut attached = begun.attached;
        attached.restore_seconds += begun.read_seconds;
        attached.to_compute = to_compute;
        seq.prefill = None;
        seq.attached = Some(attached);
        Ok(Some(attached))
    }

    /// Copies one restored block, the next of the prefix, into a fresh G1
    /// page of `id` and counts it; false when it cannot (another key than
    /// the next one, a block that does not fit a page, a full pool): the
    /// prefix ends there. A partial block (the tail) counts its tokens only
    /// and gets no key: it is keyed, and offered, once full.
    fn attach_block(&mut self, id: SeqId, block: StoredBlock) -> bool {
        let bt = self.opts.block_tokens;
        let Some(seq) = self.seqs.get(&id) else {
            return false;
        };
        let Some(begun) = seq.prefill.as_ref() else {
            return false;
        };
        let index = seq.table.len() - begun.first_read;
        if begun.keys.get(index) != Some(&block.key) {
            return false;
        }
        let tail = begun.tail.filter(|(k, _)| *k == block.key).map(|(_, n)| n);
        let key = block.key;
        let last = seq.table.last().copied();
        // A full block's place in the prefix, for the G1 index.
        let full_at = tail.is_none().then(|| {
            let parent = seq.keys.last().copied().unwrap_or_else(|| seq.chain.seed());
            (parent, seq.table.len() * bt)
        });
        let Ok(page) = self.alloc_page(last) else {
            return false;
        };
        let tokens = tail.unwrap_or(bt);
        // A tail comes back as a short block, of its rows alone.
        let layout = self.kv_layout.with_tokens(tokens as u32);
        if let Err(e) = self.pool.import(page, &layout, block.payload()) {
            tracing::warn!("restoring block {key} failed: {e}; recomputing");
            self.pool.release(page);
            self.pool.free(page);
            return false;
        }
        if let Some((parent, start)) = full_at
            && let Some(seq) = self.seqs.get(&id)
        {
            self.g1
                .insert(key, page, parent, &seq.tokens[start..start + bt]);
        }
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        if tail.is_none() {
            seq.keys.push(key);
        } else {
            // The store already holds this tail: no need to offer it again.
            seq.tail_stored = true;
        }
        seq.table.push(page);
        seq.computed += tokens;
        if let Some(begun) = seq.prefill.as_mut() {
            count_restored(
                &mut begun.attached,
                block.tier,
                tokens,
                block.payload().len() as u64,
            );
        }
        true
    }
}

/// Counts one restored block of `tokens` tokens and `bytes` stored bytes,
/// read from `tier`.
fn count_restored(a: &mut Attached, tier: Tier, tokens: usize, bytes: u64) {
    a.restored_bytes += bytes;
    match tier {
        Tier::G2 => a.cached.g2 += tokens,
        Tier::G3 => a.cached.g3 += tokens,
        Tier::G4 => a.cached.g4 += tokens,
    }
}
