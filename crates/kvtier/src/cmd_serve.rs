//! `kvtier serve`: load a model, start the scheduler, serve the OpenAI API.
//!
//! Order: check the model directory (config, tokenizer), bind the port
//! (fail fast when taken), load the weights and open the store on a
//! blocking thread, start the scheduler, print `listening on http://ADDR`
//! as the first line on stdout, serve. On SIGINT/SIGTERM: stop accepting,
//! finish the requests in flight, stop the scheduler, and drop the engine,
//! which hands its pending KV blocks to the store and writes the store's
//! dirty blocks to G3.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvtier_engine::scheduler::{BatchConfig, Scheduler};
use kvtier_engine::tokenizer::TextTokenizer;
use kvtier_engine::{Engine, EngineOptions, ModelConfig, StoreOptions, open_device};

use crate::remote_flags::RemoteFlags;
use crate::server::metrics::ServerMetrics;
use crate::server::state::{AppState, Limits};
use crate::server::{routes, serve, shutdown_signal};
use crate::size::parse_size;

/// Most bytes of G1 pages allotted when `--pool-pages` is not given.
const DEFAULT_POOL_BYTES: u64 = 2 << 30;

/// Flags of `kvtier serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Model directory (Hugging Face layout: config.json, *.safetensors,
    /// tokenizer.json), e.g. one written by `kvtier model init`.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,

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
    #[arg(long, value_name = "NAME")]
    pub model_name: Option<String>,

    /// Tokens per KV block (one G1 page, one store block).
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub block_tokens: u32,

    /// G1 pages [default: room for --max-batch full-context sequences, at
    /// most 2 GiB of KV, at least one full-context sequence].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub pool_pages: Option<u32>,

    /// G2 (host memory) capacity of the KV store (0: none).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size)]
    pub g2_bytes: u64,

    /// G3 (disk, under --cache-dir) capacity of the KV store (0: none).
    #[arg(long, value_name = "SIZE", default_value = "16GiB", value_parser = parse_size)]
    pub g3_bytes: u64,

    /// Longest sequence (prompt + generated tokens) served; also capped by
    /// the model's max_position_embeddings.
    #[arg(long, value_name = "N", default_value_t = 8192,
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
    /// request of an idle batch came.
    #[arg(long, value_name = "MS", default_value_t = 50)]
    pub max_wait_ms: u64,

    /// Recompute every prompt (the baseline): neither read nor write
    /// cached KV; no store is opened.
    #[arg(long)]
    pub no_prefix_reuse: bool,

    /// Tenant salt mixed into every block key, so one tenant's prefixes are
    /// invisible to another's.
    #[arg(long, value_name = "TEXT", default_value = "")]
    pub tenant_salt: String,

    /// The shared G4 pool.
    #[command(flatten)]
    pub remote: RemoteFlags,

    /// Where the model runs: `cpu`, or `cuda` / `cuda:N` in a build with
    /// `--features cuda`.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,

    /// Largest request body accepted (larger ones get 413).
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = parse_size)]
    pub max_body_bytes: u64,
}

/// Runs `kvtier serve` until SIGINT/SIGTERM.
pub fn run(args: &ServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvtier-http")
        .build()
        .context("cannot start the async runtime")?;
    let res = rt.block_on(run_async(args.clone()));
    rt.shutdown_timeout(Duration::from_secs(10));
    res
}

/// How the start-up line names G4 (no password).
fn engine_g4(store: bool, remote: &RemoteFlags) -> String {
    match (&remote.remote, store) {
        (Some(url), true) => kvtier_store::remote::redact_url(url),
        _ => "none".into(),
    }
}

/// G1 pages when `--pool-pages` is not given.
fn default_pool_pages(
    context: usize,
    block_tokens: usize,
    max_batch: usize,
    page_bytes: u64,
) -> usize {
    let per_seq = context.div_ceil(block_tokens) + 1;
    let cap = (DEFAULT_POOL_BYTES / page_bytes.max(1)) as usize;
    (per_seq * max_batch).min(cap).max(per_seq)
}

