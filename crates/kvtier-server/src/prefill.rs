//! Prefill on one node, decode on another: compute a prompt's KV here and
//! leave it in the shared G4 pool, where a server (same model, block size
//! and tenant salt) restores it instead of computing it.
//!
//! The prompt is tokenized exactly as the server does: raw text as
//! `/v1/completions` takes it, or (`chat`) as one user message through the
//! chat template of `/v1/chat/completions`. [`prefill`] returns once every
//! block was written to G4 (or the pool failed, which the report shows as
//! blocks dropped).

use std::path::PathBuf;
use std::time::Instant;

use kvtier_engine::text::chat_template::ChatTemplate;
use kvtier_engine::text::tokenizer::{ChatMessage, TextTokenizer};
use kvtier_engine::{Engine, EngineOptions, ModelConfig, StoreOptions, open_device};
use kvtier_store::RemoteConfig;
use serde::Serialize;

use crate::serve_error::ServeError;

/// What to prefill, and where to leave it.
#[derive(Debug, Clone)]
pub struct PrefillOptions {
    /// Model directory (as for the server).
    pub model: PathBuf,
    /// The prompt text.
    pub prompt: String,
    /// Treat the prompt as one user message rendered with the chat template
    /// (as `/v1/chat/completions` does) instead of as is (as
    /// `/v1/completions` does) (default: as is).
    pub chat: bool,
    /// Tokens per KV block; must equal the decode node's (default: 256).
    pub block_tokens: usize,
    /// Tenant salt; must equal the decode node's (default: empty).
    pub tenant_salt: String,
    /// How the KV is stored (`--kv-offload-codec`); must equal the decode
    /// node's, whose keys it is part of (default: none).
    pub kv_offload_codec: kvtier_store::KvCodec,
    /// G2 (host memory) of this node's store while it runs (default: 1 GiB).
    pub g2_bytes: u64,
    /// Where the model runs: `cpu`, or `cuda` / `cuda:N` (default: `cpu`).
    pub device: String,
    /// The shared pool the decode node reads.
    pub remote: RemoteConfig,
}

impl PrefillOptions {
    /// `kvtier prefill`'s defaults for `prompt` on the model in `model`,
    /// into `remote`.
    pub fn new(model: impl Into<PathBuf>, prompt: impl Into<String>, remote: RemoteConfig) -> Self {
        Self {
            model: model.into(),
            prompt: prompt.into(),
            chat: false,
            block_tokens: 256,
            tenant_salt: String::new(),
            kv_offload_codec: kvtier_store::KvCodec::None,
            g2_bytes: 1 << 30,
            device: "cpu".into(),
            remote,
        }
    }
}

/// What a prefill did (`kvtier prefill --json`; field names are a
/// contract).
#[derive(Debug, Clone, Serialize)]
pub struct PrefillReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens computed here.
    pub computed_tokens: usize,
    /// Prompt tokens that were already cached (in G4 or locally).
    pub cached_tokens: usize,
    /// Blocks of the prompt a decode node can restore: its full blocks
    /// before the last token, and the tail after them (a partial block).
    pub blocks: usize,
    /// Blocks written to G4 by this run.
    pub g4_blocks_written: u64,
    /// Bytes written to G4 by this run.
    pub g4_written_bytes: u64,
    /// Blocks that could not be written to G4 (pool down or slow).
    pub g4_dropped_blocks: u64,
    /// Seconds of the prefill computation.
    pub prefill_seconds: f64,
    /// Seconds until every block reached G4.
    pub total_seconds: f64,
}

impl std::fmt::Display for PrefillReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "prefilled {} tokens ({} computed, {} cached) in {:.2} s; {} blocks ({} B) \
             written to G4, {} dropped; done in {:.2} s",
            self.prompt_tokens,
            self.computed_tokens,
            self.cached_tokens,
            self.prefill_seconds,
            self.g4_blocks_written,
            self.g4_written_bytes,
            self.g4_dropped_blocks,
            self.total_seconds
        )
    }
}

/// The prompt's token ids, as the server would see them (a chat prompt
/// rendered with the model's chat template).
fn prompt_tokens(tokenizer: &TextTokenizer, opts: &PrefillOptions) -> Result<Vec<u32>, ServeError> {
    let ids = if opts.chat {
        let template = ChatTemplate::load(&opts.model, None, tokenizer.config())?;
        let message = ChatMessage {
            role: "user".into(),
            content: opts.prompt.clone(),
        };
        let text = template.render(&[message], true, None).map_err(|e| {
            ServeError::Invalid(format!("the chat template refused the prompt: {e}"))
        })?;
        tokenizer.encode_rendered(&text)
    } else {
        tokenizer.encode(&opts.prompt)
    };
    ids.map_err(|e| ServeError::engine("cannot tokenize the prompt", e))
}

/// Computes the prompt's KV and waits until it is in G4. A report with
/// `g4_dropped_blocks > 0` means the pool did not take every block.
pub fn prefill(opts: &PrefillOptions) -> Result<PrefillReport, ServeError> {
    let dir = &opts.model;
    let cfg = ModelConfig::from_dir(dir).map_err(|e| {
        ServeError::engine(format!("cannot read the model in {}", dir.display()), e)
    })?;
    let tokenizer = TextTokenizer::from_dir(dir)?;
    let tokens = prompt_tokens(&tokenizer, opts)?;
    if tokens.is_empty() {
        return Err(ServeError::Invalid("the prompt is empty".into()));
    }
    let context = cfg.max_position_embeddings;
    if tokens.len() >= context {
        return Err(ServeError::Invalid(format!(
            "the prompt has {} tokens; the model's context is {context}",
            tokens.len()
        )));
    }
    let bt = opts.block_tokens;
    let engine_opts = EngineOptions {
        block_tokens: bt,
        pool_pages: tokens.len().div_ceil(bt) + 1,
        max_seq_tokens: tokens.len() + 1,
        prefix_reuse: true,
        tenant_salt: opts.tenant_salt.clone().into_bytes(),
        device: open_device(&opts.device)?,
        ..Default::default()
    };
    let store = StoreOptions {
        memory_bytes: opts.g2_bytes,
        remote: Some(opts.remote.clone()),
        codec: opts.kv_offload_codec,
        ..Default::default()
    };
    let mut engine = Engine::load(dir, engine_opts, Some(store)).map_err(|e| {
        ServeError::engine(format!("cannot load the model in {}", dir.display()), e)
    })?;
    let t0 = Instant::now();
    let p = engine
        .prefill(&tokens)
        .map_err(|e| ServeError::engine("prefill failed", e))?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    engine.finish(p.seq);
    engine
        .flush_offload()
        .map_err(|e| ServeError::engine("handing the blocks to the store failed", e))?;
    let store = engine
        .store()
        .ok_or_else(|| ServeError::Invalid("the engine opened no store".into()))?
        .clone();
    store.flush().map_err(|source| ServeError::Store {
        what: "flushing the store failed".into(),
        source,
    })?;
    let total_seconds = t0.elapsed().as_secs_f64();
    let m = store.metrics();
    let report = PrefillReport {
        prompt_tokens: tokens.len(),
        computed_tokens: p.computed_tokens,
        cached_tokens: p.cached.total(),
        // Every full block before the last token, and the tail after them
        // (partial key).
        blocks: (tokens.len() - 1).div_ceil(bt),
        g4_blocks_written: m.g4.written_blocks.get(),
        g4_written_bytes: m.g4.written_bytes.get(),
        g4_dropped_blocks: m.remote.dropped_puts.get(),
        prefill_seconds,
        total_seconds,
    };
    drop(engine);
    Ok(report)
}
