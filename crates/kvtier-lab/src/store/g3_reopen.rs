//! Measures how long G3 takes to open at several sizes, three ways side by
//! side: after a kill -9 (the checkpoint of the last open plus a journal of
//! every write since), after a clean stop (the checkpoint alone), and with
//! no saved index (a scan of every slot's header, what every open did
//! before the saved index).
//!
//! ```text
//! cargo run --release -p kvtier-lab -- g3_reopen \
//!     [--gib 1,4,16] [--block-kib 64] [--dir DIR] [--json]
//! ```
//!
//! Each size fills a fresh G3 completely with blocks of `--block-kib` KiB of
//! payload (2 layers, 2 KV heads of 64, f32; one 4 KiB page more per slot),
//! then drops it without a sync, which leaves the files as a kill -9 does
//! (the writes are in the page cache, nothing is checkpointed). The work
//! happens in a directory the experiment creates under `--dir` (default: the
//! system's temporary directory) and removes at the end; nothing else is
//! touched. Slot reads are direct I/O, so the scan reads the device, not
//! the page cache.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kvtier_io::{IoEngine, system_allocator};
use kvtier_store::block::encode_block;
use kvtier_store::metrics::TierMetrics;
use kvtier_store::{BlockKey, DiskConfig, DiskTier, KvDtype, KvLayout, ModelFingerprint, Recovery};

struct Args {
    gib: Vec<u64>,
    block_kib: u64,
    dir: PathBuf,
    json: bool,
}

fn parse(args: Vec<String>) -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        gib: vec![1, 4, 16],
        block_kib: 64,
        dir: std::env::temp_dir(),
        json: false,
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--gib" => {
                a.gib = value()?
                    .split(',')
                    .map(|s| s.trim().parse::<u64>())
                    .collect::<Result<_, _>>()?;
            }
            "--block-kib" => a.block_kib = value()?.parse()?,
            "--dir" => a.dir = PathBuf::from(value()?),
            "--json" => a.json = true,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    if a.block_kib < 2 || !a.block_kib.is_multiple_of(2) {
        return Err("--block-kib must be even and at least 2".into());
    }
    if a.gib.is_empty() || a.gib.contains(&0) {
        return Err("--gib takes sizes of at least 1".into());
    }
    Ok(a)
}

fn open(config: &DiskConfig) -> Result<(DiskTier, f64), Box<dyn Error>> {
    let t = Instant::now();
    let tier = DiskTier::open(
        config.clone(),
        IoEngine::shared().clone(),
        system_allocator(),
        TierMetrics::default(),
    )?;
    Ok((tier, t.elapsed().as_secs_f64()))
}

fn key(i: u64) -> BlockKey {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&i.to_le_bytes());
    k[8..].copy_from_slice(&(!i).to_le_bytes());
    BlockKey(k)
}

/// One size: (slots, kill -9 s, clean s, scan s).
fn measure(
    root: &Path,
    gib: u64,
    layout: KvLayout,
) -> Result<(u64, f64, f64, f64), Box<dyn Error>> {
    let dir = root.join(format!("{gib}gib"));
    std::fs::create_dir_all(&dir)?;
    let config = DiskConfig::new(vec![dir.clone()], gib << 30, layout);
    let model = ModelFingerprint::of_bytes(b"g3 reopen");
    let alloc = system_allocator();
    let payload = vec![7u8; layout.payload_bytes() as usize];
    let (tier, _) = open(&config)?;
    let slots = tier.capacity_slots() as u64;
    let batch = ((64u64 << 20) / layout.encoded_bytes()).max(1);
    let mut next = 0u64;
    while next < slots {
        let end = (next + batch).min(slots);
        let blocks = (next..end)
            .map(|i| {
                Ok((
                    key(i),
                    Arc::new(encode_block(key(i), model, layout, 0, &payload, &alloc)?),
                ))
            })
            .collect::<Result<Vec<_>, kvtier_store::BlockError>>()?;
        for r in tier.put_many(&blocks) {
            r?;
        }
        next = end;
    }
    // Dropped unsynced: the files as a kill -9 leaves them.
    drop(tier);

    let (tier, killed) = open(&config)?;
    match tier.recovery() {
        Recovery::Saved { blocks, .. } if *blocks as u64 == slots => {}
        other => return Err(format!("{gib} GiB after the kill: {other:?}").into()),
    }
    tier.sync()?;
    drop(tier);

    let (tier, clean) = open(&config)?;
    match tier.recovery() {
        Recovery::Saved {
            blocks,
            replayed: 0,
        } if *blocks as u64 == slots => {}
        other => return Err(format!("{gib} GiB after a clean stop: {other:?}").into()),
    }
    drop(tier);

    std::fs::remove_file(DiskTier::slot_dir(&dir, &layout).join("index.kvti"))?;
    let (tier, scan) = open(&config)?;
    if !matches!(tier.recovery(), Recovery::Scanned { .. }) || tier.len() as u64 != slots {
        return Err(format!(
            "{gib} GiB scan: {:?}, {} blocks",
            tier.recovery(),
            tier.len()
        )
        .into());
    }
    drop(tier);
    Ok((slots, killed, clean, scan))
}

/// Runs the experiment: `args` are its flags.
pub fn run(args: Vec<String>) -> Result<(), Box<dyn Error>> {
    let a = parse(args)?;
    let layout = KvLayout::kv_major(2, 2, 64, (a.block_kib / 2) as u32, KvDtype::F32);
    let root = a
        .dir
        .join(format!("kvtier-g3-reopen-{}", std::process::id()));
    if root.exists() {
        return Err(format!("{} exists; not touching it", root.display()).into());
    }
    std::fs::create_dir_all(&root)?;
    let mut rows = Vec::new();
    let mut result = Ok(());
    for &gib in &a.gib {
        match measure(&root, gib, layout) {
            Ok((slots, killed, clean, scan)) => {
                if !a.json {
                    println!(
                        "{gib:>3} GiB, {slots} slots of {} bytes: open after kill -9 {killed:.3} s, \
                         after a clean stop {clean:.3} s, scan of every slot {scan:.3} s \
                         (scan / saved index: {:.1}x after kill -9, {:.1}x after a clean stop)",
                        layout.encoded_bytes(),
                        scan / killed,
                        scan / clean
                    );
                }
                rows.push(format!(
                    "{{\"gib\":{gib},\"slots\":{slots},\"slot_bytes\":{},\"kill9_s\":{killed:.4},\"clean_s\":{clean:.4},\"scan_s\":{scan:.4}}}",
                    layout.encoded_bytes()
                ));
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
        // Each size's files go before the next is written.
        let _ = std::fs::remove_dir_all(root.join(format!("{gib}gib")));
    }
    let _ = std::fs::remove_dir_all(&root);
    if a.json {
        println!("[{}]", rows.join(","));
    }
    result
}
