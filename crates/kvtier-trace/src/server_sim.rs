//! A model of what `kvtier serve` itself caches, token by token, exact for
//! a client that sends one request at a time: [`ServerSim`] says, for each
//! request, how many prompt tokens the server serves from G1, G2 and G3
//! (its usage's `kvtier.cached_tokens`), from the server's own shape
//! ([`ServerShape`], read from its `/metrics`).
//!
//! [`crate::sim`] asks what a policy does with a trace's blocks at one
//! capacity; this asks what one server does with the very token ids it is
//! sent, so it follows the server's code, not a simplification of it:
//!
//! * **G1** (kvtier-engine's `serving/engine.rs`, `kv/prefix_cache.rs`,
//!   `kv/prefix_restore.rs`, `kv/kv_pool.rs`, and the scheduler's calls at
//!   concurrency 1): pages taken lowest-first (the page after a sequence's
//!   last when free), idle pages reclaimed least recently released first;
//!   a prompt's full blocks found by key, then the store asked for the rest
//!   and for its tail (layer-wise restores take their pages before the
//!   store is read), then a G1 page below the last block found copied token
//!   by token ("best child"); the last prompt token always computed; pages
//!   registered as they fill (the prompt's, then the generated tokens'),
//!   the prompt's tail offered under its partial key, a finished sequence's
//!   part-filled last page kept below its last full block.
//! * **The store** (kvtier-store's `store/mod.rs`, `tier_reads.rs`,
//!   `memory.rs`, `disk/slots.rs`, `write_back.rs`): what each scheduler step
//!   registered is offered as one batch (each block's parent the one before it
//!   in the batch); G2 counts every block, a tail's short block too, as one
//!   slot's buffer ([`ServerShape::block_bytes`]) under the store's own
//!   eviction policy
//!   ([`EvictionKind::build`](kvtier_store::eviction::EvictionKind::build)); a
//!   lookup touches every G2 hit, reads G3 up to the first block no tier holds
//!   and promotes G3 hits into G2; blocks G2 evicts that G3 lacks are written
//!   to G3's slots (weight 1 each, the same policy, no parents), 64 to a batch;
//!   the admission filter and the write-back queue's bound as the store applies
//!   them.
//! * **A clean restart** ([`ServerSim::restart`]): G1 and G2 start empty;
//!   the blocks only G2 held are written to G3 (oldest first); G3 comes
//!   back from its saved index, its policy refilled in slot order.
//!
//! # When it is exact
//!
//! One request at a time, each sent after the last one's answer, and:
//!
//! * `--g3-sync-ms 0`: the bounded write-back copies G2's blocks to G3 on a
//!   timer, so G3's contents would depend on when requests come;
//!   [`ServerSim::new`] refuses a shape with it on.
//! * The store's G3 writer is idle when the next request is looked up. It
//!   writes G2's evictions in the background: a lookup that comes first
//!   finds a block still queued (a G2 hit, not promoted) where it would
//!   otherwise find it in G3 (a G3 hit, promoted into G2). A client makes
//!   sure by waiting, after each answer, until `/metrics` shows
//!   `kvtier_server_sequences` at 0 in every state (the scheduler
//!   publishes them just after its last offer to the store; this holds
//!   for requests of two tokens or more, which published themselves
//!   running before their last step) and
//!   `kvtier_store_writeback_pending_blocks` at 0.
//! * G3 does not evict while requests run (it may when a restart writes
//!   G2's blocks to it: [`SimStats::g3_evicted_at_restart`]). What G3
//!   evicts for the blocks G2 evicts depends on the writer thread's
//!   timing: the writer merges the jobs queued while it was busy into one
//!   batch, whose blocks all take their slots before any enters G3's
//!   policy (kvtier's policy then adapts, CLOCK's hand sweeps, otherwise
//!   than for separate batches), and an offer reads G3's index (is the
//!   block in G3, so that G2 need not write it back later?) while a queued
//!   write may still evict that block. The simulator writes each job as
//!   its own batch, at once: it agrees with a server whose writer kept up.
//! * No G4 (shared with other servers), one tenant, and no stop strings
//!   (a stop string ends a sequence when the scheduler next notices).
//!
//! # Where it lives
//!
//! Here the simulated server itself ([`ServerSim`]: a request's restore,
//! compute, registration and offload, as the engine runs them); its shape
//! in `server_sim/shape.rs`, what it reports in `server_sim/outcome.rs`,
//! G1's pages and prefix index in `server_sim/g1.rs`, the store below them
//! in `server_sim/store.rs`.

