//! `kvtier serve`: the flags, mapped onto [`kvtier_server::ServeOptions`];
//! the server itself is [`kvtier_server::run`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use kvtier_server::ServeOptions;
use kvtier_server::conn_limits::ConnLimits;

use kvtier_bench::common::size::parse_size;

use crate::remote_flags::RemoteFlags;

/// Flags of `kvtier serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Model directory (Hugging Face layout: config.json, *.safetensors,
    /// tokenizer.json), e.g. one written by `kvtier model init`; the same as
    /// `--model` (as `vllm serve MODEL`), and wins over it.
    #[arg(value_name = "MODEL_DIR")]
    pub model_dir: Option<PathBuf>,

    /// Model directory (as the positional MODEL_DIR).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,

    /// A TOML file of serve settings: every flag is a key (`cache_dir`,
    /// `g2_bytes`, ...) and also an environment variable `KVTIER_<KEY>`;
    /// flags win over the environment, the environment over the file
    /// (`kvtier config --print-default` prints the whole file). Also
    /// `KVTIER_CONFIG`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Directory for the G3 (disk) tier of the KV cache; created if missing.
    #[arg(long, value_name = "DIR", default_value = "./kvtier-cache")]
    pub cache_dir: PathBuf,

    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0: any free port; the bound address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// Name clients pass as `model` [default: the model directory's name].
    #[arg(long, value_name = "NAME", alias = "served-model-name")]
    pub model_name: Option<String>,

    /// Tokens per KV block (one G1 page, one store block).
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub block_tokens: u32,

    /// How G2, G3 and G4 store KV blocks: none (f32 as computed), bf16
    /// (half the bytes), fp8-e4m3 or int8 (about a quarter, a scale per
    /// token and head). G1 keeps f32; blocks are coded as they leave it and
    /// decoded as they are restored. Part of every block key, so coded and
    /// uncoded KV never mix (docs/block-format.md).
    #[arg(long, value_name = "CODEC", default_value = "none", value_parser = crate::cli::codec_arg)]
    pub kv_offload_codec: kvtier_store::KvCodec,

    /// G1 pages [default: room for --max-batch full-context sequences, at
    /// most 2 GiB of KV, at least one full-context sequence].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub pool_pages: Option<u32>,

    /// G2 (host memory) capacity of the KV store (0: none).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size)]
    pub g2_bytes: u64,

    /// G2's and G3's eviction policy: kvtier (kvtier's own: adaptive replacement over
    /// the leaves of the prefix forest; docs/store.md), lru, fifo, s3fifo or
    /// clock.
    #[arg(long, value_name = "POLICY", default_value = "kvtier")]
    pub eviction: kvtier_store::eviction::EvictionKind,

    /// G3 (disk, under --cache-dir) capacity of the KV store (0: none).
    #[arg(long, value_name = "SIZE", default_value = "16GiB", value_parser = parse_size)]
    pub g3_bytes: u64,

    /// Bounded write-back: blocks that live only in G2 (host memory) are
    /// written to G3 within about this many milliseconds, so a kill -9 loses
    /// at most that much computed KV (0: G3 gets blocks only when G2 evicts
    /// them and at a clean stop).
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub g3_sync_ms: u64,

    /// Longest sequence (prompt + generated tokens) served; also capped by
    /// the model's max_position_embeddings.
    #[arg(long, value_name = "N", default_value_t = 8192, alias = "max-model-len",
          value_parser = clap::value_parser!(u32).range(2..))]
    pub max_seq_tokens: u32,

    /// Longest prompt accepted [default: the context length - 1].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_prompt_tokens: Option<u32>,

    /// Most sequences decoded together (and admitted per batching window).
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_batch: u32,

    /// Longest wait, in milliseconds, for more arrivals once the first
    /// request of an idle server came. 0: none (requests that come while
    /// others run join them at the next step).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub max_wait_ms: u64,

    /// Recompute every prompt (the baseline): neither read nor write
    /// cached KV; no store is opened.
    #[arg(long)]
    pub no_prefix_reuse: bool,

    /// Restore a prefix whole before computing the rest of the prompt,
    /// never layer by layer. By default an idle engine restores layer by
    /// layer: the new tokens' layer l is computed as soon as layer l has
    /// landed, while later layers are still being read (docs/architecture.md).
    #[arg(long)]
    pub no_layerwise_restore: bool,

    /// How much a restore beside decoding requests yields the CPU to them:
    /// after each piece of the prefix it copies into G1, the restoring
    /// thread sleeps K times as long as the piece took (0: never yields).
    /// Higher keeps the others' inter-token latency steadier and makes the
    /// restoring request's first token later (docs/decisions.md). A
    /// restore into an otherwise idle engine never yields.
    #[arg(long, value_name = "K", default_value_t = kvtier_engine::DEFAULT_RESTORE_YIELD, value_parser = crate::cli::restore_yield_arg)]
    pub restore_yield: f64,

    /// Tenant salt mixed into every block key, so one tenant's prefixes are
    /// invisible to another's.
    #[arg(long, value_name = "TEXT", default_value = "")]
    pub tenant_salt: String,

    /// An accepted API key (repeatable; each key its own tenant): clients
    /// send `Authorization: Bearer KEY` on every endpoint but /health,
    /// others get 401. No key at all: the server is open.
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Vec<String>,

    /// A file of API keys, one per line: `KEY` or `KEY TENANT` (keys of one
    /// tenant share its cached prefixes; tenants never see each other's).
    #[arg(long, value_name = "FILE")]
    pub api_keys_file: Option<PathBuf>,

    /// The shared G4 pool.
    #[command(flatten)]
    pub remote: RemoteFlags,

    /// Where the model runs: `cpu`, or `cuda` / `cuda:N` in a build with
    /// `--features cuda`.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,

    /// A Jinja chat template file to use instead of the model's own
    /// (`chat_template.jinja`, else `chat_template` of
    /// tokenizer_config.json; a model with neither gets ChatML and a
    /// warning).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,

    /// CPU threads the engine computes with [default: the physical cores,
    /// as candle counts them; or RAYON_NUM_THREADS when set].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub threads: Option<u32>,

    /// Largest request body accepted (larger ones get 413).
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = parse_size)]
    pub max_body_bytes: u64,

    /// Connections open at once; one more gets a 503 and is closed (keep it
    /// below the process's descriptor limit, `ulimit -n`).
    #[arg(long, value_name = "N", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// Longest wait, in milliseconds, for a request's headers; also how
    /// long an idle keep-alive connection stays open.
    #[arg(long, value_name = "MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: u64,

    /// Requests handled at once (streams until their last event); one
    /// more gets a 503.
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_in_flight: u32,
}

