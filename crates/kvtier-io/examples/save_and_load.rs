//! Start here for kvtier-io: save tensors as a crash-safe checkpoint, load
//! them back verified, and load the same files with the parallel
//! direct-I/O weight loader.
//!
//! ```text
//! cargo run --release -p kvtier-io --example save_and_load [DIR]
//! ```
//!
//! `DIR` (default: a new temporary directory, removed at the end) receives
//! the checkpoint:
//! sharded safetensors files and a `manifest.json` committed last.

use std::error::Error;
use std::path::PathBuf;

use kvtier_io::checkpoint::{self, SaveOptions, TensorRef};
use kvtier_io::loader::{LoaderConfig, load_shards};
use kvtier_io::safetensors::Dtype;
use kvtier_io::{IoEngine, system_allocator};

fn main() -> Result<(), Box<dyn Error>> {
    let arg = std::env::args().nth(1);
    let dir = match &arg {
        Some(d) => PathBuf::from(d),
        None => std::env::temp_dir().join(format!("kvtier-example-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir)?;

    // Two tensors: an f32 matrix and an f16-sized byte blob.
    let weights: Vec<u8> = (0..1024 * 1024u32)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    let bias = vec![7u8; 2 * 4096];
    let tensors = [
        TensorRef::new("layer.weight", Dtype::F32, &[1024, 1024], &weights),
        TensorRef::new("layer.bias", Dtype::F16, &[4096], &bias),
    ];

    // Save: parallel aligned writes, fsync, manifest committed by rename.
    let saved = checkpoint::save(&dir, &tensors, &SaveOptions::default())?;
    println!(
        "saved generation {} ({} bytes in {} file(s)) at {:.2} GB/s, direct I/O: {}",
        saved.generation,
        saved.bytes,
        saved.files.len(),
        saved.gbps(),
        saved.direct
    );

    // Load the checkpoint back: every tensor's crc32c is checked.
    let ckpt = checkpoint::load(&dir)?;
    let w = ckpt.tensor("layer.weight").ok_or("layer.weight missing")?;
    assert_eq!(w.data, weights.as_slice());
    println!(
        "checkpoint loaded and verified: {:?}",
        ckpt.names().collect::<Vec<_>>()
    );

    // The same files through the weight loader (what an engine uses for a
    // model directory): 8 MiB reads, many in flight, straight into one
    // buffer per shard.
    let (shards, stats) = load_shards(
        &saved.files,
        &LoaderConfig::default(),
        IoEngine::shared(),
        &system_allocator(),
    )?;
    let tensors: usize = shards.iter().map(|s| s.tensors().count()).sum();
    println!(
        "loader: {tensors} tensors (padding included), {} bytes in {:.3} s, {}, backend {}",
        stats.bytes,
        stats.seconds,
        if stats.direct { "direct" } else { "buffered" },
        stats.io_backend
    );
    if arg.is_none() {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}