mod g1;
mod outcome;
mod shape;
mod store;
#[cfg(test)]
mod tests;

use self::g1::{Key, KeyNames, Page, Pool, PrefixIndex, SEED};
pub use self::outcome::{BlockPlace, Ending, RequestError, SimStats, TierTokens};
pub use self::shape::{KV_CACHE_INFO, ServerShape};
use self::store::{Store, Tier};

/// One sequence while it runs.
#[derive(Debug)]
struct Seq {
    tokens: Vec<u32>,
    table: Vec<Page>,
    /// Tokens whose KV its pages hold.
    computed: usize,
    /// Keys of its full pages so far.
    keys: Vec<Key>,
    /// Its prompt's tail came from the store: not offered again.
    tail_stored: bool,
}

/// A store read begun for a prompt.
#[derive(Debug)]
struct Restore {
    /// The keys asked for: full blocks, then maybe the tail's.
    keys: Vec<Key>,
    /// The tail's key and length, when `keys` ends with it.
    tail: Option<(Key, usize)>,
    /// Where each of the leading keys found is.
    tiers: Vec<Tier>,
    /// A layer-wise read's pages, one per key, taken before the read.
    layered: Option<Vec<Page>>,
}

/// A layer-wise restore attached and not yet put in G1's index (the
/// engine does that after the first step's forward pass).
#[derive(Debug)]
struct Settle {
    first: usize,
    keys: Vec<Key>,
    tail: Option<Key>,
}

/// `kvtier serve`'s cache tiers at concurrency 1, token-exact (see the
/// module docs for what it follows and when it is exact).
#[derive(Debug)]
pub struct ServerSim {
    shape: ServerShape,
    keys: KeyNames,
    pool: Pool,
    g1: PrefixIndex,
    store: Option<Store>,
    /// Registered pages not offered to the store yet, with their keys.
    pending: Vec<(Key, Page)>,
    stats: SimStats,
}

impl ServerSim {
    /// A server of `shape`, just started on an empty cache directory.
    /// Refuses a shape it cannot follow exactly: G3 synced on a timer, or
    /// a G4 pool.
    pub fn new(shape: ServerShape) -> Result<Self, String> {
        if shape.block_tokens == 0 || shape.g1_pages == 0 {
            return Err("a server has at least one G1 page of at least one token".into());
        }
        let pages = Page::try_from(shape.g1_pages)
            .map_err(|_| format!("{} G1 pages are more than an engine has", shape.g1_pages))?;
        let store = match shape.store && shape.prefix_reuse {
            true => {
                if shape.g4 {
                    return Err("the server shares a G4 pool with others: what it holds is \
                         not this server's doing alone"
                        .into());
                }
                if shape.g3_slots > 0 && shape.g3_sync_ms != 0 {
                    return Err(format!(
                        "the server copies G2 to G3 every {} ms, so G3 depends on when \
                         requests come: run it with --g3-sync-ms 0",
                        shape.g3_sync_ms
                    ));
                }
                if shape.block_bytes == 0 {
                    return Err("a stored block takes some bytes: block_bytes is 0".into());
                }
                Some(Store::new(&shape)?)
            }
            false => None,
        };
        Ok(Self {
            keys: KeyNames::default(),
            pool: Pool::new(pages),
            g1: PrefixIndex::default(),
            store,
            pending: Vec::new(),
            stats: SimStats::default(),
            shape,
        })
    }

    /// The shape simulated.
    pub fn shape(&self) -> &ServerShape {
        &self.shape
    }

    /// What it did so far, and what each tier holds now.
    pub fn stats(&self) -> SimStats {
        let mut s = self.stats;
        s.g1_cached_pages = self.g1.idle.len();
        if let Some(store) = &self.store {
            s.g2_blocks = store.g2.len();
            s.g3_blocks = store.g3.as_ref().map_or(0, |g| g.index.len());
        }
        s
    }

