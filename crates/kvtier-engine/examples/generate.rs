//! Start here for kvtier-engine: load a model directory with kvtier's
//! tiered store below its G1 pages, compute a prompt and generate a few
//! tokens greedily, then send the same prompt again once G1 and G2 are
//! emptied: its prefix comes back from G3 (disk) instead of being
//! recomputed.
//!
//! ```text
//! cargo run --release -p kvtier-engine --example generate [MODEL_DIR]
//! ```
//!
//! Without `MODEL_DIR` the embedded `tiny` preset is written to a
//! temporary directory (random weights: its tokens mean nothing). The G3
//! files go to a temporary directory too, removed at the end.

use kvtier_engine::serving::sampling::argmax;
use kvtier_engine::{Engine, EngineOptions, Preset, StoreOptions, write_preset};
use kvtier_store::KvCodec;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tmp = tempfile::tempdir()?;
    let model = match std::env::args().nth(1) {
        Some(dir) => dir.into(),
        None => {
            let dir = tmp.path().join("tiny");
            write_preset(Preset::Tiny, 0, &dir)?;
            dir
        }
    };

    // G1: 64 pages of 16 tokens; below it G2 (64 MiB of host memory) and
    // G3 (256 MiB of disk).
    let opts = EngineOptions {
        block_tokens: 16,
        pool_pages: 64,
        max_seq_tokens: 1024,
        ..Default::default()
    };
    let store = StoreOptions {
        codec: KvCodec::None,
        eviction: Default::default(),
        memory_bytes: 64 << 20,
        disk_dirs: vec![tmp.path().join("cache")],
        disk_bytes: 256 << 20,
        remote: None,
        g3_sync: None,
    };
    let mut engine = Engine::load(&model, opts, Some(store))?;
    let vocab = engine.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..100u32).map(|i| (i * 31 + 7) % vocab).collect();

    // Compute the prompt, then decode greedily: one token per step.
    let first = engine.prefill(&prompt)?;
    let mut next = argmax(&first.logits);
    let mut generated = vec![next];
    for _ in 0..7 {
        let logits = engine.decode(&[(first.seq, next)])?;
        next = argmax(&logits[0]);
        generated.push(next);
    }
    engine.finish(first.seq);
    println!(
        "{} prompt tokens computed, {} from cache; generated {generated:?}",
        first.computed_tokens,
        first.cached.total()
    );

    // Every full block went to the store as it filled; wait for them to be
    // written, then empty G1 and G2 as a restart would.
    engine.flush_offload()?;
    if let Some(store) = engine.store() {
        store.flush()?;
        store.evict_memory()?;
    }
    engine.evict_g1();

    // The same prompt: its full blocks are read back from G3 (checked
    // before use), only the rest is computed.
    let again = engine.prefill(&prompt)?;
    println!(
        "again: {} tokens restored from G3 ({} bytes), {} computed",
        again.cached.g3, again.restored_bytes, again.computed_tokens
    );
    engine.finish(again.seq);
    Ok(())
}
