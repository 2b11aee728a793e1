//! TTFT of a prompt whose long prefix is restored from G3 (disk) and whose
//! suffix is new, with the prefix restored whole first (the baseline) and
//! layer by layer (the forward pass starting while later layers are read),
//! beside the two parts alone: the restore, and the suffix computed with
//! the prefix already in G1, and how long the layer-wise forward pass
//! stood waiting for restored layers. Rounds alternate the modes; medians
//! printed.
//!
//! `cargo run --release -p kvtier-lab -- layer_restore_ttft
//! [--model DIR] [--prefix 4096] [--suffix 1,64,256] [--rounds 5]
//! [--kv-offload-codec none] [--device cpu|cuda:N] [--json]`
//!
//! Default model: the `small` preset, written to a temp dir. The goal is
//! layer-wise TTFT within 1.15x of max(restore, suffix compute).

use std::time::Instant;

use kvtier_bench::reporting::stats::median;
use kvtier_engine::{Engine, EngineError, EngineOptions, Preset, StoreOptions, write_preset};
use kvtier_store::KvCodec;

struct Args {
    model: Option<std::path::PathBuf>,
    prefix: usize,
    suffixes: Vec<usize>,
    rounds: usize,
    codec: KvCodec,
    device: String,
    json: bool,
}

