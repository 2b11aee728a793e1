//! The directory `kvtier bench` keeps its KV cache in (`--cache-dir`),
//! and the rule that it never deletes what it did not create.
//!
//! The bench marks the directory as its own with a [`MARKER`] file when it
//! creates it, or when it finds it empty. Before a run it clears only its
//! own entries ([`ENTRIES`]: the G3 tree and the device-limit file) and only
//! in a marked directory; anything else there is left alone. A directory
//! that exists, holds something and carries no marker is refused with an
//! error that says so, before any file is touched.

use std::path::Path;

use crate::bench_error::{Result, StepContext, fail};

/// The marker file's name; its presence says the directory is the bench's.
pub const MARKER: &str = ".kvtier-bench";

/// What the bench writes in its directory, and so may clear.
pub const ENTRIES: &[&str] = &["g3", "device-limit.bin"];

/// Makes `dir` ready for a run: created and marked when absent or empty,
/// its own entries cleared when marked; refused otherwise.
pub fn prepare(dir: &Path) -> Result<()> {
    let shown = dir.display();
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)
                .with_step(|| format!("cannot create the cache dir {shown}"))?;
            return mark(dir);
        }
        Err(e) => fail!("cannot read the cache dir {shown}: {e}"),
        Ok(meta) if !meta.is_dir() => {
            fail!("the cache dir {shown} exists and is not a directory")
        }
        Ok(_) => {}
    }
    if !dir.join(MARKER).is_file() {
        let mut entries =
            std::fs::read_dir(dir).with_step(|| format!("cannot list the cache dir {shown}"))?;
        if let Some(first) = entries.next() {
            let first = first.with_step(|| format!("cannot list the cache dir {shown}"))?;
            fail!(
                "the cache dir {shown} is not empty (it holds {}) and was not made by kvtier bench (no {MARKER} file): \
                 kvtier bench will not clear it; pass an empty or new --cache-dir",
                first.file_name().to_string_lossy()
            );
        }
        return mark(dir);
    }
    for name in ENTRIES {
        let p = dir.join(name);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => {
                std::fs::remove_dir_all(&p).with_step(|| format!("cannot clear {}", p.display()))?
            }
            Ok(_) => {
                std::fs::remove_file(&p).with_step(|| format!("cannot clear {}", p.display()))?
            }
            Err(_) => {}
        }
    }
    Ok(())
}

fn mark(dir: &Path) -> Result<()> {
    let p = dir.join(MARKER);
    std::fs::write(
        &p,
        "kvtier bench keeps its KV cache here; it clears only g3/ and device-limit.bin.\n",
    )
    .with_step(|| format!("cannot write {}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_or_empty_directory_is_marked_and_only_the_benchs_entries_are_cleared() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("new");
        prepare(&dir).unwrap();
        assert!(dir.join(MARKER).is_file());
        std::fs::create_dir_all(dir.join("g3/kvtier-g3")).unwrap();
        std::fs::write(dir.join("g3/kvtier-g3/seg-0.kvt"), b"x").unwrap();
        std::fs::write(dir.join("device-limit.bin"), b"x").unwrap();
        std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
        prepare(&dir).unwrap();
        assert!(!dir.join("g3").exists());
        assert!(!dir.join("device-limit.bin").exists());
        assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"mine");

        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        prepare(&empty).unwrap();
        assert!(empty.join(MARKER).is_file());
    }

    #[test]
    fn a_directory_that_is_not_the_benchs_is_refused_and_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("users");
        std::fs::create_dir_all(dir.join("g3")).unwrap();
        std::fs::write(dir.join("g3/keep.txt"), b"mine").unwrap();
        let err = prepare(&dir).unwrap_err().to_string();
        assert!(err.contains("not empty") && err.contains(MARKER), "{err}");
        assert_eq!(std::fs::read(dir.join("g3/keep.txt")).unwrap(), b"mine");
        assert!(!dir.join(MARKER).exists());

        let file = tmp.path().join("a-file");
        std::fs::write(&file, b"mine").unwrap();
        let err = prepare(&file).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
        assert_eq!(std::fs::read(&file).unwrap(), b"mine");
    }
}
