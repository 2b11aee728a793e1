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
//!
//! A child process being started holds every lock of its parent for a
//! moment: the fork copies each descriptor, and the copy holds the lock
//! until the child execs. A store closed and reopened while another thread
//! starts a process (a test that runs `mount`, a server that runs a
//! helper) would then find its own lock still taken. So a lock that this
//! process wrote and no longer holds is waited for, up to [`FORK_GRACE`];
//! one this process still holds is refused at once.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::DiskError;

/// The lock file's name in a slot directory.
pub const LOCK_FILE: &str = "owner.lock";

/// Longest wait for a lock that only a child being started still holds
/// (see the module docs).
const FORK_GRACE: Duration = Duration::from_secs(2);

/// The lock files this process holds, as (device, inode).
static HELD: Mutex<BTreeSet<(u64, u64)>> = Mutex::new(BTreeSet::new());

fn held(id: (u64, u64)) -> bool {
    HELD.lock().contains(&id)
}

/// A held lock (released when dropped, or when the process ends).
#[derive(Debug)]
pub(crate) struct DirLock {
    file: File,
    /// The lock file's (device, inode), in [`HELD`] while this lives.
    id: (u64, u64),
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Out of HELD before the file closes: once it is closed another
        // owner in this process may take the lock and enter it.
        HELD.lock().remove(&self.id);
    }
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
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        let id = (meta.dev(), meta.ino());
        let pid = std::process::id();
        let began = Instant::now();
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(TryLockError::WouldBlock) => {
                    let holder = read_holder(&file);
                    // Written by this process, which no longer holds it: a
                    // child being started does, until it execs.
                    if holder == Some(pid) && !held(id) && began.elapsed() < FORK_GRACE {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    return Err(DiskError::Locked {
                        path: path.clone(),
                        holder,
                    });
                }
                Err(TryLockError::Error(e)) => return Err(open_err(e)),
            }
        }
        HELD.lock().insert(id);
        let lock = Self { file, id };
        let mut file = &lock.file;
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{pid}"))
            .map_err(open_err)?;
        Ok(lock)
    }
}

/// The pid the holder wrote, if it can be read (it may be mid-write).
fn read_holder(file: &File) -> Option<u32> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 64];
    let n = file.read_at(&mut buf, 0).ok()?;
    std::str::from_utf8(buf.get(..n)?).ok()?.trim().parse().ok()
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
    fn a_lock_only_a_starting_child_still_holds_is_waited_for() {
        let tmp = tempfile::tempdir().unwrap();
        let first = DirLock::acquire(tmp.path()).unwrap();
        // What a fork leaves behind: a copy of the descriptor, holding the
        // lock after this process let go of it, until the child execs.
        let copy = first.file.try_clone().unwrap();
        drop(first);
        let child = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(copy);
        });
        let again = DirLock::acquire(tmp.path());
        assert!(again.is_ok(), "{again:?}");
        child.join().unwrap();
        // Held by this process itself: refused, not waited for.
        assert!(matches!(
            DirLock::acquire(tmp.path()),
            Err(DiskError::Locked { .. })
        ));
    }

    #[test]
    fn a_lock_file_that_is_not_a_regular_file_is_an_error_not_a_hang() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join(LOCK_FILE)).unwrap();
        let err = DirLock::acquire(tmp.path()).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
    }
}
