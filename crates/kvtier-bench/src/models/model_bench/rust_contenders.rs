//! The Rust contenders of `kvtier model bench`: each loads every shard of a
//! model and touches every tensor, timed from the first open to the last
//! byte touched (freeing the result is not timed).
//!
//! * `naive`: `std::fs::read` of each shard into a fresh `Vec` (warm: a
//!   pre-touched `Vec`, filled with `read_exact`), parsed with the
//!   `safetensors` crate.
//! * `mmap`: `memmap2` + `SafeTensors::deserialize`, the crate's usual use;
//!   the page cache is its destination, so it has no warm-destination form.
//! * `kvtier`: [`kvtier_io::loader::load_shards`] (warm: its allocator hands
//!   out buffers that were touched before timing).
//!
//! "Touching" reads one `u64` per 4 KiB of every tensor (and its last byte)
//! into a checksum that goes through [`std::hint::black_box`], so no read
//! can be optimised away and an mmap'd tensor is really faulted in.

use std::fs::File;
use std::hint::black_box;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::bench_error::{BenchError, Result, StepContext, fail};
use kvtier_io::loader::{LoadStats, LoaderConfig, load_shards};
use kvtier_io::{HostAllocator, IoEngine};
use safetensors::SafeTensors;

/// What one timed load did.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// Bytes loaded (the shard files' total length).
    pub bytes: u64,
    /// Seconds from the first open to the last tensor touched.
    pub seconds: f64,
    /// Tensors seen.
    pub tensors: usize,
    /// The touch checksum (the same for every contender on one model).
    pub checksum: u64,
}

impl Loaded {
    /// GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e9
    }
}

/// Sums one little-endian `u64` per 4 KiB of `data` (a shorter read at the
/// end of a page run) plus its last byte.
pub fn touch(data: &[u8]) -> u64 {
    let mut acc = 0u64;
    for page in data.chunks(4096) {
        let mut w = [0u8; 8];
        let n = page.len().min(8);
        w[..n].copy_from_slice(&page[..n]);
        acc = acc.wrapping_add(u64::from_le_bytes(w));
    }
    if let Some(&last) = data.last() {
        acc = acc.wrapping_add(u64::from(last));
    }
    black_box(acc)
}

/// Parses `bytes` (the whole file `path`) with the `safetensors` crate and
/// touches every tensor. Returns (tensors, checksum).
fn parse_and_touch(path: &Path, bytes: &[u8]) -> Result<(usize, u64)> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| BenchError::Failed(format!("{}: safetensors crate: {e}", path.display())))?;
    let mut acc = 0u64;
    let mut n = 0;
    for (_name, view) in st.iter() {
        acc = acc.wrapping_add(touch(view.data()));
        n += 1;
    }
    Ok((n, acc))
}

fn file_len(path: &Path) -> Result<u64> {
    Ok(std::fs::metadata(path)
        .with_step(|| format!("cannot stat {}", path.display()))?
        .len())
}

/// `naive`, fresh memory: `std::fs::read` + parse, shard by shard.
pub fn naive(paths: &[PathBuf]) -> Result<Loaded> {
    let t = Instant::now();
    let mut held = Vec::with_capacity(paths.len());
    let (mut tensors, mut checksum, mut bytes) = (0, 0u64, 0u64);
    for p in paths {
        let data = std::fs::read(p).with_step(|| format!("cannot read {}", p.display()))?;
        let (n, acc) = parse_and_touch(p, &data)?;
        tensors += n;
        checksum = checksum.wrapping_add(acc);
        bytes += data.len() as u64;
        held.push(data);
    }
    let seconds = t.elapsed().as_secs_f64();
    drop(black_box(held));
    Ok(Loaded {
        bytes,
        seconds,
        tensors,
        checksum,
    })
}

/// Destination buffers for `naive` in warm mode: one `Vec` per shard, sized
/// to it and touched once.
#[derive(Debug)]
pub struct NaivePool {
    bufs: Vec<Vec<u8>>,
}

impl NaivePool {
    /// Allocates and touches one buffer per shard in `paths`.
    pub fn new(paths: &[PathBuf]) -> Result<Self> {
        let mut bufs = Vec::with_capacity(paths.len());
        for p in paths {
            let len = usize::try_from(file_len(p)?).step("shard too large")?;
            // `vec![1; n]` writes every byte (unlike a zeroed allocation,
            // which the kernel maps lazily).
            bufs.push(vec![1u8; len]);
        }
        Ok(Self { bufs })
    }
}

