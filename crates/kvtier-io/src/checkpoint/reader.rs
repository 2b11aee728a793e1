//! Loading a committed checkpoint and verifying every tensor's checksum.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::checkpoint_error::CheckpointError;
use super::manifest::{self, Manifest, TensorEntry};
use crate::buffer::{HostAllocator, system_allocator};
use crate::io_engine::IoEngine;
use crate::loader::{LoadStats, LoadedShard, LoaderConfig, TensorView, load_shards};
use crate::safetensors::TensorInfo;

/// How [`load_with`] reads.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Read sizes, depth and direct-I/O policy of the shard loader.
    pub loader: LoaderConfig,
    /// The engine the reads run on.
    pub engine: IoEngine,
    /// Where the shard buffers come from.
    pub allocator: Arc<dyn HostAllocator>,
    /// Verify every tensor's crc32c (default true).
    pub verify: bool,
    /// Threads computing checksums (default: up to 4).
    pub threads: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            loader: LoaderConfig::default(),
            engine: IoEngine::shared().clone(),
            allocator: system_allocator(),
            verify: true,
            threads: super::options::default_threads(),
        }
    }
}

/// A loaded, verified checkpoint generation: the manifest and the shards'
/// bytes in memory. Only the tensors the manifest lists are visible; the
/// `__kvtier_pad_<n>` padding tensors in the shard files are not.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    shards: Vec<LoadedShard>,
    stats: LoadStats,
    index: HashMap<String, usize>,
}

impl Checkpoint {
    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its generation number.
    pub fn generation(&self) -> u64 {
        self.manifest.generation
    }

    /// The committed manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// What the shard loader did (bytes, seconds, direct or buffered).
    pub fn load_stats(&self) -> &LoadStats {
        &self.stats
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.manifest.tensors.len()
    }

    /// True when the checkpoint holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.manifest.tensors.is_empty()
    }

    /// Tensor names, in the order they were saved.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.manifest.tensors.iter().map(|t| t.name.as_str())
    }

    /// The tensor named `name` (never a padding tensor).
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let t = &self.manifest.tensors[*self.index.get(name)?];
        self.shards.get(t.shard)?.tensor(&t.name)
    }

    /// Every tensor, in the order they were saved.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.manifest
            .tensors
            .iter()
            .filter_map(|t| self.shards.get(t.shard)?.tensor(&t.name))
    }

    /// The loaded shard files, in manifest order.
    pub fn shards(&self) -> &[LoadedShard] {
        &self.shards
    }

    /// The loaded shard files, in manifest order, by value: hands the shard
    /// buffers to a caller that keeps them (the Python package gives each
    /// one to the arrays that view it). Padding tensors are still in their
    /// headers; look tensors up by the manifest's names.
    pub fn into_shards(self) -> Vec<LoadedShard> {
        self.shards
    }
}

/// Loads the committed checkpoint in `dir` with default options, verifying
/// every tensor's crc32c. Files of uncommitted generations are ignored.
pub fn load(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    load_with(dir, &LoadOptions::default())
}

/// Loads the committed checkpoint in `dir`.
///
/// Reads `manifest.json`, checks each shard file's length against it, loads
/// the shards with the [loader](crate::loader) (which validates their
/// headers), checks that every manifest tensor is in its shard with the
/// recorded dtype, shape and offsets, and (with `opts.verify`) compares
/// every tensor's crc32c with the manifest: a mismatch is
/// [`CheckpointError::Checksum`] naming the tensor.
///
/// If a save commits and retires this generation's files while they are
/// being read, the load starts over on the new generation (at most twice).
pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Checkpoint, CheckpointError> {
    let mut attempt = 0;
    loop {
        let manifest =
            manifest::read_manifest(dir)?.ok_or_else(|| CheckpointError::NoCheckpoint {
                dir: dir.to_path_buf(),
            })?;
        let generation = manifest.generation;
        match load_generation(dir, manifest, opts) {
            Ok(c) => return Ok(c),
            Err(e) => {
                attempt += 1;
                let moved_on = matches!(
                    manifest::current_generation(dir),
                    Ok(Some(g)) if g != generation
                );
                if !moved_on || attempt > 2 {
                    return Err(e);
                }
                tracing::info!(
                    "checkpoint generation {generation} in {} was replaced while loading; retrying",
                    dir.display()
                );
            }
        }
    }
}