fn parse(args: Vec<String>) -> Result<Args, String> {
    let mut a = Args {
        model: None,
        prefix: 4096,
        suffixes: vec![1, 64, 256],
        rounds: 5,
        codec: KvCodec::None,
        device: "cpu".into(),
        json: false,
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = Some(value()?.into()),
            "--prefix" => a.prefix = value()?.parse().map_err(|e| format!("--prefix: {e}"))?,
            "--suffix" => {
                a.suffixes = value()?
                    .split(',')
                    .map(|s| s.trim().parse().map_err(|e| format!("--suffix: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--rounds" => a.rounds = value()?.parse().map_err(|e| format!("--rounds: {e}"))?,
            "--kv-offload-codec" => {
                let name = value()?;
                a.codec = KvCodec::from_name(&name).ok_or(format!("unknown codec {name:?}"))?
            }
            "--device" => a.device = value()?,
            "--json" => a.json = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.rounds == 0 || a.suffixes.contains(&0) {
        return Err("--rounds and every --suffix must be at least 1".into());
    }
    Ok(a)
}

/// Drops G1 and G2 (and the page cache, where allowed): the prefix is
/// then on disk only.
fn to_disk_only(e: &mut Engine) -> Result<(), EngineError> {
    e.evict_g1();
    if let Some(s) = e.store() {
        s.evict_memory().map_err(EngineError::from)?;
    }
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    Ok(())
}

/// One prefill's TTFT (seconds) and its restore report.
fn timed(e: &mut Engine, prompt: &[u32]) -> Result<(f64, kvtier_engine::Prefill), EngineError> {
    let t = Instant::now();
    let out = e.prefill(prompt)?;
    let ttft = t.elapsed().as_secs_f64();
    e.finish(out.seq);
    e.flush_offload()?;
    Ok((ttft, out))
}

/// Runs the experiment: `args` are its flags.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn std::error::Error>> {
    let args = parse(args)?;
    let tmp = std::env::temp_dir();
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => {
            let d = tmp.join("kvtier-speed-small");
            if !d.join("model.safetensors").exists() {
                write_preset(Preset::Small, 0, &d)?;
            }
            d
        }
    };
    let cache = tmp.join(format!("kvtier-layer-ttft-{}", std::process::id()));
    let bt = 256;
    let prefix_tokens = args.prefix.div_ceil(bt) * bt;
    let longest = prefix_tokens + args.suffixes.iter().max().copied().unwrap_or(1);
    let opts = EngineOptions {
        block_tokens: bt,
        pool_pages: 3 * longest.div_ceil(bt) + 8,
        max_seq_tokens: longest + 16,
        device: kvtier_engine::open_device(&args.device)?,
        ..Default::default()
    };
    let store = StoreOptions {
        codec: args.codec,
        eviction: Default::default(),
        memory_bytes: 1 << 30,
        disk_dirs: vec![cache.clone()],
        disk_bytes: 8 << 30,
        remote: None,
        g3_sync: None,
    };
    let mut e = Engine::load(&dir, opts, Some(store))?;
    let vocab = e.config().vocab_size as u32;
    let prefix: Vec<u32> = (0..prefix_tokens as u32)
        .map(|i| (i * 31 + 7) % vocab)
        .collect();
    // Store the prefix's blocks.
    let mut seed = prefix.clone();
    seed.push(1);
    timed(&mut e, &seed)?;
    let mut fresh = 0u32;
    let mut rows = Vec::new();
    for &s in &args.suffixes {
        let (mut restore, mut suffix, mut whole, mut layered, mut waited) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut restored_bytes = 0;
        for round in 0..args.rounds {
            // A suffix no cache holds, new each time.
            let mut prompt_for = || {
                fresh += 1;
                let mut p = prefix.clone();
                p.extend((0..s as u32).map(|i| (fresh * 7919 + i * 104_729) % vocab));
                p
            };
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for layer_wise in order {
                to_disk_only(&mut e)?;
                e.set_layerwise_restore(layer_wise);
                let (ttft, out) = timed(&mut e, &prompt_for())?;
                if out.cached.g3 != prefix_tokens {
                    return Err(format!(
                        "expected the {prefix_tokens}-token prefix from G3, got {:?}",
                        out.cached
                    )
                    .into());
                }
                restored_bytes = out.restored_bytes;
                if layer_wise {
                    layered.push(ttft);
                    waited.push(out.layer_wait_seconds);
                } else {
                    whole.push(ttft);
                    restore.push(out.restore_seconds);
                }
            }
            // The suffix alone: the prefix is in G1 now.
            let (ttft, out) = timed(&mut e, &prompt_for())?;
            if out.cached.g1 != prefix_tokens {
                return Err("expected the prefix from G1".into());
            }
            suffix.push(ttft);
        }
        let (r, c, w, l, lw) = (
            median(&restore),
            median(&suffix),
            median(&whole),
            median(&layered),
            median(&waited),
        );
        rows.push((s, r, c, w, l, lw, restored_bytes));
    }
    let _ = std::fs::remove_dir_all(&cache);
    if args.json {
        let list: Vec<String> = rows
            .iter()
            .map(|&(s, r, c, w, l, lw, b)| {
                format!(
                    "{{\"suffix_tokens\":{s},\"restore_s\":{r:.4},\"suffix_compute_s\":{c:.4},\
                     \"ttft_whole_s\":{w:.4},\"ttft_layer_wise_s\":{l:.4},\"layer_wait_s\":{lw:.5},\
                     \"layer_wise_over_max\":{:.3},\"whole_over_max\":{:.3},\"restored_bytes\":{b}}}",
                    l / r.max(c),
                    w / r.max(c)
                )
            })
            .collect();
        println!(
            "{{\"prefix_tokens\":{prefix_tokens},\"codec\":\"{}\",\"rounds\":{},\"rows\":[{}]}}",
            args.codec,
            args.rounds,
            list.join(",")
        );
        return Ok(());
    }
    println!(
        "prefix {prefix_tokens} tokens from G3 ({} MiB, codec {}), median of {} rounds",
        rows.first().map_or(0, |r| r.6 >> 20),
        args.codec,
        args.rounds
    );
    println!(
        "| suffix tokens | restore s | suffix compute s | TTFT whole first s | TTFT layer-wise s | layer-wise waited s | whole / max | layer-wise / max |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (s, r, c, w, l, lw, _) in rows {
        let m = r.max(c);
        println!(
            "| {s} | {r:.3} | {c:.3} | {w:.3} | {l:.3} | {lw:.4} | {:.2} | {:.2} |",
            w / m,
            l / m
        );
    }
    Ok(())
}