    /// Where the store holds each block of `tokens`: its full blocks, then
    /// (when it does not end on a block boundary) the rest under its
    /// partial key, as a prompt of `tokens` and one more token stores its
    /// tail. For checking the simulated store against a server's, block by
    /// block.
    pub fn store_places(&self, tokens: &[u32]) -> Vec<BlockPlace> {
        let bt = self.shape.block_tokens;
        let mut out = Vec::with_capacity(tokens.len().div_ceil(bt));
        let mut prev = Some(SEED);
        let place = |key: Option<Key>| {
            let (Some(store), Some(k)) = (&self.store, key) else {
                return BlockPlace::default();
            };
            BlockPlace {
                g2: store.g2.contains_key(&k),
                g3: store.in_g3(&k),
            }
        };
        let mut blocks = tokens.chunks(bt);
        for block in blocks.by_ref() {
            let partial = block.len() < bt;
            let key = prev.and_then(|p| self.keys.get(p, partial, block));
            out.push(place(key));
            prev = key;
        }
        out
    }

    /// One request at concurrency 1: its prompt token ids and the token ids
    /// the server generated for it, ended by `max_tokens` (or sent with
    /// `ignore_eos`); the prompt tokens the server serves from each tier.
    /// Only for requests the server took (one refused by its checks, a
    /// prompt too long say, never reaches the cache). A request the server
    /// would fail ([`try_request`](Self::try_request)) reports what its
    /// prefix restore found.
    pub fn request(&mut self, prompt: &[u32], output: &[u32]) -> TierTokens {
        match self.try_request(prompt, output, Ending::Length) {
            Ok(hits) | Err(RequestError::PoolExhausted { hits }) => hits,
            Err(RequestError::EmptyPrompt) => TierTokens::default(),
        }
    }

    /// [`request`](Self::request) for any [`Ending`], telling apart the
    /// requests the server fails.
    pub fn try_request(
        &mut self,
        prompt: &[u32],
        output: &[u32],
        ending: Ending,
    ) -> Result<TierTokens, RequestError> {
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        self.stats.requests += 1;
        let mut seq = Seq {
            tokens: prompt.to_vec(),
            table: Vec::new(),
            computed: 0,
            keys: Vec::new(),
            tail_stored: false,
        };
        let reusable = prompt.len() - 1;
        let mut hits = TierTokens::default();
        let restore = match self.shape.prefix_reuse {
            true => self.find_cached(&mut seq, &mut hits),
            false => None,
        };
        let mut settle = None;
        match restore {
            Some(Restore {
                keys,
                tail,
                tiers,
                layered: Some(pages),
            }) => {
                settle = Some(self.attach_layered(&mut seq, (keys, tail, tiers), pages, &mut hits));
            }
            other => {
                if let Some(r) = other {
                    self.attach_blocks(&mut seq, r, &mut hits);
                }
                // What the store lacked of the tail, a G1 page may hold.
                hits.g1 += self.attach_g1_tail(&mut seq, reusable);
            }
        }
        let done = self.compute(&mut seq, &mut settle, output, ending);
        self.finish(seq, settle);
        self.offload();
        if done.is_err() {
            self.stats.failed += 1;
            return Err(RequestError::PoolExhausted { hits });
        }
        Ok(hits)
    }

    /// The server stopped cleanly (SIGTERM, ctrl-c) and started again on
    /// the same cache directory: G1 and G2 empty, G3 as the stop left it.
    pub fn restart(&mut self) {
        self.offload();
        if let Some(store) = &mut self.store {
            store.restart(&mut self.stats);
        }
        self.pool = Pool::new(self.pool.refs.len() as Page);
        self.g1 = PrefixIndex::default();
    }

    /// Keys of the full blocks of `tokens`.
    fn chain_keys(&mut self, tokens: &[u32]) -> Vec<Key> {
        let mut prev = SEED;
        tokens
            .chunks_exact(self.shape.block_tokens)
            .map(|b| {
                prev = self.keys.name(prev, false, b);
                prev
            })
            .collect()
    }