async fn run_async(args: ServeArgs) -> Result<()> {
    let dir = args.model.clone();
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    let cfg = ModelConfig::from_dir(&dir)?;
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    if tokenizer.vocab_size() > cfg.vocab_size {
        bail!(
            "{} has {} tokens but {} says vocab_size is {}",
            dir.join("tokenizer.json").display(),
            tokenizer.vocab_size(),
            dir.join("config.json").display(),
            cfg.vocab_size
        );
    }
    let model_name = match &args.model_name {
        Some(n) => n.clone(),
        None => std::fs::canonicalize(&dir)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "kvtier".to_string()),
    };
    let block_tokens = args.block_tokens as usize;
    let context = (args.max_seq_tokens as usize).min(cfg.max_position_embeddings);
    if context < 2 {
        bail!("the context length ({context} tokens) is too short to serve");
    }
    let max_prompt_tokens = match args.max_prompt_tokens {
        Some(n) if n as usize >= context => {
            bail!("--max-prompt-tokens {n} must be below the context length ({context} tokens)")
        }
        Some(n) => n as usize,
        None => context - 1,
    };
    let page_bytes = cfg.kv_layout(block_tokens).payload_bytes();
    let pool_pages = match args.pool_pages {
        Some(n) => n as usize,
        None => default_pool_pages(context, block_tokens, args.max_batch as usize, page_bytes),
    };

    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener
        .local_addr()
        .with_context(|| format!("cannot read the address bound for {addr}"))?;

    let remote = args.remote.config();
    let store =
        if args.no_prefix_reuse || (args.g2_bytes == 0 && args.g3_bytes == 0 && remote.is_none()) {
            None
        } else {
            let mut disk_dirs = Vec::new();
            if args.g3_bytes > 0 {
                std::fs::create_dir_all(&args.cache_dir).with_context(|| {
                    format!(
                        "cannot create the cache directory {}",
                        args.cache_dir.display()
                    )
                })?;
                disk_dirs.push(args.cache_dir.clone());
            }
            Some(StoreOptions {
                memory_bytes: args.g2_bytes,
                disk_dirs,
                disk_bytes: args.g3_bytes,
                remote,
            })
        };
    let opts = EngineOptions {
        block_tokens,
        pool_pages,
        max_seq_tokens: context,
        prefix_reuse: !args.no_prefix_reuse,
        tenant_salt: args.tenant_salt.clone().into_bytes(),
        device: open_device(&args.device)?,
    };
    eprintln!(
        "loading {} ({} parameters, {} layers) from {}",
        model_name,
        cfg.parameter_count(),
        cfg.num_hidden_layers,
        dir.display()
    );
    let t0 = Instant::now();
    let load_dir = dir.clone();
    let engine = tokio::task::spawn_blocking(move || Engine::load(&load_dir, opts, store))
        .await
        .context("the model loading thread failed")?
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let store_metrics = engine.store().map(|s| s.metrics().clone());
    let stop_tokens = engine.config().eos_ids();
    eprintln!(
        "loaded in {:.2} s: context {context} tokens, {pool_pages} G1 pages of {block_tokens} \
         tokens, G2 {} B, G3 {} B under {}, G4 {}, prefix reuse {}",
        t0.elapsed().as_secs_f64(),
        args.g2_bytes,
        if store_metrics.is_some() {
            args.g3_bytes
        } else {
            0
        },
        args.cache_dir.display(),
        engine_g4(store_metrics.is_some(), &args.remote),
        if args.no_prefix_reuse { "off" } else { "on" },
    );
    let scheduler = Arc::new(
        Scheduler::start(
            engine,
            BatchConfig {
                max_batch: args.max_batch as usize,
                max_wait: Duration::from_millis(args.max_wait_ms),
            },
        )
        .context("cannot start the scheduler thread")?,
    );
    let metrics = Arc::new(ServerMetrics::new(store_metrics));
    let state = Arc::new(AppState::new(
        model_name,
        Arc::new(tokenizer),
        scheduler.clone(),
        Limits {
            context_tokens: context,
            max_prompt_tokens,
        },
        stop_tokens,
        metrics,
    ));
    let max_body = usize::try_from(args.max_body_bytes).unwrap_or(usize::MAX);
    let router = routes::router(state.clone(), max_body);
    drop(state);

    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{bound}").context("cannot write to stdout")?;
        out.flush().context("cannot write to stdout")?;
    }
    serve(listener, router, shutdown_signal())
        .await
        .context("the HTTP server failed")?;

    eprintln!("shutting down: requests finished, flushing the KV cache");
    let t0 = Instant::now();
    tokio::task::spawn_blocking(move || {
        match Arc::try_unwrap(scheduler) {
            Ok(s) => {
                if let Some(mut engine) = s.shutdown() {
                    if let Err(e) = engine.flush_offload() {
                        tracing::warn!("flushing KV blocks to the store failed: {e}");
                    }
                    drop(engine);
                }
            }
            // A handle still held elsewhere: its drop stops the scheduler
            // and drops the engine the same way.
            Err(s) => drop(s),
        }
    })
    .await
    .context("the shutdown thread failed")?;
    eprintln!("stopped in {:.2} s", t0.elapsed().as_secs_f64());
    Ok(())
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
