//! The staging ring's cost, measured without a GPU: loads a model directory
//! in place (reads land in the final buffer) and staged through the ring
//! into host memory (`ThreadCopySink`: every chunk read into a staging
//! buffer, then copied out on one copy thread), alternating, with `O_DIRECT`
//! so every read reaches the device. Both run into a resident destination
//! (buffers recycled and re-zeroed between runs, as a GPU's memory is
//! resident), so what differs is the ring and the copy. Prints both rates
//! and their ratio: a ring that overlaps its copies with the reads keeps
//! the ratio near 1 while the copy engine outruns the disk.
//!
//! ```sh
//! cargo run --release -p kvtier-lab -- staged_vs_in_place MODEL_DIR [REPEATS]
//! ```

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier_bench::reporting::stats::median;
use kvtier_io::loader::staged::{DEFAULT_RING, ThreadCopySink, load_shards_staged};
use kvtier_io::loader::{LoaderConfig, load_shards, model_shards};
use kvtier_io::recycle::RecyclingAllocator;
use kvtier_io::{HostAllocator, IoEngine};

/// Runs the experiment: `args` are `MODEL_DIR [REPEATS]`.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn Error>> {
    measure(args).map_err(Into::into)
}

fn measure(args: Vec<String>) -> Result<(), String> {
    let mut args = args.into_iter();
    let dir = PathBuf::from(
        args.next()
            .ok_or("usage: kvtier-lab staged_vs_in_place MODEL_DIR [REPEATS]")?,
    );
    let repeats: usize = match args.next() {
        Some(n) => n.parse().map_err(|e| format!("REPEATS: {e}"))?,
        None => 3,
    };
    let paths = model_shards(&dir).map_err(|e| e.to_string())?;
    let cfg = LoaderConfig {
        direct: Some(true),
        ..LoaderConfig::default()
    };
    let recycling = Arc::new(RecyclingAllocator::new(64));
    let memory: Arc<dyn HostAllocator> = recycling.clone();
    let engine = IoEngine::shared();
    let in_place = || -> Result<f64, String> {
        recycling.rezero();
        let (shards, stats) =
            load_shards(&paths, &cfg, engine, &memory).map_err(|e| e.to_string())?;
        drop(shards);
        Ok(stats.gbps())
    };
    let staged = || -> Result<(f64, usize), String> {
        recycling.rezero();
        let sink = ThreadCopySink::new(Duration::ZERO)
            .map_err(|e| e.to_string())?
            .with_memory(memory.clone());
        let load = load_shards_staged(&paths, &cfg, DEFAULT_RING, engine, sink)
            .map_err(|e| e.to_string())?;
        Ok((load.stats.load.gbps(), load.stats.max_queued_copies))
    };
    // Untimed: fault the destination buffers in once.
    in_place()?;
    staged()?;
    let (mut a, mut b, mut queued) = (Vec::new(), Vec::new(), 0);
    for _ in 0..repeats {
        a.push(in_place()?);
        let (gbps, q) = staged()?;
        b.push(gbps);
        queued = queued.max(q);
    }
    let (ma, mb) = (median(&a), median(&b));
    println!("in place GB/s: {a:.2?} median {ma:.2}");
    println!(
        "staged   GB/s: {b:.2?} median {mb:.2} (ring {DEFAULT_RING}, up to {queued} copies queued)"
    );
    println!(
        "staged / in place: {:.2}",
        if ma > 0.0 { mb / ma } else { 0.0 }
    );
    Ok(())
}
