//! How fast each KV codec codes and decodes one block on one core: the
//! offload path pays the coding, a restore the decoding (fused with the
//! copy into the engine's page). Beside them, the plain copy each replaces.
//!
//! ```sh
//! cargo run --release -p kvtier-lab -- codec_speed
//! ```
//!
//! The block is the 100 M reference Llama's (12 layers x 4 KV heads x 64 head
//! dim x 256 tokens, f32: 6 MiB), filled with normal-ish values whose rows
//! differ in size by up to 10^6.

use std::error::Error;
use std::time::Instant;

use kvtier_store::{KvCodec, KvDtype, KvLayout};

/// Runs the experiment (it reads no arguments).
pub fn run(_args: Vec<String>) -> Result<(), Box<dyn Error>> {
    let layout = KvLayout::kv_major(12, 4, 64, 256, KvDtype::F32);
    let n = (layout.payload_bytes() / 4) as usize;
    let values: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.37).sin()) * 10f32.powi((i / 64 % 7) as i32 - 3))
        .collect();
    let logical: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut back = vec![0u8; logical.len()];
    let reps = 20;
    println!(
        "block: {layout}, {:.1} MiB of f32; GB/s of f32 KV (10^9 bytes/s), best of {reps}",
        logical.len() as f64 / (1 << 20) as f64
    );
    println!(
        "{:>9}  {:>8}  {:>10}  {:>10}",
        "codec", "stored", "code GB/s", "decode GB/s"
    );
    for codec in KvCodec::ALL {
        let l = layout.with_codec(codec);
        let mut stored = vec![0u8; l.stored_payload_bytes() as usize];
        let mut best = (f64::MAX, f64::MAX);
        for _ in 0..reps {
            let t = Instant::now();
            if let Err(e) = l.encode_into(0, &logical, &mut stored) {
                eprintln!("{codec}: {e}");
                return Ok(());
            }
            let code = t.elapsed().as_secs_f64();
            let t = Instant::now();
            if let Err(e) = l.decode_into(&stored, 0, &mut back) {
                eprintln!("{codec}: {e}");
                return Ok(());
            }
            let decode = t.elapsed().as_secs_f64();
            best = (best.0.min(code), best.1.min(decode));
        }
        let gbps = |s: f64| logical.len() as f64 / s / 1e9;
        println!(
            "{:>9}  {:>7.2}x  {:>10.2}  {:>10.2}",
            codec.name(),
            logical.len() as f64 / stored.len() as f64,
            gbps(best.0),
            gbps(best.1)
        );
    }
    Ok(())
}
