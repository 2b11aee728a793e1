//! Prefix restore: [`Engine::begin`] attaches a prompt's G1 hits and starts
//! one background read of the rest of its cached prefix from the store
//! (the store's reader threads look each key up once, read G3 and G4 with
//! all reads in flight and verify every block, while the caller's thread
//! goes on); [`Engine::attach`] takes the blocks read into G1 pages, one copy
//! each. The rest of the prompt is computed by [`Engine::step`].

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use kvtier_store::{BlockKey, Handle, StoredBlock, Tier};

use crate::engine::{CachedTokens, Engine, Seq, SeqId};
use crate::engine_error::EngineError;

/// What [`Engine::begin`] started for a sequence.
#[derive(Debug)]
pub(crate) struct Begun {
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

impl Begun {
    /// Gives up: a store read in flight is cancelled.
    pub(crate) fn cancel(self) {
        if let Some(read) = self.read {
            read.cancel();
        }
    }
}

/// What [`Engine::attach`] took from the caches for a sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Attached {
    /// Prompt tokens served from cache, by tier.
    pub cached: CachedTokens,
    /// KV bytes restored from the store.
    pub restored_bytes: u64,
    /// Seconds the store read took, plus the copies into G1.
    pub restore_seconds: f64,
    /// Prompt tokens left to compute.
    pub to_compute: usize,
}

impl Engine {
    /// Starts a sequence without waiting on the store: checks the prompt,
    /// attaches the G1 pages of its cached prefix and starts one background
    /// read of the rest of the prefix from the store. `on_restored` runs
    /// (on a store thread) once that read is done, or at once when none was
    /// needed; until then [`restore_done`](Self::restore_done) is false.
    /// Then [`attach`](Self::attach) the restored blocks and compute the
    /// rest with [`step`](Self::step)s (or [`finish`](Self::finish) to give
    /// up).
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
    /// done (or none was needed): [`attach`](Self::attach) will not wait on
    /// the store.
    pub fn restore_done(&self, id: SeqId) -> bool {
        self.seqs
            .get(&id)
            .and_then(|s| s.prefill.as_ref())
            .and_then(|b| b.read.as_ref())
            .is_none_or(Handle::is_done)
    }

    /// Takes the blocks the store read for a sequence [`begin`](Self::begin)
    /// started (waiting for the read if it is still running) into fresh G1
    /// pages, one copy each. What is left of the prompt is computed by
    /// [`step`](Self::step)s ([`Attached::to_compute`] tokens, at least the
    /// last one). On an error the sequence is finished.
    pub fn attach(&mut self, id: SeqId) -> Result<Attached, EngineError> {
        let Some(begun) = self.seqs.get_mut(&id).and_then(|s| s.prefill.take()) else {
            self.finish(id);
            return Err(EngineError::Request(format!(
                "sequence {id} has no prefill begun"
            )));
        };
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
        let to_compute = self
            .seqs
            .get(&id)
            .map_or(0, |s| s.tokens.len() - s.computed);
        Ok(Attached {
            cached,
            restored_bytes,
            restore_seconds,
            to_compute,
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
}
