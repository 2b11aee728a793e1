//! Start here for kvtier-store: name KV blocks by a chained hash of their
//! tokens, put them into a store with a G2 (memory) and a G3 (disk) tier,
//! and restore the longest cached prefix of a longer prompt, from memory
//! and then from disk.
//!
//! ```text
//! cargo run --release -p kvtier-store --example tiered_store [CACHE_DIR]
//! ```
//!
//! Without `CACHE_DIR` the G3 files go to a temporary directory, removed at
//! the end.

use std::error::Error;
use std::path::PathBuf;

use kvtier_store::{
    DiskConfig, KeyChain, KvDtype, KvLayout, ModelFingerprint, StoreConfig, TieredStore,
};

fn main() -> Result<(), Box<dyn Error>> {
    let arg = std::env::args().nth(1);
    let cache = match &arg {
        Some(d) => PathBuf::from(d),
        None => std::env::temp_dir().join(format!("kvtier-store-example-{}", std::process::id())),
    };

    // One block: K and V of 2 layers x 2 heads x 64 dims for 16 tokens, f32.
    let layout = KvLayout::kv_major(2, 2, 64, 16, KvDtype::F32);
    let model = ModelFingerprint::of_bytes(b"the model's config and weights");
    let mut config = StoreConfig::new(layout, model);
    config.memory_bytes = 64 << 20;
    config.disk = Some(DiskConfig::new(vec![cache.clone()], 256 << 20, layout));
    let store = TieredStore::open(config)?;

    // Keys name whole prefixes: key i covers tokens 0 .. 16 * (i + 1).
    let chain = KeyChain::new(&model, &layout, b"tenant salt");
    let prompt: Vec<u32> = (0..100).collect();
    let keys = chain.keys(&prompt); // 6 full blocks of 16 tokens
    let payload = |i: usize| vec![i as u8; layout.payload_bytes() as usize];
    let blocks: Vec<_> = (0..4).map(payload).collect();
    let puts: Vec<_> = keys
        .iter()
        .zip(&blocks)
        .map(|(k, p)| (*k, p.as_slice()))
        .collect();
    let report = store.put_many(&puts)?;
    println!("stored {} blocks ({})", report.stored, layout);

    // A later request: the first 4 of its 6 blocks are cached.
    let found = store.lookup_prefix(&keys);
    println!(
        "cached prefix: {} blocks, tiers {:?}",
        found.hits(),
        found.tiers
    );
    let restored = store.read_prefix(&keys);
    assert_eq!(restored.len(), 4);
    assert!(
        restored
            .iter()
            .enumerate()
            .all(|(i, b)| b.payload() == payload(i))
    );

    // Empty G2: the same prefix now comes from disk, every block verified.
    store.evict_memory()?;
    let from_disk = store.read_prefix(&keys);
    println!(
        "after emptying G2: {} blocks restored from {:?}",
        from_disk.len(),
        from_disk.first().map(|b| b.tier)
    );
    print!("{}", store.metrics().render());
    store.close()?;
    if arg.is_none() {
        std::fs::remove_dir_all(&cache)?;
    }
    Ok(())
}
