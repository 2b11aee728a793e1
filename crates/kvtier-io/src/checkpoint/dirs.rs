//! The checkpoint directory: file names, the writer lock and directory
//! fsync.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use super::checkpoint_error::CheckpointError;
use super::options::LOCK_FILE;

/// File name of shard `index` (0-based) of `count` in generation `generation`:
/// `ckpt-<gen, 6 digits>-<index+1, 5 digits>-of-<count, 5 digits>.safetensors`.
pub fn shard_file_name(generation: u64, index: usize, count: usize) -> String {
    format!(
        "ckpt-{generation:06}-{:05}-of-{count:05}.safetensors",
        index + 1
    )
}

/// The generation of a shard file name written by [`shard_file_name`].
pub(crate) fn parse_shard_file_name(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("ckpt-")?.strip_suffix(".safetensors")?;
    let parts: Vec<&str> = rest.split('-').collect();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match parts.as_slice() {
        [g, i, "of", n] if digits(g) && digits(i) && digits(n) => g.parse().ok(),
        _ => None,
    }
}

/// True for a non-empty name with no directory part.
pub(crate) fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

/// fsyncs a directory, making renames, creations and unlinks in it durable.
pub fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CheckpointError::io("fsync directory", dir, e))
}

/// An exclusive `flock` on the directory's lock file, held for a whole
/// save (or cleanup) so that two writers never interleave; released on drop
/// (and by the kernel when the process dies).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    /// Blocks until the lock is held.
    pub fn acquire(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| CheckpointError::io("open lock file", &path, e))?;
        loop {
            // SAFETY: flock on a file descriptor we own; no memory involved.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(Self { _file: file });
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(CheckpointError::io("lock", &path, e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_round_trip() {
        let n = shard_file_name(42, 0, 3);
        assert_eq!(n, "ckpt-000042-00001-of-00003.safetensors");
        assert_eq!(parse_shard_file_name(&n), Some(42));
        assert_eq!(
            parse_shard_file_name(&shard_file_name(12_345_678, 99_999, 100_000)),
            Some(12_345_678)
        );
        for bad in [
            "ckpt-1-2-of-.safetensors",
            "ckpt-1-2-3.safetensors",
            "model-00001-of-00002.safetensors",
            "ckpt-000001-00001-of-00001.safetensors.tmp",
            "ckpt-a-1-of-1.safetensors",
        ] {
            assert_eq!(parse_shard_file_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn plain_names() {
        assert!(is_plain_file_name("a.safetensors"));
        for bad in ["", ".", "..", "../x", "/etc/passwd", "a/b"] {
            assert!(!is_plain_file_name(bad), "{bad}");
        }
    }
}
