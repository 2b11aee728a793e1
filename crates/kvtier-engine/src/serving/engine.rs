//! The engine: a model, its G1 page pool, the G1 prefix index, and the
//! tiered store below it.
//!
//! For each prompt: keys of its full blocks -> G1 hits -> one background
//! read of the rest of the cached prefix from the store
//! ([`Engine::begin`], in [`crate::kv::prefix_restore`]), while the caller's
//! thread goes on -> once the read is done ([`Engine::restore_done`]),
//! [`Engine::attach`] copies the blocks into G1 pages (one copy each) ->
//! the uncached rest of the prompt is computed a page at a time by
//! [`Engine::step`], in the same forward passes as the other sequences'
//! decode tokens. [`Engine::prefill`] does all of it in one call.
//!
//! New full pages are exported straight into store block buffers and
//! offered to the store ([`TieredStore::offer`]), after the step's tokens
//! were sent: never on the time-to-first-token path, and never waiting on
//! the disk (the store's write-back queue takes them, or drops and counts
//! them when it is full). With `prefix_reuse` off the engine recomputes
//! every prompt (the baseline) and neither reads nor writes cached KV.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use kvtier_store::{
    BlockKey, DiskConfig, KeyChain, KvCodec, KvLayout, ModelFingerprint, StoreConfig, TierTokens,
    TieredStore,
};

use crate::engine_error::EngineError;
use crate::forward::model::{Model, Segment};
use crate::kv::kv_pool::{KvPool, PageId};
use crate::kv::prefix_cache::PrefixCache;
use crate::kv::prefix_restore::{Begun, LayeredAttach};
use crate::model_dir::model_config::ModelConfig;
use crate::model_dir::weights::Weights;

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
    /// Restore prefixes layer by layer ([`crate::kv::layer_restore`]): each
    /// layer is decoded into its G1 page on the store's threads as it
    /// lands. When the engine runs nothing else, the forward pass starts
    /// while later layers are still being read. Off: whole blocks are read,
    /// then copied into G1 between steps.
    pub layerwise_restore: bool,
    /// How much a layer-wise restore read beside decoding sequences yields the
    /// CPU to them: after decoding each piece into its pages, the store's
    /// thread sleeps this many times as long as the piece took (0: never). On a
    /// host with few cores the restore's checks and copies otherwise land on
    /// the decode steps running beside them, and the others' inter-token gaps
    /// grow by the restore's whole CPU time (docs/decisions.md, "A restore
    /// beside decoders yields"); yielding spreads that work over more steps, at
    /// the cost of the restoring request's own TTFT. Its G4 blocks are then
    /// asked for one at a time, with the same pause after each GET
    /// (`kvtier_store::LayerSink::yield_factor`). A restore begun while the
    /// engine runs nothing else never yields.
    pub restore_yield: f64,
}

/// [`EngineOptions::restore_yield`]'s default: the restore's thread works
/// at most about a quarter of the time while others decode.
pub const DEFAULT_RESTORE_YIELD: f64 = 3.0;

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            block_tokens: 256,
            pool_pages: 256,
            max_seq_tokens: 8192,
            prefix_reuse: true,
            tenant_salt: Vec::new(),
            device: Device::Cpu,
            layerwise_restore: true,
            restore_yield: DEFAULT_RESTORE_YIELD,
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
    /// How often blocks only in G2 are written to G3
    /// ([`StoreConfig::g3_sync`]): `None` is the store's default
    /// ([`kvtier_store::DEFAULT_G3_SYNC`]), zero turns it off.
    pub g3_sync: Option<std::time::Duration>,
    /// The eviction policy of G2 and G3 (`--eviction`).
    pub eviction: kvtier_store::eviction::EvictionKind,
    /// How G2, G3 and G4 store the KV (`--kv-offload-codec`): G1 keeps f32;
    /// blocks are coded as they are offloaded and decoded into G1 pages as
    /// they are restored ([`KvCodec`]).
    pub codec: KvCodec,
}

/// Identifies a sequence inside the engine.
pub type SeqId = u64;

