//! What a server is asked to be: the options `kvtier serve`'s flags set,
//! with the same defaults, and the G1 pool size they imply.

use std::path::PathBuf;
use std::time::Duration;

use kvtier_store::RemoteConfig;

use crate::conn_limits::ConnLimits;

/// Most bytes of G1 pages allotted when [`ServeOptions::pool_pages`] is not
/// given.
pub const DEFAULT_POOL_BYTES: u64 = 2 << 30;

/// How to serve a model. `Default` is `kvtier serve`'s defaults; the model
/// directory has none and must be set.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Model directory (Hugging Face layout: config.json, *.safetensors,
    /// tokenizer.json), e.g. one written by `kvtier model init`.
    pub model: PathBuf,
    /// Directory for the G3 (disk) tier of the KV cache; created if missing
    /// (default: `./kvtier-cache`).
    pub cache_dir: PathBuf,
    /// Address to listen on (default: `127.0.0.1`).
    pub host: String,
    /// Port to listen on (0: any free port) (default: 8000).
    pub port: u16,
    /// Name clients pass as `model` (default: the model directory's name).
    pub model_name: Option<String>,
    /// Tokens per KV block (one G1 page, one store block) (default: 256).
    pub block_tokens: usize,
    /// G1 pages [default: room for `max_batch` full-context sequences, at
    /// most [`DEFAULT_POOL_BYTES`] of KV, at least one full-context
    /// sequence].
    pub pool_pages: Option<usize>,
    /// G2 (host memory) capacity of the KV store (0: none) (default: 1 GiB).
    pub g2_bytes: u64,
    /// G3 (disk, under `cache_dir`) capacity of the KV store (0: none)
    /// (default: 16 GiB).
    pub g3_bytes: u64,
    /// Bounded write-back: blocks that live only in G2 reach G3 within about
    /// this long, so a kill -9 loses at most that much computed KV (zero:
    /// only on eviction and at a clean stop) (default: 1 s,
    /// [`kvtier_store::DEFAULT_G3_SYNC`]).
    pub g3_sync: Duration,
    /// The eviction policy of G2 and G3 (`--eviction`).
    pub eviction: kvtier_store::eviction::EvictionKind,
    /// How G2, G3 and G4 store KV blocks (`--kv-offload-codec`; G1 keeps
    /// f32) (default: none).
    pub kv_offload_codec: kvtier_store::KvCodec,
    /// Longest sequence (prompt + generated tokens) served; also capped by
    /// the model's `max_position_embeddings` (default: 8192).
    pub max_seq_tokens: usize,
    /// Longest prompt accepted (default: the context length - 1).
    pub max_prompt_tokens: Option<usize>,
    /// Most sequences decoded together (and admitted per batching window)
    /// (default: 8).
    pub max_batch: usize,
    /// Longest wait for more arrivals once the first request of an idle
    /// server came (default: 0, no window: requests that come while others
    /// run join them at the next step).
    pub max_wait: Duration,
    /// Reuse cached KV (off: recompute every prompt, the baseline; no store
    /// is opened) (default: on).
    pub prefix_reuse: bool,
    /// Restore an idle engine's prefixes layer by layer
    /// (`EngineOptions::layerwise_restore`) (default: on).
    pub layerwise_restore: bool,
    /// How much a restore beside decoding requests yields the CPU to them
    /// (`EngineOptions::restore_yield`) (default:
    /// `kvtier_engine::DEFAULT_RESTORE_YIELD`).
    pub restore_yield: f64,
    /// Tenant salt mixed into every block key, so one tenant's prefixes are
    /// invisible to another's (default: empty).
    pub tenant_salt: String,
    /// Open connections, header/idle time limit, requests in flight
    /// (default: [`ConnLimits::default`]).
    pub conn_limits: ConnLimits,
    /// Accepted API keys, each its own tenant (default: none).
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line, `KEY` or `KEY TENANT` (default:
    /// none). With no key at all the server is open ([`crate::auth`]).
    pub api_keys_file: Option<PathBuf>,
    /// The shared G4 pool (default: none).
    pub remote: Option<RemoteConfig>,
    /// Where the model runs: `cpu`, or `cuda` / `cuda:N` in a build with the
    /// `cuda` feature (default: `cpu`).
    pub device: String,
    /// Largest request body accepted (larger ones get 413) (default: 4 MiB).
    pub max_body_bytes: u64,
    /// A Jinja chat template file that replaces the model's own (default:
    /// the model's: `chat_template.jinja`, else `chat_template` of
    /// `tokenizer_config.json`, else ChatML with a warning;
    /// [`kvtier_engine::text::chat_template`]).
    pub chat_template: Option<PathBuf>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            cache_dir: PathBuf::from("./kvtier-cache"),
            host: "127.0.0.1".into(),
            port: 8000,
            model_name: None,
            block_tokens: 256,
            pool_pages: None,
            g2_bytes: 1 << 30,
            g3_bytes: 16 << 30,
            g3_sync: kvtier_store::DEFAULT_G3_SYNC,
            kv_offload_codec: kvtier_store::KvCodec::None,
            eviction: kvtier_store::eviction::EvictionKind::default(),
            max_seq_tokens: 8192,
            max_prompt_tokens: None,
            max_batch: 8,
            max_wait: Duration::ZERO,
            prefix_reuse: true,
            layerwise_restore: true,
            restore_yield: kvtier_engine::DEFAULT_RESTORE_YIELD,
            tenant_salt: String::new(),
            conn_limits: ConnLimits::default(),
            api_keys: Vec::new(),
            api_keys_file: None,
            remote: None,
            device: "cpu".into(),
            max_body_bytes: 4 << 20,
            chat_template: None,
        }
    }
}

impl ServeOptions {
    /// The defaults, serving the model in `model`.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            ..Self::default()
        }
    }
}

/// G1 pages when [`ServeOptions::pool_pages`] is not given: room for
/// `max_batch` sequences of `context` tokens, at most
/// [`DEFAULT_POOL_BYTES`] of pages of `page_bytes`, never less than one
/// full-context sequence.
pub fn default_pool_pages(
    context: usize,
    block_tokens: usize,
    max_batch: usize,
    page_bytes: u64,
) -> usize {
    let per_seq = context.div_ceil(block_tokens) + 1;
    let cap = (DEFAULT_POOL_BYTES / page_bytes.max(1)) as usize;
    (per_seq * max_batch).min(cap).max(per_seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_pool_fits_the_batch_within_the_budget() {
        // tiny model, 16-token pages of 8 KiB: the whole batch fits.
        assert_eq!(default_pool_pages(512, 16, 8, 8 << 10), 33 * 8);
        // 16 MiB pages: capped at 2 GiB.
        assert_eq!(default_pool_pages(8192, 256, 8, 16 << 20), 128);
        // huge pages: still one full-context sequence.
        assert_eq!(default_pool_pages(8192, 256, 8, 1 << 30), 33);
    }
}
