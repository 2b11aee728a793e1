//! One owner per G3 directory: an advisory lock taken at open and held for
//! the tier's life.
//!
//! Two processes on one directory would overwrite each other's slots (each
//! has its own index and free list); checksums keep a wrong block from being
//! served, but the cache is destroyed. So [`DiskTier::open`](super::DiskTier::open)
//! takes an exclusive `flock` on `LOCK_FILE` in every slot directory and
//! writes its pid there; a second owner, in another process or this one,
//! gets [`DiskError::Locked`](super::DiskError::Locked) naming the holder's
//! pid. The kernel drops the lock when the process dies (kill -9 included),
//! so a stale lock file never blocks a restart; the file itself is left in
//! place (it is kvtier's, and removing it could race a new owner).
//!
//! Decision: sharing one directory between processes is not supported.
//! Processes share KV through G4; each keeps its own G3.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::Path;

use super::DiskError;

/// The lock file's name in a slot directory.
pub const LOCK_FILE: &str = "owner.lock";

/// A held lock (released when dropped, or when the process ends).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    /// Takes the lock of `dir` (which must exist) without waiting.
    pub(crate) fn acquire(dir: &Path) -> Result<Self, DiskError> {
        let path = dir.join(LOCK_FILE);
        let open_err = |source| DiskError::Open {
            path: path.clone(),
            source,
        };
        // Only a regular file is opened: a FIFO or device planted under the
        // name would block or misbehave.
        if let Ok(meta) = std::fs::symlink_metadata(&path)
            && !meta.file_type().is_file()
        {
            return Err(open_err(std::io::Error::other(
                "the lock file exists but is not a regular file",
            )));
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(open_err)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(DiskError::Locked {
                    path: path.clone(),
                    holder: read_holder(&file),
                });
            }
            Err(TryLockError::Error(e)) => return Err(open_err(e)),
        }
        let pid = std::process::id();
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{pid}"))
            .map_err(open_err)?;
        Ok(Self { _file: file })
    }
}

/// The pid the holder wrote, if it can be read (it may be mid-write).
fn read_holder(file: &File) -> Option<u32> {
    let mut text = String::new();
    file.take(64).read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// Describes a holder for [`DiskError::Locked`]'s message.
pub(crate) fn holder_text(holder: &Option<u32>) -> String {
    match holder {
        Some(pid) => format!("process {pid}"),
        None => "another process".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_owner_is_refused_with_the_holders_pid_until_the_first_drops() {
        let tmp = tempfile::tempdir().unwrap();
        let first = DirLock::acquire(tmp.path()).unwrap();
        let text = std::fs::read_to_string(tmp.path().join(LOCK_FILE)).unwrap();
        assert_eq!(text.trim(), std::process::id().to_string());
        match DirLock::acquire(tmp.path()) {
            Err(DiskError::Locked { holder, path }) => {
                assert_eq!(holder, Some(std::process::id()));
                assert_eq!(path, tmp.path().join(LOCK_FILE));
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        drop(first);
        let _again = DirLock::acquire(tmp.path()).unwrap();
    }

    #[test]
    fn a_lock_file_that_is_not_a_regular_file_is_an_error_not_a_hang() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join(LOCK_FILE)).unwrap();
        let err = DirLock::acquire(tmp.path()).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
    }
}