fn load_generation(
    dir: &Path,
    manifest: Manifest,
    opts: &LoadOptions,
) -> Result<Checkpoint, CheckpointError> {
    let paths: Vec<PathBuf> = manifest.shards.iter().map(|s| dir.join(&s.file)).collect();
    for (path, s) in paths.iter().zip(&manifest.shards) {
        let len = std::fs::metadata(path)
            .map_err(|e| CheckpointError::io("stat shard", path, e))?
            .len();
        if len != s.bytes {
            return Err(CheckpointError::Shard {
                path: path.clone(),
                reason: format!("file is {len} bytes but the manifest says {}", s.bytes),
            });
        }
    }
    let (shards, stats) = load_shards(&paths, &opts.loader, &opts.engine, &opts.allocator)
        .map_err(|source| CheckpointError::Load {
            dir: dir.to_path_buf(),
            generation: manifest.generation,
            source,
        })?;
    for ((shard, entry), path) in shards.iter().zip(&manifest.shards).zip(&paths) {
        if shard.header().data_start() != entry.data_start {
            return Err(CheckpointError::Shard {
                path: path.clone(),
                reason: format!(
                    "data section starts at {} but the manifest says {}",
                    shard.header().data_start(),
                    entry.data_start
                ),
            });
        }
    }
    check_tensors(&manifest, &shards, &paths)?;
    if opts.verify {
        verify_checksums(&manifest, &shards, &paths, opts.threads)?;
    }
    let index = manifest
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.clone(), i))
        .collect();
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        manifest,
        shards,
        stats,
        index,
    })
}

/// Every manifest tensor is in its shard, as recorded.
fn check_tensors(
    manifest: &Manifest,
    shards: &[LoadedShard],
    paths: &[PathBuf],
) -> Result<(), CheckpointError> {
    let by_name: Vec<HashMap<&str, &TensorInfo>> = shards
        .iter()
        .map(|s| {
            s.header()
                .tensors
                .iter()
                .map(|t| (t.name.as_str(), t))
                .collect()
        })
        .collect();
    for t in &manifest.tensors {
        let bad = |reason: String| {
            Err(CheckpointError::Shard {
                path: paths[t.shard].clone(),
                reason: format!("tensor {:?}: {reason}", t.name),
            })
        };
        let Some(info) = by_name[t.shard].get(t.name.as_str()) else {
            return bad("listed in the manifest but not in the shard".into());
        };
        if info.dtype.as_str() != t.dtype || info.shape != t.shape {
            return bad(format!(
                "shard has {} {:?}, manifest says {} {:?}",
                info.dtype, info.shape, t.dtype, t.shape
            ));
        }
        if info.data_offsets != t.data_offsets {
            return bad(format!(
                "shard has data offsets {:?}, manifest says {:?}",
                info.data_offsets, t.data_offsets
            ));
        }
    }
    Ok(())
}

/// Compares every tensor's crc32c with the manifest, on up to `threads`
/// threads; reports the first mismatching tensor in manifest order.
fn verify_checksums(
    manifest: &Manifest,
    shards: &[LoadedShard],
    paths: &[PathBuf],
    threads: usize,
) -> Result<(), CheckpointError> {
    let tensors: &[TensorEntry] = &manifest.tensors;
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<(usize, CheckpointError)>> = Mutex::new(None);
    let workers = threads.clamp(1, tensors.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= tensors.len() {
                        break;
                    }
                    let t = &tensors[i];
                    let path = &paths[t.shard];
                    let e = match shards[t.shard].tensor(&t.name) {
                        None => CheckpointError::Shard {
                            path: path.clone(),
                            reason: format!("tensor {:?} is missing", t.name),
                        },
                        Some(v) => {
                            let actual = crc32c::crc32c(v.data);
                            if actual == t.crc32c {
                                continue;
                            }
                            CheckpointError::Checksum {
                                name: t.name.clone(),
                                path: path.clone(),
                                expected: t.crc32c,
                                actual,
                            }
                        }
                    };
                    let mut slot = failed.lock().unwrap_or_else(|p| p.into_inner());
                    if slot.as_ref().is_none_or(|(j, _)| i < *j) {
                        *slot = Some((i, e));
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}