impl ServeArgs {
    /// The model directory: the positional one, else `--model`.
    pub fn model_path(&self) -> Result<PathBuf> {
        match self.model_dir.as_ref().or(self.model.as_ref()) {
            Some(d) => Ok(d.clone()),
            None => anyhow::bail!(
                "the model directory is required: kvtier serve MODEL_DIR, or --model DIR"
            ),
        }
    }

    /// The server options these flags ask for (the model directory empty
    /// when none was given: see [`model_path`](Self::model_path)).
    pub fn options(&self) -> ServeOptions {
        ServeOptions {
            model: self.model_path().unwrap_or_default(),
            cache_dir: self.cache_dir.clone(),
            host: self.host.clone(),
            port: self.port,
            model_name: self.model_name.clone(),
            block_tokens: self.block_tokens as usize,
            pool_pages: self.pool_pages.map(|n| n as usize),
            g2_bytes: self.g2_bytes,
            g3_bytes: self.g3_bytes,
            g3_sync: std::time::Duration::from_millis(self.g3_sync_ms),
            kv_offload_codec: self.kv_offload_codec,
            eviction: self.eviction,
            max_seq_tokens: self.max_seq_tokens as usize,
            max_prompt_tokens: self.max_prompt_tokens.map(|n| n as usize),
            max_batch: self.max_batch as usize,
            max_wait: Duration::from_millis(self.max_wait_ms),
            prefix_reuse: !self.no_prefix_reuse,
            layerwise_restore: !self.no_layerwise_restore,
            restore_yield: self.restore_yield,
            tenant_salt: self.tenant_salt.clone(),
            api_keys: self.api_key.clone(),
            api_keys_file: self.api_keys_file.clone(),
            remote: self.remote.config(),
            device: self.device.clone(),
            max_body_bytes: self.max_body_bytes,
            chat_template: self.chat_template.clone(),
            conn_limits: ConnLimits {
                max_connections: self.max_connections as usize,
                header_timeout: Duration::from_millis(self.header_timeout_ms),
                max_in_flight: self.max_in_flight as usize,
            },
        }
    }
}

/// Runs `kvtier serve` until SIGINT/SIGTERM.
pub fn run(args: &ServeArgs) -> Result<()> {
    args.model_path()?;
    Ok(kvtier_server::run(args.options())?)
}
