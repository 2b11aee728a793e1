//! Measures the bounded write-back: how long after a block is put into G2
//! it is on G3 (so a kill -9 would not lose it), while blocks keep coming at
//! a steady rate, as a prefill produces them.
//!
//! ```text
//! cargo run --release -p kvtier-lab -- g3_sync_bound \
//!     [--sync-ms 1000] [--seconds 20] [--blocks-per-s 8] [--dir DIR]
//! ```
//!
//! Blocks are the `small` preset's (8 layers, 4 KV heads of 64, 256 tokens,
//! f32: 4 MiB); G2 holds them all, so nothing reaches G3 by eviction. A
//! poller checks every 2 ms which blocks G3 holds; the output is the delay
//! from put to on-G3, p50 / p99 / max, in milliseconds (and JSON with
//! `--json`).

use std::collections::VecDeque;
use std::error::Error;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvtier_bench::reporting::stats::percentile;
use kvtier_store::{
    BlockKey, DiskConfig, KeyChain, KvDtype, KvLayout, ModelFingerprint, StoreConfig, TieredStore,
};

struct Args {
    sync_ms: u64,
    seconds: u64,
    blocks_per_s: u64,
    dir: Option<PathBuf>,
    json: bool,
}

fn parse(args: Vec<String>) -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        sync_ms: 1000,
        seconds: 20,
        blocks_per_s: 8,
        dir: None,
        json: false,
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--sync-ms" => a.sync_ms = value()?.parse()?,
            "--seconds" => a.seconds = value()?.parse()?,
            "--blocks-per-s" => a.blocks_per_s = value()?.parse::<u64>()?.max(1),
            "--dir" => a.dir = Some(PathBuf::from(value()?)),
            "--json" => a.json = true,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    Ok(a)
}

/// Runs the experiment: `args` are its flags.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn Error>> {
    let a = parse(args)?;
    let tmp = std::env::temp_dir().join(format!("kvtier-g3-sync-{}", std::process::id()));
    let dir = a.dir.clone().unwrap_or_else(|| tmp.clone());
    let layout = KvLayout::kv_major(8, 4, 64, 256, KvDtype::F32);
    let model = ModelFingerprint::of_bytes(b"g3 sync bound");
    let total = a.seconds * a.blocks_per_s;
    let mut config = StoreConfig::new(layout, model);
    config.memory_bytes = (total + 8) * layout.encoded_bytes();
    config.disk = Some(DiskConfig::new(
        vec![dir.clone()],
        (total + 8) * layout.encoded_bytes(),
        layout,
    ));
    config.g3_sync = (a.sync_ms > 0).then(|| Duration::from_millis(a.sync_ms));
    let store = TieredStore::open(config)?;
    let disk = store.disk().ok_or("no G3")?;

    let chain = KeyChain::new(&model, &layout, b"");
    let tokens: Vec<u32> = (0..(total * 256) as u32).collect();
    let keys: Vec<BlockKey> = chain.keys(&tokens);
    let payload = vec![7u8; layout.payload_bytes() as usize];
    let every = Duration::from_secs_f64(1.0 / a.blocks_per_s as f64);

    let t0 = Instant::now();
    let mut waiting: VecDeque<(BlockKey, Instant)> = VecDeque::new();
    let mut delays_ms = Vec::with_capacity(keys.len());
    let mut next = 0usize;
    let deadline =
        t0 + Duration::from_secs(a.seconds) + Duration::from_millis(a.sync_ms * 3 + 5000);
    while (next < keys.len() || !waiting.is_empty()) && Instant::now() < deadline {
        let due = t0 + every * next as u32;
        if next < keys.len() && Instant::now() >= due {
            store.put_many(&[(keys[next], payload.as_slice())])?;
            waiting.push_back((keys[next], Instant::now()));
            next += 1;
        }
        let ks: Vec<BlockKey> = waiting.iter().map(|(k, _)| *k).collect();
        let held = disk.contains_many(&ks);
        let now = Instant::now();
        let mut still = VecDeque::new();
        for ((k, at), on_g3) in waiting.into_iter().zip(held) {
            if on_g3 {
                delays_ms.push((now - at).as_secs_f64() * 1e3);
            } else {
                still.push_back((k, at));
            }
        }
        waiting = still;
        std::thread::sleep(Duration::from_millis(2));
    }
    let lost = waiting.len();
    delays_ms.sort_by(f64::total_cmp);
    let (p50, p99, max) = (
        percentile(&delays_ms, 50.0).unwrap_or(0.0),
        percentile(&delays_ms, 99.0).unwrap_or(0.0),
        delays_ms.last().copied().unwrap_or(0.0),
    );
    drop(store);
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    if a.json {
        println!(
            "{{\"sync_ms\":{},\"blocks\":{},\"block_bytes\":{},\"blocks_per_s\":{},\"delay_ms\":{{\"p50\":{p50:.1},\"p99\":{p99:.1},\"max\":{max:.1}}},\"not_on_g3\":{lost}}}",
            a.sync_ms,
            delays_ms.len(),
            layout.encoded_bytes(),
            a.blocks_per_s
        );
    } else {
        println!(
            "{} blocks of {} bytes at {}/s, sync every {} ms: put -> on G3 p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms; {lost} never on G3",
            delays_ms.len(),
            layout.encoded_bytes(),
            a.blocks_per_s,
            a.sync_ms
        );
    }
    Ok(())
}
