//! Prefill and decode speed of a model directory (default: writes the
//! `small` preset to a temp dir): `cargo run --release -p kvtier-lab --
//! speed [MODEL_DIR] [PROMPT_TOKENS] [DECODE_STEPS]`.

use std::error::Error;
use std::time::Instant;

use kvtier_engine::serving::sampling::argmax;
use kvtier_engine::{Engine, EngineOptions, Preset, write_preset};

/// Runs the experiment: `args` are `[MODEL_DIR] [PROMPT_TOKENS] [DECODE_STEPS]`.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn Error>> {
    let tmp = std::env::temp_dir().join("kvtier-speed-small");
    let dir = match args.first() {
        Some(d) => std::path::PathBuf::from(d),
        None => {
            if !tmp.join("model.safetensors").exists() {
                write_preset(Preset::Small, 0, &tmp)?;
            }
            tmp
        }
    };
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2048);
    let t = Instant::now();
    let opts = EngineOptions {
        prefix_reuse: false,
        pool_pages: 64,
        ..Default::default()
    };
    let mut e = Engine::load(&dir, opts, None)?;
    println!("load: {:.2} s", t.elapsed().as_secs_f64());
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 31 + 7) % 256).collect();
    let t = Instant::now();
    let p = e.prefill(&prompt)?;
    let pf = t.elapsed().as_secs_f64();
    println!(
        "prefill: {n} tokens in {pf:.2} s = {:.0} tok/s",
        n as f64 / pf
    );
    let mut next = argmax(&p.logits);
    let steps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(32);
    let t = Instant::now();
    for _ in 0..steps {
        let l = e.decode(&[(p.seq, next)])?;
        next = argmax(&l[0]);
    }
    let d = t.elapsed().as_secs_f64();
    println!(
        "decode: {steps} tokens in {d:.2} s = {:.1} tok/s (batch 1, context {n})",
        steps as f64 / d
    );
    Ok(())
}
