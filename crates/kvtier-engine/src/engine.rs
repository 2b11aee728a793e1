//! The engine: a model, its G1 page pool, the G1 prefix index, and the
//! tiered store below it.
//!
//! For each prompt: keys of its full blocks -> G1 hits -> one
//! `read_prefix_async` of the rest from the store ([`Engine::begin`]): the
//! store's reader threads look each key up once, read G3 and G4 with all
//! reads in flight and verify every block, while the caller's thread goes
//! on (the scheduler keeps decoding other sequences) -> once the read is
//! done ([`Engine::restore_done`]), [`Engine::complete`] copies the blocks
//! into G1 pages (one copy each) and computes only the uncached suffix, in
//! page-sized chunks. [`Engine::prefill`] is both at once.
//!
//! New full pages are exported straight into store block buffers and
//! offered to the store ([`TieredStore::offer`]), after the step's tokens
//! were sent: never on the time-to-first-token path, and never waiting on
//! the disk (the store's write-back queue takes them, or drops and counts
//! them when it is full). With `prefix_reuse` off the engine recomputes
//! every prompt (the baseline) and neither reads nor writes cached KV.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use candle_core::{DType, Device};
use kvtier_store::{
    BlockKey, DiskConfig, Handle, KeyChain, ModelFingerprint, StoreConfig, StoredBlock, Tier,
    TieredStore,
};

use crate::engine_error::EngineError;
use crate::kv_pool::{KvPool, PageId};
use crate::model::{Model, Segment};
use crate::model_config::ModelConfig;
use crate::prefix_cache::PrefixCache;
use crate::weights::Weights;

/// How to build an [`Engine`].
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Tokens per KV block / G1 page.
    pub block_tokens: usize,
    /// G1 pages.
    pub pool_pages: usize,
    /// Longest sequence (prompt + generated) served.
    pub max_seq_tokens: usize,
    /// Reuse cached prefixes (off: recompute everything, the baseline).
    pub prefix_reuse: bool,
    /// Keeps one tenant's prefixes invisible to another.
    pub tenant_salt: Vec<u8>,
    /// Where tensors live.
    pub device: Device,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            block_tokens: 256,
            pool_pages: 256,
            max_seq_tokens: 8192,
            prefix_reuse: true,
            tenant_salt: Vec::new(),
            device: Device::Cpu,
        }
    }
}

/// The store the engine opens below G1 (its layout and fingerprint come
/// from the model).
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// G2 bytes.
    pub memory_bytes: u64,
    /// G3 directories (none: no G3).
    pub disk_dirs: Vec<PathBuf>,
    /// G3 bytes.
    pub disk_bytes: u64,
    /// G4, a pool shared with other nodes (none: no G4).
    pub remote: Option<kvtier_store::RemoteConfig>,
}

/// Identifies a sequence inside the engine.
pub type SeqId = u64;

/// Prompt tokens served from cache, by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CachedTokens {
    /// From G1 pages.
    pub g1: usize,
    /// From host memory.
    pub g2: usize,
    /// From disk.
    pub g3: usize,
    /// From the shared pool.
    pub g4: usize,
}

impl CachedTokens {
    /// All cached prompt tokens.
    pub fn total(&self) -> usize {
        self.g1 + self.g2 + self.g3 + self.g4
    }
}

/// What a prefill did.
#[derive(Debug, Clone)]
pub struct Prefill {
    /// The new sequence.
    pub seq: SeqId,
    /// Logits of the last prompt token.
    pub logits: Vec<f32>,
    /// Prompt tokens not recomputed.
    pub cached: CachedTokens,
    /// KV bytes restored from the store.
    pub restored_bytes: u64,
    /// Seconds spent restoring from the store (lookup, reads, copies).
    pub restore_seconds: f64,
    /// Prompt tokens computed.
    pub computed_tokens: usize,
}

#[derive(Debug)]
struct Seq {
    tokens: Vec<u32>,
    table: Vec<PageId>,
    /// Tokens whose KV is in `table`.
    computed: usize,
    /// Keys of the full pages registered so far.
    keys: Vec<BlockKey>,
    /// A prefill begun and not completed yet.
    prefill: Option<Begun>,
}