/// `naive`, warm destination: each shard read with `read_exact` into its
/// pre-touched `Vec`, then parsed.
pub fn naive_warm(paths: &[PathBuf], pool: &mut NaivePool) -> Result<Loaded> {
    let t = Instant::now();
    let (mut tensors, mut checksum, mut bytes) = (0, 0u64, 0u64);
    for (p, buf) in paths.iter().zip(pool.bufs.iter_mut()) {
        let mut f = File::open(p).with_step(|| format!("cannot open {}", p.display()))?;
        let len = f
            .metadata()
            .with_step(|| format!("cannot stat {}", p.display()))?
            .len();
        if len != buf.len() as u64 {
            fail!("{} changed size during the bench", p.display());
        }
        f.read_exact(buf)
            .with_step(|| format!("cannot read {}", p.display()))?;
        let (n, acc) = parse_and_touch(p, buf)?;
        tensors += n;
        checksum = checksum.wrapping_add(acc);
        bytes += len;
    }
    Ok(Loaded {
        bytes,
        seconds: t.elapsed().as_secs_f64(),
        tensors,
        checksum,
    })
}

/// `mmap`: map each shard, parse it, touch every page of every tensor.
pub fn mmap(paths: &[PathBuf]) -> Result<Loaded> {
    let t = Instant::now();
    let mut maps = Vec::with_capacity(paths.len());
    let (mut tensors, mut checksum, mut bytes) = (0, 0u64, 0u64);
    for p in paths {
        let f = File::open(p).with_step(|| format!("cannot open {}", p.display()))?;
        // SAFETY: the bench's own model files are not modified while mapped
        // (the same assumption every mmap loader makes).
        let map = unsafe { memmap2::Mmap::map(&f) }
            .with_step(|| format!("cannot mmap {}", p.display()))?;
        let (n, acc) = parse_and_touch(p, &map)?;
        tensors += n;
        checksum = checksum.wrapping_add(acc);
        bytes += map.len() as u64;
        maps.push(map);
    }
    let seconds = t.elapsed().as_secs_f64();
    drop(black_box(maps));
    Ok(Loaded {
        bytes,
        seconds,
        tensors,
        checksum,
    })
}

/// `kvtier`: the loader, buffers from `alloc`; every tensor touched.
/// Returns the load and the loader's own statistics.
pub fn kvtier(
    paths: &[PathBuf],
    cfg: &LoaderConfig,
    engine: &IoEngine,
    alloc: &Arc<dyn HostAllocator>,
) -> Result<(Loaded, LoadStats)> {
    let t = Instant::now();
    let (shards, stats) = load_shards(paths, cfg, engine, alloc).step("kvtier loader")?;
    let (mut tensors, mut checksum) = (0, 0u64);
    for s in &shards {
        for v in s.tensors() {
            checksum = checksum.wrapping_add(touch(v.data));
            tensors += 1;
        }
    }
    let seconds = t.elapsed().as_secs_f64();
    drop(black_box(shards));
    Ok((
        Loaded {
            bytes: stats.bytes,
            seconds,
            tensors,
            checksum,
        },
        stats,
    ))
}

#[cfg(test)]
mod tests {
    use kvtier_io::system_allocator;

    use super::*;
    use crate::models::model_synth::{plan_model, write_model};

    #[test]
    fn touch_reads_one_word_per_page() {
        assert_eq!(touch(&[]), 0);
        assert_eq!(touch(&[3]), 3 + 3);
        let mut v = vec![0u8; 8192 + 5];
        v[0] = 1;
        v[4096] = 2;
        v[8192] = 4;
        v[8192 + 4] = 9;
        assert_eq!(touch(&v), 1 + 2 + 4 + (9 << 32) + 9);
    }

    #[test]
    fn every_contender_sees_the_same_model() {
        let dir = tempfile::tempdir().unwrap();
        let plan = plan_model(2 << 20, 2).unwrap();
        let model = write_model(dir.path(), &plan, 3, true).unwrap();
        let paths = model.files.clone();
        let a = naive(&paths).unwrap();
        let mut pool = NaivePool::new(&paths).unwrap();
        let b = naive_warm(&paths, &mut pool).unwrap();
        let c = mmap(&paths).unwrap();
        let (d, stats) = kvtier(
            &paths,
            &LoaderConfig::default(),
            IoEngine::shared(),
            &system_allocator(),
        )
        .unwrap();
        for l in [&a, &b, &c, &d] {
            assert_eq!(l.bytes, model.file_bytes);
            assert_eq!(l.tensors, model.tensors);
            assert_eq!(l.checksum, a.checksum);
            assert!(l.gbps() > 0.0);
        }
        assert_eq!(stats.shards, 2);
    }
}
