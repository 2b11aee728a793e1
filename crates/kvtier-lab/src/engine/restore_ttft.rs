//! TTFT of one long prompt, recomputed vs restored from G3 (disk):
//! `cargo run --release -p kvtier-lab -- restore_ttft [MODEL_DIR] [TOKENS] [CACHE_DIR]`.
//! Default: the `small` preset in a temp dir, 4096 tokens, a cache under the
//! temp dir. Prints both TTFTs, the restored bytes, and the floor
//! (bytes at the measured restore bandwidth + suffix compute).

use std::error::Error;
use std::time::Instant;

use kvtier_engine::{Engine, EngineError, EngineOptions, Preset, StoreOptions, write_preset};

/// Runs the experiment: `args` are `[MODEL_DIR] [TOKENS] [CACHE_DIR]`.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn Error>> {
    let tmp = std::env::temp_dir();
    let dir = match args.first().filter(|s| !s.is_empty()) {
        Some(d) => std::path::PathBuf::from(d),
        None => {
            let d = tmp.join("kvtier-speed-small");
            if !d.join("model.safetensors").exists() {
                write_preset(Preset::Small, 0, &d)?;
            }
            d
        }
    };
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let cache = args
        .get(2)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tmp.join(format!("kvtier-ttft-cache-{}", std::process::id())));
    let opts = EngineOptions {
        pool_pages: 64,
        ..Default::default()
    };
    let store = StoreOptions {
        codec: kvtier_store::KvCodec::None,
        eviction: Default::default(),
        memory_bytes: 1 << 30,
        disk_dirs: vec![cache.clone()],
        disk_bytes: 4 << 30,
        remote: None,
        g3_sync: None,
    };
    let mut e = Engine::load(&dir, opts, Some(store))?;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 31 + 7) % 256).collect();

    e.set_prefix_reuse(false);
    let t = Instant::now();
    let cold = e.prefill(&prompt)?;
    let recompute = t.elapsed().as_secs_f64();
    e.finish(cold.seq);

    e.set_prefix_reuse(true);
    let first = e.prefill(&prompt)?;
    e.finish(first.seq);
    e.flush_offload()?;
    e.evict_g1();
    if let Some(s) = e.store() {
        s.evict_memory().map_err(EngineError::from)?;
    }
    // Drop the page cache when permitted (G3 reads are O_DIRECT anyway).
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");

    let t = Instant::now();
    let warm = e.prefill(&prompt)?;
    let restored = t.elapsed().as_secs_f64();
    let max_diff = cold
        .logits
        .iter()
        .zip(&warm.logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let per_token = recompute / n as f64;
    let suffix = warm.computed_tokens as f64 * per_token;
    println!("prompt: {n} tokens");
    println!(
        "recompute TTFT: {recompute:.3} s ({:.0} tok/s)",
        n as f64 / recompute
    );
    println!(
        "restored TTFT:  {restored:.3} s ({} tokens from G3, {} computed; {:.1} MiB in {:.3} s = {:.2} GB/s)",
        warm.cached.g3,
        warm.computed_tokens,
        warm.restored_bytes as f64 / (1 << 20) as f64,
        warm.restore_seconds,
        warm.restored_bytes as f64 / warm.restore_seconds.max(1e-9) / 1e9
    );
    println!(
        "speedup: {:.1}x; max |logit diff| {max_diff:.2e}",
        recompute / restored
    );
    println!(
        "suffix compute at the recompute rate: {suffix:.3} s; restore share: {:.3} s",
        restored - suffix
    );
    let _ = std::fs::remove_dir_all(&cache);
    Ok(())
}
