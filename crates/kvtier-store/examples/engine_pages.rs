//! kvtier-store under another engine: the engine owns its KV pages (here
//! laid out as vLLM's CPU backend lays them out: per layer one tensor
//! `[num_blocks, num_kv_heads, block_size, 2 * head_size]`) and names its
//! blocks with its own hashes. It saves pages straight from its tensors,
//! a new process finds them on disk, and loads them into other pages, each
//! block reported hit, miss, corrupt or error.
//!
//! ```text
//! cargo run --release -p kvtier-store --example engine_pages [CACHE_DIR]
//! ```
//!
//! Without `CACHE_DIR` the G3 files go to a temporary directory, removed at
//! the end.

use std::error::Error;
use std::path::{Path, PathBuf};

use kvtier_store::{
    BlockRegions, BlockResult, DiskConfig, KeyChain, KvDtype, KvLayout, ModelFingerprint,
    StoreConfig, TieredStore,
};

/// vLLM's CPU KV cache for a 4-layer model with 2 KV heads of 64, f32.
const LAYERS: u32 = 4;
const BLOCKS: usize = 32;

fn open(cache: &Path, layout: KvLayout) -> Result<TieredStore, Box<dyn Error>> {
    let mut config = StoreConfig::new(
        layout,
        ModelFingerprint::of_bytes(b"model config + weights"),
    );
    config.memory_bytes = 64 << 20;
    config.disk = Some(DiskConfig::new(
        vec![cache.to_path_buf()],
        256 << 20,
        layout,
    ));
    Ok(TieredStore::open(config)?)
}

/// The regions of page `page` of every layer's tensor: one per layer
/// (`layer-fused`: the store does not split K from V).
fn page_regions(
    layout: &KvLayout,
    tensors: &mut [Vec<f32>],
    page: usize,
) -> Result<BlockRegions, Box<dyn Error>> {
    let floats = (layout.layer_bytes() / 4) as usize;
    let mut pieces = Vec::new();
    for (l, t) in tensors.iter_mut().enumerate() {
        let range = layout.layer_range(l as u32).ok_or("a layer-fused layout")?;
        let page = &mut t[page * floats..(page + 1) * floats];
        pieces.push((range.start, page.as_mut_ptr().cast::<u8>(), floats * 4));
    }
    // SAFETY: the tensors outlive every transfer below, each waited for
    // before they are touched again.
    Ok(unsafe { BlockRegions::from_raw(layout, &pieces)? })
}

fn main() -> Result<(), Box<dyn Error>> {
    let arg = std::env::args().nth(1);
    let cache = match &arg {
        Some(d) => PathBuf::from(d),
        None => std::env::temp_dir().join(format!("kvtier-engine-pages-{}", std::process::id())),
    };
    let layout = KvLayout::vllm_cpu(LAYERS, 2, 64, 16, KvDtype::F32);
    let floats = (layout.layer_bytes() / 4) as usize;
    // The engine's own block hashes (vLLM's chain its parents), scoped by
    // model, layout and tenant into store keys (docs/keys.md).
    let chain = KeyChain::new(
        &ModelFingerprint::of_bytes(b"model config + weights"),
        &layout,
        b"",
    );
    let keys: Vec<_> = (0..BLOCKS as u64)
        .map(|h| chain.raw_key(&h.to_le_bytes()))
        .collect();

    let mut cache_tensors: Vec<Vec<f32>> = (0..LAYERS)
        .map(|l| {
            (0..BLOCKS * floats)
                .map(|i| (i as f32) * 0.5 + l as f32)
                .collect()
        })
        .collect();
    {
        let store = open(&cache, layout)?;
        let srcs = (0..BLOCKS)
            .map(|p| page_regions(&layout, &mut cache_tensors, p))
            .collect::<Result<Vec<_>, _>>()?;
        let saved = store.save(keys.clone(), srcs, None)?.wait();
        let stored = saved.iter().filter(|r| **r == BlockResult::Stored).count();
        println!(
            "saved {stored} of {BLOCKS} pages ({} KiB each)",
            layout.payload_bytes() / 1024
        );
        store.close()?;
    }

    // A new process: the pages are on disk.
    let store = open(&cache, layout)?;
    let cached = store.lookup_prefix(&keys).hits();
    println!("after a restart, {cached} of {BLOCKS} blocks are cached");
    let mut restored: Vec<Vec<f32>> = (0..LAYERS).map(|_| vec![0.0; BLOCKS * floats]).collect();
    let dests = (0..BLOCKS)
        .map(|p| page_regions(&layout, &mut restored, p))
        .collect::<Result<Vec<_>, _>>()?;
    let t = std::time::Instant::now();
    let results = store.load(keys, dests, None)?.wait();
    let hits = results
        .iter()
        .filter(|r| matches!(r, BlockResult::Hit(_)))
        .count();
    println!(
        "loaded {hits} blocks in {:.1} ms: {:?}",
        t.elapsed().as_secs_f64() * 1e3,
        results.first()
    );
    if restored != cache_tensors {
        return Err("restored pages differ".into());
    }
    println!("restored pages equal the saved ones");
    drop(store);
    if arg.is_none() {
        std::fs::remove_dir_all(&cache)?;
    }
    Ok(())
}
