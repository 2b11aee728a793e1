//! Inter-token latency of sequences that decode while another request
//! restores a long prefix from G3 or G4, against the same sequences
//! decoding with no restore going on: does a restore stall decode?
//!
//! ```text
//! cargo run --release -p kvtier-lab -- decode_beside_restore \
//!     [--model DIR] [--tier g3|g4] [--remote redis://HOST:PORT] \
//!     [--prefix-tokens 4096] [--restores 5] [--decoders 4] \
//!     [--kv-offload-codec none|bf16|fp8-e4m3|int8] [--no-layerwise-restore] \
//!     [--restore-yield K] [--json]
//! ```
//!
//! 1. A first engine computes `--restores` distinct prompts of
//!    `--prefix-tokens + 1` tokens; their KV goes to G3 (under a temporary
//!    cache directory) or, with `--tier g4`, through to the pool at
//!    `--remote`; the engine closes its store.
//! 2. A second engine (a restarted server: empty G1 and G2; for g4 no G3 at
//!    all) runs the scheduler as `kvtier serve` does (batches of 8, 50 ms
//!    window when idle). `--decoders` sequences decode; once each has 16
//!    tokens, 3 s of their inter-token gaps start the baseline.
//! 3. Then, one after another with 1 s between, each long prompt is sent
//!    (max 1 token): its prefix is restored, its last token computed.
//!    A decoder's gap counts as "during a restore" when it overlaps the time
//!    from that request's submission to its first token; the gaps between
//!    the restores (overlapping none) join the baseline, so both sets span
//!    the same contexts (the decoders' contexts grow all along, and so
//!    does their step time).
//!
//! `--restore-yield K` sets `EngineOptions::restore_yield` (default
//! `DEFAULT_RESTORE_YIELD`; 0: the restore never yields the CPU to the
//! decoders).
//!
//! Prints p50/p99 of both sets of gaps, their ratio, and each restore's
//! TTFT and cached tokens. Default model: the embedded `small` preset in a
//! temporary directory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kvtier_bench::reporting::stats;
use kvtier_engine::serving::sampling::SamplingParams;
use kvtier_engine::serving::scheduler::{BatchConfig, GenerateEvent, GenerateRequest, Scheduler};
use kvtier_engine::{Engine, EngineOptions, Preset, StoreOptions, write_preset};
use kvtier_store::RemoteConfig;

const BLOCK_TOKENS: usize = 256;

struct Args {
    model: Option<PathBuf>,
    g4: bool,
    remote: Option<String>,
    prefix_tokens: usize,
    restores: usize,
    decoders: usize,
    codec: kvtier_store::KvCodec,
    layerwise: bool,
    restore_yield: f64,
    json: bool,
}

fn parse_args(args: Vec<String>) -> Result<Args, String> {
    let mut a = Args {
        model: None,
        g4: false,
        remote: None,
        prefix_tokens: 4096,
        restores: 5,
        decoders: 4,
        codec: kvtier_store::KvCodec::None,
        layerwise: true,
        restore_yield: kvtier_engine::DEFAULT_RESTORE_YIELD,
        json: false,
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = Some(PathBuf::from(value()?)),
            "--tier" => {
                a.g4 = match value()?.as_str() {
                    "g3" => false,
                    "g4" => true,
                    t => return Err(format!("--tier g3 or g4, not {t}")),
                }
            }
            "--remote" => a.remote = Some(value()?),
            "--prefix-tokens" => a.prefix_tokens = value()?.parse().map_err(|e| format!("{e}"))?,
            "--restores" => a.restores = value()?.parse().map_err(|e| format!("{e}"))?,
            "--decoders" => a.decoders = value()?.parse().map_err(|e| format!("{e}"))?,
            "--kv-offload-codec" => {
                let name = value()?;
                a.codec = kvtier_store::KvCodec::from_name(&name).ok_or(format!(
                    "--kv-offload-codec none|bf16|fp8-e4m3|int8, not {name}"
                ))?;
            }
            "--no-layerwise-restore" => a.layerwise = false,
            "--restore-yield" => a.restore_yield = value()?.parse().map_err(|e| format!("{e}"))?,
            "--json" => a.json = true,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.g4 && a.remote.is_none() {
        return Err("--tier g4 needs --remote redis://HOST:PORT".into());
    }
    Ok(a)
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(31) + salt * 97 + 7) % 256)
        .collect()
}