/// What a prefill did.
#[derive(Debug, Clone)]
pub struct Prefill {
    /// The new sequence.
    pub seq: SeqId,
    /// Logits of the last prompt token.
    pub logits: Vec<f32>,
    /// Prompt tokens not recomputed.
    pub cached: TierTokens,
    /// KV bytes restored from the store.
    pub restored_bytes: u64,
    /// Seconds spent restoring from the store (lookup, reads, copies).
    pub restore_seconds: f64,
    /// Seconds the forward pass waited for restored layers to land
    /// ([`Attached::layer_wait_seconds`](crate::Attached::layer_wait_seconds)).
    pub layer_wait_seconds: f64,
    /// Prompt tokens computed.
    pub computed_tokens: usize,
}

/// What one [`Engine::step`] computed.
#[derive(Debug, Clone, Default)]
pub struct Step {
    /// Next-token logits of each decoding sequence, in order.
    pub decoded: Vec<Vec<f32>>,
    /// For each prefilling sequence, in order: the logits of its last prompt
    /// token once this step computed the prompt's last chunk, else `None`.
    pub prefilled: Vec<Option<Vec<f32>>>,
}

#[derive(Debug)]
pub(crate) struct Seq {
    pub(crate) tokens: Vec<u32>,
    pub(crate) table: Vec<PageId>,
    /// Tokens whose KV is in `table`.
    pub(crate) computed: usize,
    /// Keys of the full pages registered so far.
    pub(crate) keys: Vec<BlockKey>,
    /// The chain its keys come from: the engine's, salted by the request.
    pub(crate) chain: KeyChain,
    /// A prefill begun and not attached yet.
    pub(crate) prefill: Option<Begun>,
    /// A layer-wise restore attached and not verified yet.
    pub(crate) layered: Option<LayeredAttach>,
    /// What its prefix restore took from the caches, once attached.
    pub(crate) attached: Option<crate::kv::prefix_restore::Attached>,
    /// The store holds the prompt's tail under its partial key already (it
    /// was restored from there): not offered again.
    pub(crate) tail_stored: bool,
}