    /// A page, reclaiming the least recently idle cached one when none is
    /// free (`Engine::alloc_page`).
    fn alloc_page(&mut self, after: Option<Page>) -> Option<Page> {
        if let Some(p) = self.pool.alloc(after) {
            return Some(p);
        }
        let p = self.g1.reclaim()?;
        self.stats.g1_reclaimed += 1;
        self.pool.free(p);
        self.pool.alloc(after)
    }

    fn release_page(&mut self, page: Page) {
        if self.pool.release(page) {
            if self.g1.holds(page) {
                self.g1.mark_idle(page);
            } else {
                self.pool.free(page);
            }
        }
    }

    /// `Engine::begin`'s look for the prompt's prefix: G1's pages by key,
    /// then one store read of the rest with the tail, or the tail from a
    /// G1 page when G1 holds all of it.
    fn find_cached(&mut self, seq: &mut Seq, hits: &mut TierTokens) -> Option<Restore> {
        let bt = self.shape.block_tokens;
        let reusable = seq.tokens.len() - 1;
        let full = reusable / bt;
        let keys = self.chain_keys(&seq.tokens[..full * bt]);
        let tail_len = reusable - full * bt;
        let tail = (tail_len > 0).then(|| {
            let prev = keys.last().copied().unwrap_or(SEED);
            let key = self.keys.name(prev, true, &seq.tokens[full * bt..reusable]);
            (key, tail_len)
        });
        for key in &keys {
            let Some(page) = self.g1.get(key) else { break };
            self.pool.retain(page);
            self.g1.mark_busy(page);
            seq.table.push(page);
        }
        let h = seq.table.len();
        seq.keys = keys[..h].to_vec();
        seq.computed = h * bt;
        hits.g1 = h * bt;
        let mut rest = keys[h..].to_vec();
        let g1_covers =
            rest.is_empty() && self.g1_tail(seq, reusable).map_or(0, |(_, n)| n) == tail_len;
        if self.store.is_some() && !g1_covers && (!rest.is_empty() || tail.is_some()) {
            if let Some((k, _)) = tail {
                rest.push(k);
            }
            let layered = self.layer_pages(seq, rest.len());
            let store = self.store.as_mut()?;
            let tiers = store.fetch(&rest, &mut self.stats);
            return Some(Restore {
                keys: rest,
                tail,
                tiers,
                layered,
            });
        }
        hits.g1 += self.attach_g1_tail(seq, reusable);
        None
    }

    /// Pages for a layer-wise read of `n` blocks, or `None` (the read is
    /// whole-block, its blocks copied in as pages allow).
    fn layer_pages(&mut self, seq: &Seq, n: usize) -> Option<Vec<Page>> {
        if !self.shape.layerwise_restore || n == 0 {
            return None;
        }
        let mut last = seq.table.last().copied();
        let mut pages = Vec::with_capacity(n);
        for _ in 0..n {
            match self.alloc_page(last) {
                Some(p) => {
                    pages.push(p);
                    last = Some(p);
                }
                None => {
                    for p in pages {
                        self.pool.release(p);
                        self.pool.free(p);
                    }
                    return None;
                }
            }
        }
        Some(pages)
    }

    /// The G1 page below `seq`'s last full block that shares the most of
    /// its next tokens (up to `upto`), and how many.
    fn g1_tail(&self, seq: &Seq, upto: usize) -> Option<(Page, usize)> {
        let bt = self.shape.block_tokens;
        if seq.computed >= upto || !seq.computed.is_multiple_of(bt) {
            return None;
        }
        let parent = seq.keys.last().copied().unwrap_or(SEED);
        self.g1.best_child(&parent, &seq.tokens[seq.computed..upto])
    }

    /// Copies those tokens into a fresh page of `seq`; how many (0 also
    /// when no page is free for the copy).
    fn attach_g1_tail(&mut self, seq: &mut Seq, upto: usize) -> usize {
        let Some((src, n)) = self.g1_tail(seq, upto) else {
            return 0;
        };
        self.pool.retain(src);
        self.g1.mark_busy(src);
        let copied = match self.alloc_page(seq.table.last().copied()) {
            Some(dst) => {
                seq.table.push(dst);
                seq.computed += n;
                n
            }
            None => 0,
        };
        self.release_page(src);
        copied
    }