fn store(a: &Args, cache: &Path) -> StoreOptions {
    StoreOptions {
        codec: a.codec,
        eviction: Default::default(),
        memory_bytes: 1 << 30,
        disk_dirs: if a.g4 {
            vec![]
        } else {
            vec![cache.to_path_buf()]
        },
        disk_bytes: if a.g4 { 0 } else { 8 << 30 },
        remote: a.remote.as_ref().filter(|_| a.g4).map(RemoteConfig::new),
        g3_sync: None,
    }
}

fn engine(model: &Path, a: &Args, cache: &Path) -> Result<Engine, String> {
    let opts = EngineOptions {
        block_tokens: BLOCK_TOKENS,
        pool_pages: 160,
        max_seq_tokens: 8192,
        layerwise_restore: a.layerwise,
        restore_yield: a.restore_yield,
        ..Default::default()
    };
    Engine::load(model, opts, Some(store(a, cache))).map_err(|e| e.to_string())
}

/// The `p`-th percentile (0..=100) of `v`; 0 for no samples.
fn percentile(v: &[f64], p: f64) -> f64 {
    stats::percentile(v, p).unwrap_or(0.0)
}

/// Runs the experiment: `args` are its flags.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn std::error::Error>> {
    measure(args).map_err(Into::into)
}