/// The inference engine. Single-threaded: the scheduler owns it.
pub struct Engine {
    pub(crate) model: Model,
    pub(crate) pool: KvPool,
    /// The store layout of a G1 page (the store's codec, f32, layer-major).
    pub(crate) kv_layout: KvLayout,
    pub(crate) g1: PrefixCache,
    pub(crate) keychain: KeyChain,
    fingerprint: ModelFingerprint,
    pub(crate) store: Option<TieredStore>,
    pub(crate) opts: EngineOptions,
    pub(crate) seqs: HashMap<SeqId, Seq>,
    pub(crate) next_id: SeqId,
    /// Pages registered but not yet copied out to the store, with the
    /// token rows each holds (a block's, or fewer for a prompt's tail).
    pending_offload: Vec<(BlockKey, PageId, u32)>,
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
        cfg.check_fits(kvtier_io::host_memory::memory_bytes())
            .map_err(|msg| EngineError::Config {
                path: dir.join("config.json"),
                msg,
            })?;
        let mut weights = Weights::load(dir, &opts.device, DType::F32)?;
        let fingerprint = weights.fingerprint(dir)?;
        let model = Model::new(cfg.clone(), &mut weights, opts.max_seq_tokens, &opts.device)?;
        let store = match store {
            Some(so) => {
                let layout = cfg.kv_layout(opts.block_tokens).with_codec(so.codec);
                layout
                    .validate()
                    .map_err(|e| EngineError::Request(e.to_string()))?;
                let mut sc = StoreConfig::new(layout, fingerprint);
                sc.memory_bytes = so.memory_bytes;
                sc.eviction = so.eviction;
                if !so.disk_dirs.is_empty() {
                    sc.disk = Some(DiskConfig::new(so.disk_dirs, so.disk_bytes, layout));
                }
                sc.remote = so.remote;
                // Restores into resident memory: fresh read buffers fault
                // in on the restore path, which lengthened restores and the
                // decoders' gaps beside them (docs/decisions.md, "Host
                // memory: recycled, and warmed before the first restores").
                sc.warm_read_buffers = true;
                if let Some(every) = so.g3_sync {
                    sc.g3_sync = (!every.is_zero()).then_some(every);
                }
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
        // The store's codec is its own choice; the rest of its layout must
        // be the model's.
        let layout = cfg
            .kv_layout(opts.block_tokens)
            .with_codec(store.as_ref().map_or(KvCodec::None, |s| s.layout().codec));
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
            kv_layout: layout,
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

    /// Turns layer-wise restores on or off
    /// ([`EngineOptions::layerwise_restore`]).
    pub fn set_layerwise_restore(&mut self, on: bool) {
        self.opts.layerwise_restore = on;
    }

    /// Sets how much a layer-wise restore begun beside other sequences
    /// yields the CPU to them ([`EngineOptions::restore_yield`]); reads
    /// already begun keep theirs.
    pub fn set_restore_yield(&mut self, k: f64) {
        self.opts.restore_yield = k;
    }

    /// Keys of the full blocks of `tokens` under this engine's chain.
    pub fn block_keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        self.keychain.keys(tokens)
    }

    /// Free G1 pages (including idle cached ones that can be reclaimed).
    pub fn free_pages(&self) -> usize {
        self.pool.free_pages() + self.g1.idle_pages()
    }

    /// G1 pages in all.
    pub fn total_pages(&self) -> usize {
        self.pool.pages()
    }

    /// G1 pages that hold a cached prefix no running sequence uses (kept
    /// for reuse, reclaimed when pages run out).
    pub fn cached_pages(&self) -> usize {
        self.g1.idle_pages()
    }

    /// Drops every idle cached G1 page, so later prompts must come from the
    /// store (or be recomputed). Pages of live sequences stay.
    pub fn evict_g1(&mut self) {
        while let Some(page) = self.g1.reclaim() {
            self.pool.free(page);
        }
    }

    /// A page for a sequence whose last page is `after` (see
    /// [`KvPool::alloc`]); reclaims an idle cached page when none is free.
    pub(crate) fn alloc_page(&mut self, after: Option<PageId>) -> Result<PageId, EngineError> {
        if let Some(p) = self.pool.alloc(after) {
            return Ok(p);
        }
        if let Some(p) = self.g1.reclaim() {
            self.pool.free(p);
            if let Some(p) = self.pool.alloc(after) {
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
            let (have, last) = self
                .seqs
                .get(&id)
                .map_or((0, None), |s| (s.table.len(), s.table.last().copied()));
            if have >= need {
                return Ok(());
            }
            let page = self.alloc_page(last)?;
            if let Some(s) = self.seqs.get_mut(&id) {
                s.table.push(page);
            }
        }
    }

    /// Starts a sequence and computes its whole prompt: restores what it
    /// can of the prompt's prefix (waiting for the store read) and computes
    /// the rest, a page at a time. Returns the last prompt token's logits.
    /// [`begin`](Self::begin), [`attach`](Self::attach) and
    /// [`step`](Self::step)s in one call; the scheduler makes the same calls
    /// without waiting, between other sequences' steps.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Prefill, EngineError> {
        let id = self.begin(prompt, || {})?;
        match self.prefill_begun(id) {
            Ok(p) => Ok(p),
            Err(e) => {
                self.finish(id);
                Err(e)
            }
        }
    }

    fn prefill_begun(&mut self, id: SeqId) -> Result<Prefill, EngineError> {
        let mut attached = self.attach(id)?;
        let logits = loop {
            let step = self.step(&[], &[id])?;
            if let Some(Some(logits)) = step.prefilled.into_iter().next() {
                break logits;
            }
        };
        // A layer-wise restore's report is final once verified.
        if let Some(a) = self.attached(id) {
            attached = a;
        }
        Ok(Prefill {
            seq: id,
            logits,
            cached: attached.cached,
            restored_bytes: attached.restored_bytes,
            restore_seconds: attached.restore_seconds,
            layer_wait_seconds: attached.layer_wait_seconds,
            computed_tokens: attached.to_compute,
        })
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
            let prev = seq.keys.last().copied().unwrap_or_else(|| seq.chain.seed());
            let tokens = &seq.tokens[i * bt..(i + 1) * bt];
            let key = seq.chain.next(&prev, tokens);
            seq.keys.push(key);
            let page = seq.table[i];
            if self.g1.insert(key, page, prev, tokens) {
                new.push((key, page));
            }
        }
        if self.store.is_some() {
            // Copied out later by `offload_pending`, after the caller has
            // emitted its token: the copy stays off the TTFT path. The extra
            // reference keeps the page from being reclaimed meanwhile.
            for (key, page) in new {
                self.pool.retain(page);
                self.pending_offload.push((key, page, bt as u32));
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
            for (_, page, _) in pending {
                self.release_page(page);
            }
            return Ok(());
        };
        let mut blocks = Vec::with_capacity(pending.len());
        let mut failed = None;
        for &(key, page, rows) in &pending {
            // A tail is stored with only its rows: restoring it then reads
            // and checks those, not a whole block's, which a short prompt's
            // concurrency-1 TTFT would otherwise pay for (docs/decisions.md,
            // "Short tail blocks").
            let block = if rows < self.kv_layout.block_tokens {
                store.new_short_block(rows)
            } else {
                store.new_block()
            };
            let exported = block.map_err(EngineError::from).and_then(|mut b| {
                self.pool.export_into(page, &b.layout(), b.payload_mut())?;
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
        for (_, page, _) in pending {
            self.release_page(page);
        }
        failed.map_or(Ok(()), Err)
    }

    /// Offers the store the page holding the prompt's tail (the tokens
    /// after its full blocks but its last one) under the tail's partial key
    /// ([`kvtier_store::KeyChain::partial`]), once the prompt is computed:
    /// a repeated prompt then restores all but its last token.
    fn offer_prompt_tail(&mut self, id: SeqId) {
        let bt = self.opts.block_tokens;
        if !self.opts.prefix_reuse || self.store.is_none() {
            return;
        }
        let Some(seq) = self.seqs.get(&id) else {
            return;
        };
        let reusable = seq.tokens.len().saturating_sub(1);
        let full = reusable / bt;
        if seq.tail_stored || reusable == full * bt || seq.keys.len() < full {
            return;
        }
        let Some(&page) = seq.table.get(full) else {
            return;
        };
        let prev = if full == 0 {
            seq.chain.seed()
        } else {
            seq.keys[full - 1]
        };
        let tail = &seq.tokens[full * bt..reusable];
        let key = seq.chain.partial(&prev, tail);
        let rows = tail.len() as u32;
        self.pool.retain(page);
        self.pending_offload.push((key, page, rows));
    }

    /// Drops one reference; an unreferenced page stays cached in G1 when it
    /// holds a registered block, and is freed otherwise.
    pub(crate) fn release_page(&mut self, page: PageId) {
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
        Ok(self.step(steps, &[])?.decoded)
    }

    /// Tokens the next [`step`](Self::step) computes for prefilling `id`:
    /// the rest of its prompt up to the next page boundary.
    pub fn prefill_chunk(&self, id: SeqId) -> usize {
        let bt = self.opts.block_tokens;
        self.seqs.get(&id).map_or(0, |s| {
            let end = s.tokens.len().min((s.computed / bt + 1) * bt);
            end.saturating_sub(s.computed)
        })
    }

    /// One forward pass for several sequences at once: the next token of
    /// each decoding sequence in `decode` (appended to it) and the next
    /// chunk of the prompt of each prefilling sequence in `prefill` (up to
    /// the next page boundary: [`prefill_chunk`](Self::prefill_chunk)).
    ///
    /// Folding prefill chunks into the decode step is what keeps a restored
    /// prompt's last tokens from stalling the others: a forward pass reads
    /// every weight once whatever its rows, so a 1-token suffix computed on
    /// its own costs a whole step (about one decode step), and in the batch
    /// it costs one more row.
    ///
    /// Every sequence is checked before any is touched, so a failure leaves
    /// the whole batch as it was and each sequence can be retried alone.
    pub fn step(
        &mut self,
        decode: &[(SeqId, u32)],
        prefill: &[SeqId],
    ) -> Result<Step, EngineError> {
        for &(id, _) in decode {
            let seq = self
                .seqs
                .get(&id)
                .ok_or_else(|| EngineError::Request(format!("unknown sequence {id}")))?;
            if seq.prefill.is_some() || seq.computed != seq.tokens.len() {
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
        let mut chunks = Vec::with_capacity(prefill.len());
        for &id in prefill {
            let seq = self
                .seqs
                .get(&id)
                .ok_or_else(|| EngineError::Request(format!("unknown sequence {id}")))?;
            if seq.prefill.is_some() || seq.computed >= seq.tokens.len() {
                return Err(EngineError::Request(format!(
                    "sequence {id} has no prompt left to compute"
                )));
            }
            chunks.push((seq.computed, seq.computed + self.prefill_chunk(id)));
        }
        for (i, &(id, token)) in decode.iter().enumerate() {
            let pos = match self.seqs.get_mut(&id) {
                Some(seq) => {
                    seq.tokens.push(token);
                    seq.tokens.len()
                }
                None => continue,
            };
            if let Err(e) = self.ensure_pages(id, pos) {
                self.undo_decode(&decode[..=i]);
                return Err(e);
            }
        }
        for (&id, &(_, end)) in prefill.iter().zip(&chunks) {
            if let Err(e) = self.ensure_pages(id, end) {
                self.undo_decode(decode);
                return Err(e);
            }
        }
        let mut segs = Vec::with_capacity(decode.len() + prefill.len());
        let spans = decode
            .iter()
            .map(|&(id, _)| {
                let pos = self.seqs.get(&id).map_or(0, |s| s.tokens.len() - 1);
                (id, pos, pos + 1)
            })
            .chain(prefill.iter().zip(&chunks).map(|(&id, &(a, b))| (id, a, b)));
        for (id, start, end) in spans {
            let seq = self
                .seqs
                .get(&id)
                .ok_or_else(|| EngineError::Request(format!("unknown sequence {id}")))?;
            segs.push(Segment {
                tokens: &seq.tokens[start..end],
                start,
                table: &seq.table,
            });
        }
        // Layer-wise restores in flight: each layer waits for its pages.
        let gates: Vec<_> = prefill
            .iter()
            .filter_map(|id| self.seqs.get(id)?.layered.as_ref().map(LayeredAttach::gate))
            .collect();
        let gate = |layer: usize| {
            for (sink, blocks) in &gates {
                sink.wait_layer(layer, *blocks);
            }
        };
        let logits = match self.model.forward_gated(&self.pool, &segs, &gate) {
            Ok(l) => l,
            Err(e) => {
                self.undo_decode(decode);
                return Err(e);
            }
        };
        let mut out = Step {
            decoded: Vec::with_capacity(decode.len()),
            prefilled: Vec::with_capacity(prefill.len()),
        };
        for (i, &(id, _)) in decode.iter().enumerate() {
            out.decoded.push(logits.get(i)?.to_vec1::<f32>()?);
            if let Some(s) = self.seqs.get_mut(&id) {
                s.computed = s.tokens.len();
            }
            self.register_full_pages(id)?;
        }
        for (j, (&id, &(_, end))) in prefill.iter().zip(&chunks).enumerate() {
            if !self.settle_layered(id) {
                // Its restore failed a check: this chunk is recomputed.
                out.prefilled.push(None);
                continue;
            }
            let done = self.seqs.get_mut(&id).is_some_and(|s| {
                s.computed = end;
                end == s.tokens.len()
            });
            out.prefilled.push(if done {
                Some(logits.get(decode.len() + j)?.to_vec1::<f32>()?)
            } else {
                None
            });
            self.register_full_pages(id)?;
            if done {
                self.offer_prompt_tail(id);
            }
        }
        Ok(out)
    }

    /// Takes back the tokens a failed step appended (pages already taken
    /// stay in their tables and serve the next attempt).
    fn undo_decode(&mut self, appended: &[(SeqId, u32)]) {
        for &(id, _) in appended {
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.tokens.pop();
            }
        }
    }

    /// Ends a sequence. Its pages stay in G1 for reuse until reclaimed: the
    /// full ones under their keys, the last one, when partly filled, below
    /// the last full one's key (any later prompt starting with its tokens
    /// copies them).
    pub fn finish(&mut self, id: SeqId) {
        // Nothing unverified stays in G1.
        self.settle_layered(id);
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        if let Some(begun) = seq.prefill {
            for page in begun.cancel() {
                self.pool.release(page);
                self.pool.free(page);
            }
        }
        let bt = self.opts.block_tokens;
        let full = seq.computed / bt;
        if self.opts.prefix_reuse
            && seq.keys.len() == full
            && let Some(&page) = seq.table.get(full)
            && seq.computed > full * bt
        {
            let parent = seq.keys.last().copied().unwrap_or_else(|| seq.chain.seed());
            self.g1
                .insert_partial(page, parent, &seq.tokens[full * bt..seq.computed]);
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