    /// `Engine::attach_layered`: the found blocks' pages into the table,
    /// the rest handed back, then a G1 page for what the store lacked of
    /// the tail; the blocks go into G1's index at the first step.
    fn attach_layered(
        &mut self,
        seq: &mut Seq,
        (keys, tail, tiers): (Vec<Key>, Option<(Key, usize)>, Vec<Tier>),
        pages: Vec<Page>,
        hits: &mut TierTokens,
    ) -> Settle {
        let bt = self.shape.block_tokens;
        let first = seq.table.len();
        let n = tiers.len().min(keys.len()).min(pages.len());
        for i in 0..n {
            let key = keys[i];
            let tail_len = tail.filter(|(k, _)| *k == key).map(|(_, n)| n);
            seq.table.push(pages[i]);
            match tail_len {
                None => seq.keys.push(key),
                Some(_) => seq.tail_stored = true,
            }
            let tokens = tail_len.unwrap_or(bt);
            seq.computed += tokens;
            count(hits, tiers[i], tokens);
        }
        for &p in &pages[n..] {
            self.pool.release(p);
            self.pool.free(p);
        }
        let reusable = seq.tokens.len() - 1;
        hits.g1 += self.attach_g1_tail(seq, reusable);
        Settle {
            first,
            keys: keys[..n].to_vec(),
            tail: tail.map(|(k, _)| k),
        }
    }

    /// `Engine::settle_layered` once the read checked out: the restored
    /// full blocks into G1's index.
    fn settle(&mut self, seq: &Seq, s: Settle) {
        let bt = self.shape.block_tokens;
        for (i, &key) in s.keys.iter().enumerate() {
            if s.tail == Some(key) {
                continue;
            }
            let at = s.first + i;
            let parent = match at.checked_sub(1) {
                Some(p) => seq.keys.get(p).copied().unwrap_or(SEED),
                None => SEED,
            };
            let (Some(&page), Some(tokens)) =
                (seq.table.get(at), seq.tokens.get(at * bt..(at + 1) * bt))
            else {
                continue;
            };
            self.g1.insert(key, page, parent, tokens);
        }
    }

    /// `Engine::attach_some` of a whole-block read: each block found into
    /// a fresh page (and G1's index), until a page is not to be had.
    fn attach_blocks(&mut self, seq: &mut Seq, r: Restore, hits: &mut TierTokens) {
        let bt = self.shape.block_tokens;
        for (&key, &tier) in r.keys.iter().zip(&r.tiers) {
            let tail_len = r.tail.filter(|(k, _)| *k == key).map(|(_, n)| n);
            let full_at = tail_len.is_none().then(|| {
                let parent = seq.keys.last().copied().unwrap_or(SEED);
                (parent, seq.table.len() * bt)
            });
            let Some(page) = self.alloc_page(seq.table.last().copied()) else {
                return;
            };
            if let Some((parent, start)) = full_at
                && let Some(tokens) = seq.tokens.get(start..start + bt)
            {
                self.g1.insert(key, page, parent, tokens);
            }
            match tail_len {
                None => seq.keys.push(key),
                Some(_) => seq.tail_stored = true,
            }
            seq.table.push(page);
            let tokens = tail_len.unwrap_or(bt);
            seq.computed += tokens;
            count(hits, tier, tokens);
        }
    }

    /// Pages for `seq`'s first `upto` tokens (`Engine::ensure_pages`); Err
    /// when G1 has none left (the pages taken stay in the table).
    fn ensure_pages(&mut self, seq: &mut Seq, upto: usize) -> Result<(), ()> {
        let need = upto.div_ceil(self.shape.block_tokens);
        while seq.table.len() < need {
            let page = self.alloc_page(seq.table.last().copied()).ok_or(())?;
            seq.table.push(page);
        }
        Ok(())
    }