/// What [`Engine::begin`] started for a sequence.
#[derive(Debug)]
struct Begun {
    /// When `begin` was called.
    started: Instant,
    /// Prompt tokens attached from G1 pages.
    cached: CachedTokens,
    /// Keys of the usable blocks past the G1 hits, being read from the store.
    keys: Vec<BlockKey>,
    /// The store read of `keys`, if one was needed.
    read: Option<Handle<Vec<StoredBlock>>>,
    /// When that read finished (set by its completion callback).
    read_done: Arc<OnceLock<Instant>>,
}

/// The inference engine. Single-threaded: the scheduler owns it.
pub struct Engine {
    model: Model,
    pool: KvPool,
    g1: PrefixCache,
    keychain: KeyChain,
    fingerprint: ModelFingerprint,
    store: Option<TieredStore>,
    opts: EngineOptions,
    seqs: HashMap<SeqId, Seq>,
    next_id: SeqId,
    /// Full pages registered but not yet copied out to the store.
    pending_offload: Vec<(BlockKey, PageId)>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", self.model.config())
            .field("opts", &self.opts)
            .field("sequences", &self.seqs.len())
            .finish()
    }
}

impl Engine {
    /// Loads the model in `dir` and opens the store below G1 (`None`: G1 only).
    pub fn load(
        dir: &Path,
        opts: EngineOptions,
        store: Option<StoreOptions>,
    ) -> Result<Self, EngineError> {
        let cfg = ModelConfig::from_dir(dir)?;
        let mut weights = Weights::load(dir, &opts.device, DType::F32)?;
        let fingerprint = weights.fingerprint(dir)?;
        let layout = cfg.kv_layout(opts.block_tokens);
        let model = Model::new(cfg, &mut weights, opts.max_seq_tokens, &opts.device)?;
        let store = match store {
            Some(so) => {
                let mut sc = StoreConfig::new(layout, fingerprint);
                sc.memory_bytes = so.memory_bytes;
                if !so.disk_dirs.is_empty() {
                    sc.disk = Some(DiskConfig::new(so.disk_dirs, so.disk_bytes, layout));
                }
                sc.remote = so.remote;
                Some(TieredStore::open(sc)?)
            }
            None => None,
        };
        Self::with_model(model, fingerprint, opts, store)
    }

