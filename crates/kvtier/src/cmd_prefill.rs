//! `kvtier prefill`: compute a prompt's KV on this node and leave it in the
//! shared G4 pool, where a `kvtier serve` decode node (same model,
//! `--block-tokens` and `--tenant-salt`) restores it instead of computing
//! it: prefill and decode split across nodes.
//!
//! The prompt is tokenized exactly as the server does: raw text as
//! `/v1/completions` takes it, or with `--chat` as one user message through
//! the chat template of `/v1/chat/completions`. Exits once every block was
//! written to G4 (or the pool failed, which the report shows as fewer
//! blocks written than computed).

use std::io::Read;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvtier_engine::tokenizer::{ChatMessage, TextTokenizer, render_chat};
use kvtier_engine::{Engine, EngineOptions, ModelConfig, StoreOptions, open_device};
use serde::Serialize;

use crate::remote_flags::RemoteFlags;
use crate::size::parse_size;

/// Flags of `kvtier prefill`.
#[derive(Debug, Clone, Args)]
pub struct PrefillArgs {
    /// Model directory (as for `kvtier serve`).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,

    /// The prompt text.
    #[arg(
        long,
        value_name = "TEXT",
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    pub prompt: Option<String>,

    /// Read the prompt from this file (`-`: standard input).
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,

    /// Treat the prompt as one user message rendered with the chat template
    /// (as `/v1/chat/completions` does); without it the text is used as is
    /// (as `/v1/completions` does).
    #[arg(long)]
    pub chat: bool,

    /// Tokens per KV block; must equal the decode node's.
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub block_tokens: u32,

    /// Tenant salt; must equal the decode node's.
    #[arg(long, value_name = "TEXT", default_value = "")]
    pub tenant_salt: String,

    /// G2 (host memory) of this node's store while it runs.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size)]
    pub g2_bytes: u64,

    /// Where the model runs: `cpu`, or `cuda` / `cuda:N` in a build with
    /// `--features cuda`.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,

    /// The shared pool (`--remote` is required).
    #[command(flatten)]
    pub remote: RemoteFlags,

    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// What `kvtier prefill` did (`--json`).
#[derive(Debug, Serialize)]
pub struct PrefillReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens computed here.
    pub computed_tokens: usize,
    /// Prompt tokens that were already cached (in G4 or locally).
    pub cached_tokens: usize,
    /// Full blocks of the prompt (what a decode node can restore: all but
    /// the one holding the last token).
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

fn read_prompt(args: &PrefillArgs) -> Result<String> {
    match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => Ok(p.clone()),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("cannot read the prompt from standard input")?;
            Ok(s)
        }
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read the prompt file {}", f.display())),
        (None, None) => bail!("give --prompt or --prompt-file"),
    }
}

/// Runs `kvtier prefill`.
pub fn run(args: &PrefillArgs) -> Result<()> {
    let Some(remote) = args.remote.config() else {
        bail!("kvtier prefill needs --remote URL (the G4 pool the decode node reads)");
    };
    let text = read_prompt(args)?;
    let dir = &args.model;
    let cfg = ModelConfig::from_dir(dir)
        .with_context(|| format!("cannot read the model in {}", dir.display()))?;
    let tokenizer = TextTokenizer::from_dir(dir)?;
    let text = if args.chat {
        render_chat(&[ChatMessage {
            role: "user".into(),
            content: text,
        }])
    } else {
        text
    };
    let tokens = tokenizer
        .encode(&text)
        .context("cannot tokenize the prompt")?;
    if tokens.is_empty() {
        bail!("the prompt is empty");
    }
    let context = cfg.max_position_embeddings;
    if tokens.len() >= context {
        bail!(
            "the prompt has {} tokens; the model's context is {context}",
            tokens.len()
        );
    }
    let bt = args.block_tokens as usize;
    let opts = EngineOptions {
        block_tokens: bt,
        pool_pages: tokens.len().div_ceil(bt) + 1,
        max_seq_tokens: tokens.len() + 1,
        prefix_reuse: true,
        tenant_salt: args.tenant_salt.clone().into_bytes(),
        device: open_device(&args.device)?,
    };
    let store = StoreOptions {
        memory_bytes: args.g2_bytes,
        remote: Some(remote),
        ..Default::default()
    };
    let mut engine = Engine::load(dir, opts, Some(store))
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let t0 = Instant::now();
    let p = engine.prefill(&tokens).context("prefill failed")?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    engine.finish(p.seq);
    engine
        .flush_offload()
        .context("handing the blocks to the store failed")?;
    let store = engine
        .store()
        .context("the engine opened no store")?
        .clone();
    store.flush().context("flushing the store failed")?;
    let total_seconds = t0.elapsed().as_secs_f64();
    let m = store.metrics();
    let block_bytes = store.layout().payload_bytes() + kvtier_store::block::HEADER_BYTES as u64;
    let report = PrefillReport {
        prompt_tokens: tokens.len(),
        computed_tokens: p.computed_tokens,
        cached_tokens: p.cached.total(),
        blocks: (tokens.len() - 1) / bt,
        g4_blocks_written: m.g4.written_bytes.get() / block_bytes.max(1),
        g4_written_bytes: m.g4.written_bytes.get(),
        g4_dropped_blocks: m.remote.dropped_puts.get(),
        prefill_seconds,
        total_seconds,
    };
    drop(engine);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "prefilled {} tokens ({} computed, {} cached) in {:.2} s; {} blocks ({} B) \
             written to G4, {} dropped; done in {:.2} s",
            report.prompt_tokens,
            report.computed_tokens,
            report.cached_tokens,
            report.prefill_seconds,
            report.g4_blocks_written,
            report.g4_written_bytes,
            report.g4_dropped_blocks,
            report.total_seconds
        );
    }
    if report.g4_dropped_blocks > 0 {
        bail!(
            "{} blocks could not be written to the G4 pool (see the log)",
            report.g4_dropped_blocks
        );
    }
    Ok(())
}