fn measure(args: Vec<String>) -> Result<(), String> {
    let a = parse_args(args)?;
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            let d = tmp.path().join("small");
            write_preset(Preset::Small, 0, &d).map_err(|e| e.to_string())?;
            d
        }
    };
    let cache = tmp.path().join("cache");
    let longs: Vec<Vec<u32>> = (0..a.restores)
        .map(|i| prompt(a.prefix_tokens + 1, 1000 + i as u32))
        .collect();

    // 1. Compute the long prompts' KV once, each written out before the
    //    next (the store's queues drop what does not fit, never wait).
    {
        let mut e = engine(&model, &a, &cache)?;
        for p in &longs {
            let out = e.prefill(p).map_err(|x| x.to_string())?;
            e.finish(out.seq);
            e.flush_offload().map_err(|x| x.to_string())?;
            if let Some(s) = e.store() {
                s.flush().map_err(|x| x.to_string())?;
            }
        }
    }

    // 2. A restarted engine; decoders in steady state.
    let sched = Scheduler::start(
        engine(&model, &a, &cache)?,
        BatchConfig {
            max_batch: 8,
            max_wait: Duration::from_millis(50),
        },
    )
    .map_err(|e| e.to_string())?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut decoders = Vec::new();
    for d in 0..a.decoders {
        let (tx, rx) = mpsc::channel();
        let req = GenerateRequest {
            salt: Vec::new(),
            prompt: prompt(32, d as u32),
            max_tokens: 7000,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
            events: tx.into(),
        };
        if !sched.submit(req) {
            return Err("the scheduler stopped".into());
        }
        let stop = stop.clone();
        decoders.push(std::thread::spawn(move || {
            let mut times = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(GenerateEvent::Token(_)) => times.push(Instant::now()),
                    Ok(GenerateEvent::Started { .. }) => {}
                    Ok(_) => break,
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            times
        }));
    }
    // Decoders report only when done; wait for steady state by time: 16
    // steps of a few decoders take well under 10 s on any machine here.
    std::thread::sleep(Duration::from_secs(6));
    let base_from = Instant::now();
    std::thread::sleep(Duration::from_secs(3));

    // 3. The restores, one at a time.
    let mut windows = Vec::new();
    let mut restores = Vec::new();
    for p in &longs {
        let (tx, rx) = mpsc::channel();
        let submitted = Instant::now();
        let req = GenerateRequest {
            salt: Vec::new(),
            prompt: p.clone(),
            max_tokens: 1,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
            events: tx.into(),
        };
        if !sched.submit(req) {
            return Err("the scheduler stopped".into());
        }
        let mut info = None;
        let first = loop {
            match rx.recv_timeout(Duration::from_secs(600)) {
                Ok(GenerateEvent::Started {
                    cached,
                    ttft_seconds,
                    restored_bytes,
                    ..
                }) => info = Some((cached, ttft_seconds, restored_bytes)),
                Ok(GenerateEvent::Token(_)) => break Instant::now(),
                Ok(other) => return Err(format!("restore request: {other:?}")),
                Err(e) => return Err(format!("restore request: {e}")),
            }
        };
        windows.push((submitted, first));
        restores.push(info.ok_or("no Started event")?);
        std::thread::sleep(Duration::from_secs(1));
    }
    let base_to = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let mut gaps_base = Vec::new();
    let mut gaps_during = Vec::new();
    for d in decoders {
        let times = d.join().map_err(|_| "a decoder thread failed")?;
        for w in times.windows(2) {
            let (t0, t1) = (w[0], w[1]);
            let gap = t1.duration_since(t0).as_secs_f64() * 1e3;
            if windows.iter().any(|&(s, f)| t0 < f && t1 > s) {
                gaps_during.push(gap);
            } else if t0 >= base_from && t1 <= base_to {
                gaps_base.push(gap);
            }
        }
    }
    drop(sched);

    let (nb, nd) = (gaps_base.len(), gaps_during.len());
    let (b50, b99) = (percentile(&gaps_base, 50.0), percentile(&gaps_base, 99.0));
    let (d50, d99) = (
        percentile(&gaps_during, 50.0),
        percentile(&gaps_during, 99.0),
    );
    let ttfts: Vec<f64> = restores.iter().map(|r| r.1).collect();
    let ttft50 = percentile(&ttfts, 50.0);
    let tier = if a.g4 { "g4" } else { "g3" };
    let cached: Vec<usize> = restores
        .iter()
        .map(|r| if a.g4 { r.0.g4 } else { r.0.g3 })
        .collect();
    let ratio = if b99 > 0.0 { d99 / b99 } else { 0.0 };
    if a.json {
        println!(
            "{{\"tier\":\"{tier}\",\"decoders\":{},\"prefix_tokens\":{},\"restores\":{},\
             \"itl_ms_without\":{{\"p50\":{b50:.2},\"p99\":{b99:.2},\"n\":{nb}}},\
             \"itl_ms_during\":{{\"p50\":{d50:.2},\"p99\":{d99:.2},\"n\":{nd}}},\
             \"restore_yield\":{},\"p99_ratio\":{ratio:.3},\"restore_ttft_p50_s\":{ttft50:.4},\
             \"cached_tokens\":{cached:?},\"restored_bytes\":{}}}",
            a.decoders,
            a.prefix_tokens,
            a.restores,
            a.restore_yield,
            restores.first().map_or(0, |r| r.2)
        );
    } else {
        println!(
            "{} decoders; {} restores of a {}-token prefix from {tier}",
            a.decoders, a.restores, a.prefix_tokens
        );
        println!("inter-token ms without a restore: p50 {b50:.1}  p99 {b99:.1}  ({nb} gaps)");
        println!("inter-token ms during restores:   p50 {d50:.1}  p99 {d99:.1}  ({nd} gaps)");
        println!("p99 during / without: {ratio:.2}");
        println!("restore TTFT p50 {ttft50:.3} s; cached tokens per restore {cached:?}");
    }
    Ok(())
}
