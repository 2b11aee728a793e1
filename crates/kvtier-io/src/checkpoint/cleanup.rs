//! Cleanup of uncommitted generations: shard files no manifest names,
//! leftover temp manifests and the direct-I/O probe file of a save killed
//! while probing, never any other file.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::checkpoint_error::CheckpointError;
use super::dirs::{DirLock, parse_shard_file_name};
use super::manifest::{self, Manifest};
use super::options::MANIFEST_TMP;
use crate::direct::is_stale_probe_file;

/// Removes every file of an uncommitted generation from `dir` (shard files
/// not named by `manifest.json`, a leftover temp manifest, and the
/// `O_DIRECT` probe's scratch file of a process that died before removing
/// it) and returns
/// what it removed. Other files are never touched. Takes the directory's
/// writer lock, so it waits for a save in progress.
pub fn cleanup(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let _lock = DirLock::acquire(dir)?;
    let committed = manifest::read_manifest(dir)?;
    cleanup_locked(dir, committed.as_ref())
}

/// [`cleanup`] for a caller that holds the lock and has read the manifest.
pub(crate) fn cleanup_locked(
    dir: &Path,
    committed: Option<&Manifest>,
) -> Result<Vec<PathBuf>, CheckpointError> {
    let keep: HashSet<&str> = committed
        .map(|m| m.shards.iter().map(|s| s.file.as_str()).collect())
        .unwrap_or_default();
    let mut removed = Vec::new();
    let entries = fs::read_dir(dir).map_err(|e| CheckpointError::io("list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| CheckpointError::io("list", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stray = name == MANIFEST_TMP
            || (parse_shard_file_name(name).is_some() && !keep.contains(name))
            || is_stale_probe_file(name);
        if !stray {
            continue;
        }
        let path = entry.path();
        match fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(CheckpointError::io("remove stray file", &path, e)),
        }
    }
    if !removed.is_empty() {
        tracing::info!(
            "removed {} file(s) of uncommitted checkpoint generations in {}",
            removed.len(),
            dir.display()
        );
    }
    Ok(removed)
}
