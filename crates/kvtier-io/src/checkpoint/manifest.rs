//! `manifest.json`: the commit record of a checkpoint.
//!
//! The manifest names the generation, its shard files with their exact
//! lengths, and every tensor with its shard, dtype, shape, offsets and
//! crc32c. It is written to [`MANIFEST_TMP`](super::options::MANIFEST_TMP), fsynced,
//! renamed over [`MANIFEST_FILE`](super::options::MANIFEST_FILE), and the directory
//! fsynced: the rename is the commit point.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::checkpoint_error::CheckpointError;
use super::dirs;
use super::options::{MANIFEST_FILE, MANIFEST_TMP};
use crate::safetensors::Dtype;

/// Value of [`Manifest::format`].
pub const MANIFEST_FORMAT: &str = "kvtier-checkpoint";
/// The manifest version this code writes and reads.
pub const MANIFEST_VERSION: u32 = 1;
/// Largest manifest read (guards against a garbage file).
const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// The committed description of one checkpoint generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// Always [`MANIFEST_VERSION`] for manifests this code writes.
    pub version: u32,
    /// Generation number: 1 for the first save in a directory, then +1 per
    /// committed save.
    pub generation: u64,
    /// The shard files, in order.
    pub shards: Vec<ShardEntry>,
    /// Every tensor, in the order it was handed to `save`.
    pub tensors: Vec<TensorEntry>,
    /// The caller's metadata (also in every shard's `__metadata__`).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// One shard file of a generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name inside the checkpoint directory (no directory part).
    pub file: String,
    /// Exact file length in bytes.
    pub bytes: u64,
    /// File offset of the data section (the header's length).
    pub data_start: u64,
}

/// One tensor of a generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Tensor name.
    pub name: String,
    /// Index into [`Manifest::shards`].
    pub shard: usize,
    /// Safetensors dtype name ("F32", "BF16", ...).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// `[begin, end)` relative to the shard's data section, as in the
    /// shard's safetensors header.
    pub data_offsets: (u64, u64),
    /// crc32c (Castagnoli) of the tensor's bytes.
    pub crc32c: u32,
}

impl TensorEntry {
    /// Bytes of tensor data.
    pub fn len(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }

    /// True for a tensor with no data bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Manifest {
    /// Sum of the tensors' data bytes.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorEntry::len).sum()
    }

    /// Sum of the shard files' lengths.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes).sum()
    }

    /// Checks internal consistency: format and version, plain file names,
    /// unique tensor names, known dtypes, shard indices and offsets in range,
    /// sizes matching shape x dtype.
    pub fn validate(&self, path: &Path) -> Result<(), CheckpointError> {
        let bad = |reason: String| {
            Err(CheckpointError::Manifest {
                path: path.to_path_buf(),
                reason,
            })
        };
        if self.format != MANIFEST_FORMAT {
            return bad(format!(
                "format is {:?}, expected {MANIFEST_FORMAT:?}",
                self.format
            ));
        }
        if self.version != MANIFEST_VERSION {
            return bad(format!(
                "version {} is not supported (this build reads {MANIFEST_VERSION})",
                self.version
            ));
        }
        let mut files = HashSet::new();
        for s in &self.shards {
            if !dirs::is_plain_file_name(&s.file) {
                return bad(format!(
                    "shard file name {:?} is not a plain file name",
                    s.file
                ));
            }
            if !files.insert(s.file.as_str()) {
                return bad(format!("shard file {:?} is listed twice", s.file));
            }
            if s.data_start > s.bytes {
                return bad(format!(
                    "shard {:?}: data start {} is past its length {}",
                    s.file, s.data_start, s.bytes
                ));
            }
        }
        let mut names = HashSet::new();
        for t in &self.tensors {
            let tb = |reason: String| bad(format!("tensor {:?}: {reason}", t.name));
            if !names.insert(t.name.as_str()) {
                return tb("listed twice".into());
            }
            let Some(shard) = self.shards.get(t.shard) else {
                return tb(format!("shard index {} out of range", t.shard));
            };
            let Some(dtype) = Dtype::from_str_name(&t.dtype) else {
                return tb(format!("unknown dtype {:?}", t.dtype));
            };
            let (b, e) = t.data_offsets;
            if e < b
                || shard
                    .data_start
                    .checked_add(e)
                    .is_none_or(|end| end > shard.bytes)
            {
                return tb(format!(
                    "data offsets [{b}, {e}] do not fit shard {:?} of {} bytes",
                    shard.file, shard.bytes
                ));
            }
            let size = t
                .shape
                .iter()
                .try_fold(dtype.size_bytes() as u64, |acc, &d| {
                    acc.checked_mul(d as u64)
                });
            if size != Some(e - b) {
                return tb(format!(
                    "shape {:?} x {} does not match the {} bytes its offsets span",
                    t.shape,
                    t.dtype,
                    e - b
                ));
            }
        }
        Ok(())
    }
}

/// Reads and validates `dir/manifest.json`; `Ok(None)` when there is none.
pub fn read_manifest(dir: &Path) -> Result<Option<Manifest>, CheckpointError> {
    let path = dir.join(MANIFEST_FILE);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CheckpointError::io("open", &path, e)),
    };
    let len = file
        .metadata()
        .map_err(|e| CheckpointError::io("stat", &path, e))?
        .len();
    if len > MAX_MANIFEST_BYTES {
        return Err(CheckpointError::Manifest {
            path,
            reason: format!("{len} bytes is larger than the {MAX_MANIFEST_BYTES}-byte limit"),
        });
    }
    let bytes = fs::read(&path).map_err(|e| CheckpointError::io("read", &path, e))?;
    let manifest: Manifest =
        serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Manifest {
            path: path.clone(),
            reason: format!("not a valid manifest: {e}"),
        })?;
    manifest.validate(&path)?;
    Ok(Some(manifest))
}

/// The committed generation in `dir`, if any.
pub fn current_generation(dir: &Path) -> Result<Option<u64>, CheckpointError> {
    Ok(read_manifest(dir)?.map(|m| m.generation))
}

/// Writes `manifest` to the temp name, fsyncs it, and renames it over
/// `manifest.json`. The caller fsyncs the directory afterwards (that is
/// when the commit is durable).
pub(crate) fn write_and_rename(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    let tmp = dir.join(MANIFEST_TMP);
    let path = dir.join(MANIFEST_FILE);
    let mut json = serde_json::to_vec_pretty(manifest).map_err(|e| CheckpointError::Manifest {
        path: tmp.clone(),
        reason: format!("cannot serialise: {e}"),
    })?;
    json.push(b'\n');
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| CheckpointError::io("create", &tmp, e))?;
    f.write_all(&json)
        .map_err(|e| CheckpointError::io("write", &tmp, e))?;
    f.sync_all()
        .map_err(|e| CheckpointError::io("fsync", &tmp, e))?;
    drop(f);
    fs::rename(&tmp, &path).map_err(|e| CheckpointError::io("rename manifest", &tmp, e))?;
    Ok(())
}
