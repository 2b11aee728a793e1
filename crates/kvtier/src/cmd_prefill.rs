//! `kvtier prefill`: the flags and the prompt, mapped onto
//! [`kvtier_server::PrefillOptions`]; the work is [`kvtier_server::prefill()`].

use std::io::Read;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvtier_server::PrefillOptions;

use kvtier_bench::common::size::parse_size;

use crate::remote_flags::RemoteFlags;

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

    /// How the KV is stored in G4: none, bf16, fp8-e4m3 or int8; must
    /// equal the decode node's `kvtier serve --kv-offload-codec` (it is part
    /// of every block key).
    #[arg(long, value_name = "CODEC", default_value = "none", value_parser = crate::cli::codec_arg)]
    pub kv_offload_codec: kvtier_store::KvCodec,

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
    let mut opts = PrefillOptions::new(&args.model, read_prompt(args)?, remote);
    opts.chat = args.chat;
    opts.block_tokens = args.block_tokens as usize;
    opts.tenant_salt = args.tenant_salt.clone();
    opts.kv_offload_codec = args.kv_offload_codec;
    opts.g2_bytes = args.g2_bytes;
    opts.device = args.device.clone();
    let report = kvtier_server::prefill(&opts)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{report}");
    }
    if report.g4_dropped_blocks > 0 {
        bail!(
            "{} blocks could not be written to the G4 pool (see the log)",
            report.g4_dropped_blocks
        );
    }
    Ok(())
}
