//! `kvtier model init`: write an embedded default model (deterministic
//! random weights, Llama architecture, a working byte-level tokenizer) as a
//! normal Hugging Face model directory, so everything runs with no download.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use kvtier_engine::{ModelConfig, Preset, write_preset};

/// The presets `model init` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PresetName {
    /// 2 layers, hidden 64: milliseconds per token; for tests.
    Tiny,
    /// 8 layers, hidden 1024, GQA 16/4: about 90 M parameters (360 MB f32);
    /// for benchmarks.
    Small,
}

impl PresetName {
    /// The engine's preset.
    pub fn preset(self) -> Preset {
        match self {
            PresetName::Tiny => Preset::Tiny,
            PresetName::Small => Preset::Small,
        }
    }
}

/// Flags of `kvtier model init`.
#[derive(Debug, Clone, Args)]
pub struct ModelInitArgs {
    /// Which model to write.
    #[arg(long, value_enum, default_value_t = PresetName::Tiny)]
    pub preset: PresetName,

    /// Seed of the random weights (same seed, same bytes on every machine;
    /// another seed is another model whose KV never matches this one's).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,

    /// Directory to write config.json, model.safetensors and tokenizer.json
    /// into (created if missing; existing files are replaced).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// Runs `kvtier model init`.
pub fn run(args: &ModelInitArgs) -> Result<()> {
    let t0 = Instant::now();
    let preset = args.preset.preset();
    let params = write_preset(preset, args.seed, &args.dir).with_context(|| {
        format!(
            "cannot write the {} model to {}",
            preset.name(),
            args.dir.display()
        )
    })?;
    let cfg = ModelConfig::from_dir(&args.dir)?;
    println!(
        "wrote the {} model (seed {}): {params} parameters, {} layers, hidden {}, \
         {} heads / {} KV heads, vocab {}, in {:.2} s",
        preset.name(),
        args.seed,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.kv_heads(),
        cfg.vocab_size,
        t0.elapsed().as_secs_f64()
    );
    println!("path: {}", args.dir.display());
    Ok(())
}