    /// Builds an engine around a loaded model.
    pub fn with_model(
        model: Model,
        fingerprint: ModelFingerprint,
        opts: EngineOptions,
        store: Option<TieredStore>,
    ) -> Result<Self, EngineError> {
        let cfg = model.config().clone();
        if opts.block_tokens == 0 || opts.pool_pages == 0 {
            return Err(EngineError::Request(
                "block_tokens and pool_pages must be positive".into(),
            ));
        }
        let layout = cfg.kv_layout(opts.block_tokens);
        if let Some(s) = &store {
            if s.layout() != layout {
                return Err(EngineError::Request(format!(
                    "store layout {} does not match the model's {layout}",
                    s.layout()
                )));
            }
            if s.fingerprint() != fingerprint {
                return Err(EngineError::Request(
                    "store opened for another model fingerprint".into(),
                ));
            }
        }
        let pool = KvPool::new(
            cfg.num_hidden_layers,
            cfg.kv_heads(),
            cfg.head_dim(),
            opts.block_tokens,
            opts.pool_pages,
            &opts.device,
        )?;
        let keychain = KeyChain::new(&fingerprint, &layout, &opts.tenant_salt);
        Ok(Self {
            model,
            pool,
            g1: PrefixCache::default(),
            keychain,
            fingerprint,
            store,
            opts,
            seqs: HashMap::new(),
            next_id: 1,
            pending_offload: Vec::new(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The options.
    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// The model fingerprint.
    pub fn fingerprint(&self) -> ModelFingerprint {
        self.fingerprint
    }

    /// The store, when one is attached.
    pub fn store(&self) -> Option<&TieredStore> {
        self.store.as_ref()
    }

    /// Turns prefix reuse on or off (off = the recompute baseline).
    pub fn set_prefix_reuse(&mut self, on: bool) {
        self.opts.prefix_reuse = on;
    }

    /// Keys of the full blocks of `tokens` under this engine's chain.
    pub fn block_keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        self.keychain.keys(tokens)
    }

    /// Free G1 pages (including idle cached ones that can be reclaimed).
    pub fn free_pages(&self) -> usize {
        self.pool.free_pages() + self.g1.idle_pages()
    }

    /// Drops every idle cached G1 page, so later prompts must come from the
    /// store (or be recomputed). Pages of live sequences stay.
    pub fn evict_g1(&mut self) {
        while let Some(page) = self.g1.reclaim() {
            self.pool.free(page);
        }
    }

    fn alloc_page(&mut self) -> Result<PageId, EngineError> {
        if let Some(p) = self.pool.alloc() {
            return Ok(p);
        }
        if let Some(p) = self.g1.reclaim() {
            self.pool.free(p);
            if let Some(p) = self.pool.alloc() {
                return Ok(p);
            }
        }
        Err(EngineError::PoolExhausted(format!(
            "all {} pages are in use by live sequences",
            self.pool.pages()
        )))
    }

    fn ensure_pages(&mut self, id: SeqId, upto: usize) -> Result<(), EngineError> {
        let bt = self.opts.block_tokens;
        let need = upto.div_ceil(bt);
        loop {
            let have = self.seqs.get(&id).map_or(0, |s| s.table.len());
            if have >= need {
                return Ok(());
            }
            let page = self.alloc_page()?;
            if let Some(s) = self.seqs.get_mut(&id) {
                s.table.push(page);
            }
        }
    }

    /// Starts a sequence: restores what it can of the prompt's prefix and
    /// computes the rest. Returns the last prompt token's logits.
    /// [`begin`](Self::begin) and [`complete`](Self::complete) in one call,
    /// waiting for the store read in between.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Prefill, EngineError> {
        let id = self.begin(prompt, || {})?;
        self.complete(id)
    }

    /// Starts a sequence without waiting on the store: checks the prompt,
    /// attaches the G1 pages of its cached prefix and starts one background
    /// read of the rest of the prefix from the store. `on_restored` runs
    /// (on a store thread) once that read is done, or at once when none was
    /// needed; until then [`restore_done`](Self::restore_done) is false.
    /// Finish with [`complete`](Self::complete) (or [`finish`](Self::finish)
    /// to give up).
    pub fn begin(
        &mut self,
        prompt: &[u32],
        on_restored: impl FnOnce() + Send + 'static,
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
        let started = Instant::now();
        let mut seq = Seq {
            tokens: prompt.to_vec(),
            table: Vec::new(),
            computed: 0,
            keys: Vec::new(),
            prefill: None,
        };
        let mut begun = Begun {
            started,
            cached: CachedTokens::default(),
            keys: Vec::new(),
            read: None,
            read_done: Arc::new(OnceLock::new()),
        };
        let read_done = begun.read_done.clone();
        let mut notify: Option<Box<dyn FnOnce() + Send>> = Some(Box::new(move || {
            let _ = read_done.set(Instant::now());
            on_restored();
        }));
        if self.opts.prefix_reuse {
            // Never the block holding the last prompt token: its logits must
            // be computed.
            let bt = self.opts.block_tokens;
            let usable = (prompt.len() - 1) / bt;
            let keys = self.keychain.keys(&prompt[..usable * bt]);
            for key in &keys {
                let Some(page) = self.g1.get(key) else { break };
                self.pool.retain(page);
                self.g1.mark_busy(page);
                seq.table.push(page);
                begun.cached.g1 += bt;
            }
            seq.keys = keys[..seq.table.len()].to_vec();
            seq.computed = seq.table.len() * bt;
            let rest = keys[seq.table.len()..].to_vec();
            if let Some(store) = &self.store
                && !rest.is_empty()
                && let Some(notify) = notify.take()
            {
                begun.read = Some(store.read_prefix_async(rest.clone(), notify));
                begun.keys = rest;
            }
        }
        seq.prefill = Some(begun);
        self.seqs.insert(id, seq);
        if let Some(notify) = notify {
            notify();
        }
        Ok(id)
    }

    /// True once the store read [`begin`](Self::begin) started for `id` is
    /// done (or none was needed): [`complete`](Self::complete) will not wait
    /// on the store.
    pub fn restore_done(&self, id: SeqId) -> bool {
        self.seqs
            .get(&id)
            .and_then(|s| s.prefill.as_ref())
            .and_then(|b| b.read.as_ref())
            .is_none_or(Handle::is_done)
    }

    /// Completes a prefill begun with [`begin`](Self::begin): takes the
    /// blocks the store read (waiting for it if it is still running) into
    /// G1 pages and computes the rest of the prompt. On an error the
    /// sequence is finished.
    pub fn complete(&mut self, id: SeqId) -> Result<Prefill, EngineError> {
        match self.complete_inner(id) {
            Ok(p) => Ok(p),
            Err(e) => {
                self.finish(id);
                Err(e)
            }
        }
    }

    fn complete_inner(&mut self, id: SeqId) -> Result<Prefill, EngineError> {
        let begun = self
            .seqs
            .get_mut(&id)
            .and_then(|s| s.prefill.take())
            .ok_or_else(|| EngineError::Request(format!("sequence {id} has no prefill begun")))?;
        let mut cached = begun.cached;
        let mut restored_bytes = 0;
        let mut restore_seconds = 0.0;
        if let Some(read) = begun.read {
            let blocks = read.wait().unwrap_or_default();
            // The read's own time (not how long the caller took to come
            // back for it), plus the copies into G1.
            let read_done = begun.read_done.get().copied().unwrap_or_else(Instant::now);
            let t = Instant::now();
            restored_bytes = self.attach_restored(id, &begun.keys, blocks, &mut cached);
            restore_seconds =
                read_done.duration_since(begun.started).as_secs_f64() + t.elapsed().as_secs_f64();
        }
        let bt = self.opts.block_tokens;
        let len = self.seqs.get(&id).map_or(0, |s| s.tokens.len());
        let mut start = self.seqs.get(&id).map_or(0, |s| s.computed);
        let computed_tokens = len - start;
        let mut logits = Vec::new();
        while start < len {
            let end = len.min((start / bt + 1) * bt);
            self.ensure_pages(id, end)?;
            let seq = self
                .seqs
                .get(&id)
                .ok_or_else(|| EngineError::Request("sequence vanished".into()))?;
            let seg = Segment {
                tokens: &seq.tokens[start..end],
                start,
                table: &seq.table,
            };
            let out = self.model.forward(&self.pool, &[seg])?;
            if end == len {
                logits = out.get(0)?.to_vec1::<f32>()?;
            }
            if let Some(s) = self.seqs.get_mut(&id) {
                s.computed = end;
            }
            start = end;
        }
        self.register_full_pages(id)?;
        Ok(Prefill {
            seq: id,
            logits,
            cached,
            restored_bytes,
            restore_seconds,
            computed_tokens,
        })
    }

    /// Copies the restored `blocks` (the leading blocks of `keys`, as the
    /// store read them) into fresh G1 pages of `id`, each in one copy, and
    /// counts them in `cached`; returns the bytes restored. A block that
    /// does not fit a page, or a full pool, ends the prefix there: the rest
    /// is recomputed.
    fn attach_restored(
        &mut self,
        id: SeqId,
        keys: &[BlockKey],
        blocks: Vec<StoredBlock>,
        cached: &mut CachedTokens,
    ) -> u64 {
        let bt = self.opts.block_tokens;
        let mut bytes = 0u64;
        let mut pages = Vec::new();
        for (key, block) in keys.iter().zip(blocks) {
            if block.key != *key {
                break;
            }
            let Ok(page) = self.alloc_page() else { break };
            if let Err(e) = self.pool.import(page, block.payload()) {
                tracing::warn!("restoring block {key} failed: {e}; recomputing");
                self.pool.release(page);
                self.pool.free(page);
                break;
            }
            self.g1.insert(*key, page);
            pages.push((*key, page));
            bytes += block.payload().len() as u64;
            match block.tier {
                Tier::G2 => cached.g2 += bt,
                Tier::G3 => cached.g3 += bt,
                Tier::G4 => cached.g4 += bt,
            }
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            for (key, page) in pages {
                seq.keys.push(key);
                seq.table.push(page);
            }
            seq.computed = seq.table.len() * bt;
        }
        bytes
    }

    /// Registers newly full pages in G1 and queues them for the store.
    fn register_full_pages(&mut self, id: SeqId) -> Result<(), EngineError> {
        if !self.opts.prefix_reuse {
            return Ok(());
        }
        let bt = self.opts.block_tokens;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Ok(());
        };
        let full = seq.computed / bt;
        let mut new = Vec::new();
        while seq.keys.len() < full {
            let i = seq.keys.len();
            let prev = seq
                .keys
                .last()
                .copied()
                .unwrap_or_else(|| self.keychain.seed());
            let key = self.keychain.next(&prev, &seq.tokens[i * bt..(i + 1) * bt]);
            seq.keys.push(key);
            let page = seq.table[i];
            if self.g1.insert(key, page) {
                new.push((key, page));
            }
        }
        if self.store.is_some() {
            // Copied out later by `offload_pending`, after the caller has
            // emitted its token: the copy stays off the TTFT path. The extra
            // reference keeps the page from being reclaimed meanwhile.
            for (key, page) in new {
                self.pool.retain(page);
                self.pending_offload.push((key, page));
            }
        }
        Ok(())
    }

    /// Exports the full pages registered since the last call straight into
    /// store block buffers and offers them to the store (which never waits:
    /// see [`TieredStore::offer`]). The scheduler calls it after each step's
    /// tokens are sent; [`Engine::flush_offload`] calls it too.
    pub fn offload_pending(&mut self) -> Result<(), EngineError> {
        let pending = std::mem::take(&mut self.pending_offload);
        let Some(store) = &self.store else {
            for (_, page) in pending {
                self.release_page(page);
            }
            return Ok(());
        };
        let mut blocks = Vec::with_capacity(pending.len());
        let mut failed = None;
        for &(key, page) in &pending {
            let exported = store
                .new_block()
                .map_err(EngineError::from)
                .and_then(|mut b| {
                    self.pool.export_into(page, b.payload_mut())?;
                    Ok(b)
                });
            match exported {
                Ok(b) => blocks.push((key, b)),
                Err(e) => failed = Some(e),
            }
        }
        if !blocks.is_empty() {
            store.offer(blocks);
        }
        for (_, page) in pending {
            self.release_page(page);
        }
        failed.map_or(Ok(()), Err)
    }

    /// Drops one reference; an unreferenced page stays cached in G1 when it
    /// holds a registered block, and is freed otherwise.
    fn release_page(&mut self, page: PageId) {
        if self.pool.release(page) {
            if self.g1.holds(page) {
                self.g1.mark_idle(page);
            } else {
                self.pool.free(page);
            }
        }
    }

    /// One decode step for several sequences at once: appends each given
    /// token and returns each sequence's next-token logits.
    pub fn decode(&mut self, steps: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>, EngineError> {
        // Check every sequence before touching any, so a failure leaves the
        // whole batch as it was and each sequence can be retried alone.
        for &(id, _) in steps {
            let seq = self
                .seqs
                .get(&id)
                .ok_or_else(|| EngineError::Request(format!("unknown sequence {id}")))?;
            if seq.computed != seq.tokens.len() {
                return Err(EngineError::Request(format!(
                    "sequence {id} is not ready to decode"
                )));
            }
            if seq.tokens.len() + 1 >= self.model.max_positions() {
                return Err(EngineError::Request(format!(
                    "sequence {id} reached the context limit"
                )));
            }
        }
        for (i, &(id, token)) in steps.iter().enumerate() {
            let pos = match self.seqs.get_mut(&id) {
                Some(seq) => {
                    seq.tokens.push(token);
                    seq.tokens.len()
                }
                None => continue,
            };
            if let Err(e) = self.ensure_pages(id, pos) {
                // Undo the tokens appended so far (pages already taken stay
                // in their tables and serve the next attempt).
                for &(done, _) in &steps[..=i] {
                    if let Some(seq) = self.seqs.get_mut(&done) {
                        seq.tokens.pop();
                    }
                }
                return Err(e);
            }
        }
        let mut segs = Vec::with_capacity(steps.len());
        for &(id, _) in steps {
            let seq = self
                .seqs
                .get(&id)
                .ok_or_else(|| EngineError::Request(format!("unknown sequence {id}")))?;
            let pos = seq.tokens.len() - 1;
            segs.push(Segment {
                tokens: &seq.tokens[pos..],
                start: pos,
                table: &seq.table,
            });
        }
        let logits = self.model.forward(&self.pool, &segs)?;
        let mut out = Vec::with_capacity(steps.len());
        for (i, &(id, _)) in steps.iter().enumerate() {
            out.push(logits.get(i)?.to_vec1::<f32>()?);
            if let Some(s) = self.seqs.get_mut(&id) {
                s.computed = s.tokens.len();
            }
            self.register_full_pages(id)?;
        }
        Ok(out)
    }

    /// Ends a sequence. Its full pages stay in G1 for reuse until reclaimed.
    pub fn finish(&mut self, id: SeqId) {
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        if let Some(read) = seq.prefill.and_then(|b| b.read) {
            read.cancel();
        }
        for page in seq.table {
            self.release_page(page);
        }
    }

    /// Hands every block registered so far to the store.
    pub fn flush_offload(&mut self) -> Result<(), EngineError> {
        self.offload_pending()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Err(e) = self.offload_pending() {
            tracing::warn!("copying KV blocks for the store at shutdown failed: {e}");
        }
    }
}
