//! Removing a G3 that no store owns, leaving every file kvtier did not
//! write.
//!
//! An engine that forgets a namespace for good (SGLang's `clear`, a model
//! retired) wants its disk back. A G3 directory may hold files kvtier did
//! not write (a user's, an operator's), and another process may still have
//! it open, so [`DiskTier::remove_dir`] takes every slot directory's owner lock
//! first (refused with [`DiskError::Locked`] while any store, in this or
//! another process, holds one), removes only the files kvtier names
//! (segments, the saved index and its journals, their temporaries, the
//! lock file last), and then removes directories only if they are empty.
//!
//! The lock file goes last, while its lock is still held: a store that
//! opens the directory afterwards makes a new lock file and new segments,
//! which this removal never touches (it took its list of files before).

use std::path::Path;

use super::dir_lock::{DirLock, LOCK_FILE};
use super::saved_index::INDEX_FILE;
use super::{DiskError, DiskTier};

/// Whether `name` is a file kvtier writes in a slot directory (other than
/// the lock file).
fn is_kvtier_file(name: &str) -> bool {
    let base = name.strip_suffix(".tmp").unwrap_or(name);
    let numbered = |prefix: &str, suffix: &str, digits: usize| {
        base.strip_prefix(prefix)
            .and_then(|n| n.strip_suffix(suffix))
            .is_some_and(|n| n.len() >= digits && n.bytes().all(|b| b.is_ascii_digit()))
    };
    base == INDEX_FILE
        || numbered("seg-", ".kvt", 5) && base == name
        || numbered("journal-", ".kvtj", 16)
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> DiskError + '_ {
    |source| DiskError::Open {
        path: path.to_path_buf(),
        source,
    }
}

impl DiskTier {
    /// Removes the G3 under `root` (the directory a store was opened on:
    /// `root/kvtier-g3/<layout>/...`, every layout) when no store holds
    /// it; returns how many files were removed (0 when there is none).
    /// Only kvtier's own files go; a directory is removed only once empty,
    /// so anything else placed there stays, and so does `root` then.
    pub fn remove_dir(root: &Path) -> Result<usize, DiskError> {
        let g3 = root.join("kvtier-g3");
        let entries = match std::fs::read_dir(&g3) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(io_err(&g3)(e)),
        };
        // Every slot directory's lock before any file goes: one held by a
        // store refuses the whole removal.
        let mut held = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err(&g3))?;
            let path = entry.path();
            // A symlink is not followed: kvtier makes real directories.
            if entry.file_type().map_err(io_err(&path))?.is_dir() {
                let lock = DirLock::acquire(&path)?;
                held.push((path, lock));
            }
        }
        let mut removed = 0;
        for (dir, lock) in held {
            for entry in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
                let entry = entry.map_err(io_err(&dir))?;
                let kind = entry.file_type().map_err(io_err(&dir))?;
                let ours = entry.file_name().to_str().is_some_and(is_kvtier_file);
                if ours && kind.is_file() {
                    let path = entry.path();
                    std::fs::remove_file(&path).map_err(io_err(&path))?;
                    removed += 1;
                }
            }
            let lock_path = dir.join(LOCK_FILE);
            std::fs::remove_file(&lock_path).map_err(io_err(&lock_path))?;
            removed += 1;
            drop(lock);
            // Not empty: someone else's files, or a store that opened it
            // since; both stay.
            let _ = std::fs::remove_dir(&dir);
        }
        let _ = std::fs::remove_dir(&g3);
        let _ = std::fs::remove_dir(root);
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_only_kvtier_files() {
        for ours in [
            "seg-00000.kvt",
            "seg-123456.kvt",
            "index.kvti",
            "index.kvti.tmp",
            "journal-0000000000000007.kvtj",
            "journal-0000000000000007.kvtj.tmp",
        ] {
            assert!(is_kvtier_file(ours), "{ours}");
        }
        for other in [
            "seg-1.kvt",
            "seg-00000.kvt.tmp",
            "seg-0000x.kvt",
            "notes.txt",
            "index.kvti.bak",
            "journal-7.kvtj",
            "owner.lock",
        ] {
            assert!(!is_kvtier_file(other), "{other}");
        }
    }
}