    /// The scheduler's steps for one sequence alone: its prompt a page at a
    /// time, then each generated token fed back but the last sent (or
    /// every one, when a stop token ended it); the store offered each
    /// step's new pages before the next step. Err when G1 runs out.
    fn compute(
        &mut self,
        seq: &mut Seq,
        settle: &mut Option<Settle>,
        output: &[u32],
        ending: Ending,
    ) -> Result<(), ()> {
        let bt = self.shape.block_tokens;
        let fed = match ending {
            Ending::Length => output.len().saturating_sub(1),
            Ending::StopToken => output.len(),
        };
        let n = seq.tokens.len();
        while seq.computed < n {
            let end = n.min((seq.computed / bt + 1) * bt);
            self.ensure_pages(seq, end)?;
            if let Some(s) = settle.take() {
                self.settle(seq, s);
            }
            seq.computed = end;
            self.register_full_pages(seq);
            if end == n {
                self.offer_prompt_tail(seq);
            }
            // The last step of a finished request is offered after it ends.
            if end < n || fed > 0 {
                self.offload();
            }
        }
        for (i, &t) in output.iter().take(fed).enumerate() {
            seq.tokens.push(t);
            let len = seq.tokens.len();
            if self.ensure_pages(seq, len).is_err() {
                seq.tokens.pop();
                return Err(());
            }
            seq.computed = len;
            self.register_full_pages(seq);
            if i + 1 < fed {
                self.offload();
            }
        }
        Ok(())
    }

    /// `Engine::register_full_pages`: newly full pages into G1's index and,
    /// when new there, queued for the store.
    fn register_full_pages(&mut self, seq: &mut Seq) {
        if !self.shape.prefix_reuse {
            return;
        }
        let bt = self.shape.block_tokens;
        let full = seq.computed / bt;
        while seq.keys.len() < full {
            let i = seq.keys.len();
            let prev = seq.keys.last().copied().unwrap_or(SEED);
            let (Some(tokens), Some(&page)) =
                (seq.tokens.get(i * bt..(i + 1) * bt), seq.table.get(i))
            else {
                return;
            };
            let key = self.keys.name(prev, false, tokens);
            seq.keys.push(key);
            if self.g1.insert(key, page, prev, tokens) && self.store.is_some() {
                self.pool.retain(page);
                self.pending.push((key, page));
            }
        }
    }

    /// `Engine::offer_prompt_tail`: the page holding the prompt's tail,
    /// queued for the store under the tail's partial key.
    fn offer_prompt_tail(&mut self, seq: &Seq) {
        let bt = self.shape.block_tokens;
        if !self.shape.prefix_reuse || self.store.is_none() {
            return;
        }
        let reusable = seq.tokens.len().saturating_sub(1);
        let full = reusable / bt;
        if seq.tail_stored || reusable == full * bt || seq.keys.len() < full {
            return;
        }
        let Some(&page) = seq.table.get(full) else {
            return;
        };
        let prev = match full {
            0 => SEED,
            _ => seq.keys.get(full - 1).copied().unwrap_or(SEED),
        };
        let key = self.keys.name(prev, true, &seq.tokens[full * bt..reusable]);
        self.pool.retain(page);
        self.pending.push((key, page));
    }

    /// `Engine::offload_pending`: the queued pages offered to the store as
    /// one batch, then let go.
    fn offload(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        if pending.is_empty() {
            return;
        }
        if let Some(store) = &mut self.store {
            let keys: Vec<Key> = pending.iter().map(|&(k, _)| k).collect();
            store.offer(&keys, &mut self.stats);
        }
        for (_, page) in pending {
            self.release_page(page);
        }
    }

    /// `Engine::finish`: a layer-wise restore still unsettled goes into
    /// G1's index, the part-filled last page stays below the last full
    /// one, and every page is let go.
    fn finish(&mut self, seq: Seq, settle: Option<Settle>) {
        if let Some(s) = settle {
            self.settle(&seq, s);
        }
        let bt = self.shape.block_tokens;
        let full = seq.computed / bt;
        if self.shape.prefix_reuse
            && seq.keys.len() == full
            && seq.computed > full * bt
            && let Some(&page) = seq.table.get(full)
        {
            let parent = seq.keys.last().copied().unwrap_or(SEED);
            self.g1
                .insert_partial(page, parent, &seq.tokens[full * bt..seq.computed]);
        }
        for page in seq.table {
            self.release_page(page);
        }
    }
}

/// Counts `tokens` restored from `tier`.
fn count(hits: &mut TierTokens, tier: Tier, tokens: usize) {
    match tier {
        Tier::G2 => hits.g2 += tokens,
        Tier::G3 => hits.g3 += tokens,
    }
}
