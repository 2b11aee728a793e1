//! Write a small synthetic safetensors model, load it once with the kvtier
//! loader, and read it once more raw (O_DIRECT where the file system takes
//! it) to compare with the device's limit: the pieces `kvtier model synth`,
//! `kvtier model load` and `kvtier model bench` are made of.
//!
//! ```sh
//! cargo run -p kvtier-bench --example synth_and_load
//! ```

use kvtier_bench::TextReport;
use kvtier_bench::machine::device_limit::DeviceLimit;
use kvtier_bench::models::model_load::{ModelLoadOptions, run_model_load};
use kvtier_bench::models::model_synth::{ModelSynthOptions, run_model_synth};
use kvtier_io::{IoEngine, probe_direct};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let model = dir.path().join("synthetic");

    // 64 MiB of pseudo-random F16/F32 tensors in 2 shards, with the index.
    let synth = run_model_synth(&ModelSynthOptions {
        bytes: 64 << 20,
        progress: false,
        ..ModelSynthOptions::new(&model)
    })?;
    print!("{}", synth.table());

    // One load into host memory (page cache as it is: not a cold load).
    let load = run_model_load(&ModelLoadOptions {
        progress: false,
        ..ModelLoadOptions::new(&model)
    })?;
    print!("{}", load.table());

    // The raw read rate of the same files, 4 MiB reads, 32 in flight.
    let direct = probe_direct(&model).direct;
    let mut limit = DeviceLimit::over_files(&synth.model.files, 64 << 20, 4 << 20, direct)?;
    let gbps = limit.measure(IoEngine::shared())?;
    println!(
        "raw read of the shards: {gbps:.2} GB/s ({}); the loader reached {:.2} of it",
        if direct { "O_DIRECT" } else { "buffered" },
        load.gbps / gbps.max(1e-9)
    );
    Ok(())
}
