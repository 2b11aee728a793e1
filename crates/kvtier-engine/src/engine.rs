//! The engine: a model, its G1 page pool, the G1 prefix index, and the
//! tiered store below it.
//!
//! For each prompt: keys of its full blocks -> G1 hits -> the store's
//! `lookup_prefix` -> one batched `get_many` whose blocks are copied into G1
//! pages -> compute only the uncached suffix, in page-sized chunks. New full
//! blocks are copied out of G1 and handed to a background thread that puts
//! them into the store: never on the time-to-first-token path. With
//! `prefix_reuse` off the engine recomputes every prompt (the baseline) and
//! neither reads nor writes cached KV.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use candle_core::{DType, Device};
use kvtier_store::{
    BlockKey, DiskConfig, KeyChain, ModelFingerprint, StoreConfig, Tier, TieredStore,
};

use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::kv_pool::{KvPool, PageId};
use crate::model::{Model, Segment};
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
}

enum Offload {
    Put(Vec<(BlockKey, Vec<u8>)>),
    Flush(mpsc::Sender<()>),
}

/// The inference engine. Single-threaded: the scheduler owns it.
pub struct Engine {
    model: Model,
    pool: KvPool,
    g1: PrefixCache,
    keychain: KeyChain,
    fingerprint: ModelFingerprint,
    store: Option<TieredStore>,
    offload: Option<(mpsc::Sender<Offload>, JoinHandle<()>)>,
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

/// The fingerprint of a model: its config and every weight byte, so KV of a
/// model with the same shapes but other weights never matches.
pub fn model_fingerprint(config_json: &[u8], weights_digest: &[u8]) -> ModelFingerprint {
    let mut bytes = Vec::with_capacity(config_json.len() + weights_digest.len());
    bytes.extend_from_slice(config_json);
    bytes.extend_from_slice(weights_digest);
    ModelFingerprint::of_bytes(&bytes)
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
        let offload = match &store {
            Some(s) => Some(spawn_offload(s.clone())?),
            None => None,
        };
        Ok(Self {
            model,
            pool,
            g1: PrefixCache::default(),
            keychain,
            fingerprint,
            store,
            offload,
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
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Prefill, EngineError> {
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
        self.seqs.insert(
            id,
            Seq {
                tokens: prompt.to_vec(),
                table: Vec::new(),
                computed: 0,
                keys: Vec::new(),
            },
        );
        match self.prefill_inner(id) {
            Ok(p) => Ok(p),
            Err(e) => {
                self.finish(id);
                Err(e)
            }
        }
    }

    fn prefill_inner(&mut self, id: SeqId) -> Result<Prefill, EngineError> {
        let t0 = Instant::now();
        let (cached, restored_bytes) = if self.opts.prefix_reuse {
            self.attach_prefix(id)?
        } else {
            (CachedTokens::default(), 0)
        };
        let restore_seconds = t0.elapsed().as_secs_f64();
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

    /// G1 hits, then one batched store read for the rest of the prefix.
    /// Never takes the block holding the last prompt token: its logits must
    /// be computed.
    fn attach_prefix(&mut self, id: SeqId) -> Result<(CachedTokens, u64), EngineError> {
        let bt = self.opts.block_tokens;
        let Some(seq) = self.seqs.get(&id) else {
            return Ok((CachedTokens::default(), 0));
        };
        let usable = (seq.tokens.len() - 1) / bt;
        let keys = self.keychain.keys(&seq.tokens[..usable * bt]);
        let mut cached = CachedTokens::default();
        let mut table = Vec::new();
        for key in &keys {
            let Some(page) = self.g1.get(key) else { break };
            self.pool.retain(page);
            self.g1.mark_busy(page);
            table.push(page);
            cached.g1 += bt;
        }
        let mut bytes = 0u64;
        let rest = &keys[table.len()..];
        if let Some(store) = self.store.clone()
            && !rest.is_empty()
        {
            let hits = store.lookup_prefix(rest).hits();
            if hits > 0 {
                let blocks = store.get_many(&rest[..hits]);
                for (key, block) in rest.iter().zip(blocks) {
                    // A block that failed verification is a miss: the rest of
                    // the prefix is recomputed.
                    let Some(block) = block else { break };
                    let page = match self.alloc_page() {
                        Ok(p) => p,
                        Err(_) => break,
                    };
                    if let Err(e) = self.pool.import(page, block.payload()) {
                        tracing::warn!("restoring block {key} failed: {e}; recomputing");
                        self.pool.release(page);
                        self.pool.free(page);
                        break;
                    }
                    self.g1.insert(*key, page);
                    table.push(page);
                    bytes += block.payload().len() as u64;
                    match block.tier {
                        Tier::G2 => cached.g2 += bt,
                        Tier::G3 => cached.g3 += bt,
                        Tier::G4 => cached.g4 += bt,
                    }
                }
            }
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.keys = keys[..table.len()].to_vec();
            seq.computed = table.len() * bt;
            seq.table = table;
        }
        Ok((cached, bytes))
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
        if self.offload.is_some() {
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

    /// Copies the full pages registered since the last call out of G1 and
    /// hands them to the store's background writer. The scheduler calls it
    /// after each step's tokens are sent; [`Engine::flush_offload`] calls it
    /// too.
    pub fn offload_pending(&mut self) -> Result<(), EngineError> {
        let pending = std::mem::take(&mut self.pending_offload);
        if pending.is_empty() {
            return Ok(());
        }
        let mut blocks = Vec::with_capacity(pending.len());
        let mut failed = None;
        for &(key, page) in &pending {
            match self.pool.export(page) {
                Ok(bytes) => blocks.push((key, bytes)),
                Err(e) => failed = Some(e),
            }
        }
        for (_, page) in pending {
            self.release_page(page);
        }
        if let Some((tx, _)) = &self.offload
            && !blocks.is_empty()
        {
            let _ = tx.send(Offload::Put(blocks));
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
        for page in seq.table {
            self.release_page(page);
        }
    }

    /// Waits until every queued block has been handed to the store.
    pub fn flush_offload(&mut self) -> Result<(), EngineError> {
        self.offload_pending()?;
        if let Some((tx, _)) = &self.offload {
            let (done_tx, done_rx) = mpsc::channel();
            if tx.send(Offload::Flush(done_tx)).is_ok() {
                let _ = done_rx.recv();
            }
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Err(e) = self.offload_pending() {
            tracing::warn!("copying KV blocks for the store at shutdown failed: {e}");
        }
        if let Some((tx, handle)) = self.offload.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}

fn spawn_offload(
    store: TieredStore,
) -> Result<(mpsc::Sender<Offload>, JoinHandle<()>), EngineError> {
    let (tx, rx) = mpsc::channel::<Offload>();
    let handle = std::thread::Builder::new()
        .name("kvtier-offload".into())
        .spawn(move || {
            while let Ok(job) = rx.recv() {
                match job {
                    Offload::Put(blocks) => {
                        let refs: Vec<(BlockKey, &[u8])> =
                            blocks.iter().map(|(k, b)| (*k, b.as_slice())).collect();
                        if let Err(e) = store.put_many(&refs) {
                            tracing::warn!("offloading {} KV blocks failed: {e}", refs.len());
                        }
                    }
                    Offload::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        })
        .map_err(|e| EngineError::Request(format!("cannot start the offload thread: {e}")))?;
    Ok((tx, handle))
}
