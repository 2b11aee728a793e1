//! Where the store bench puts its files: a `kvtier-bench-<pid>` directory
//! under each stripe directory, checked for free space first and removed at
//! the end (also on error) unless kept.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::bench_error::{Result, StepContext, fail};

use crate::common::size::format_size;
use crate::machine::host::free_bytes;

/// Headroom asked for on top of the block set (segment files, metadata,
/// file-system overhead).
pub const SPACE_FACTOR: f64 = 1.3;

/// The bench's own directories; removed on drop unless `keep`.
#[derive(Debug)]
pub struct RunDirs {
    dirs: Vec<PathBuf>,
    keep: bool,
}

impl RunDirs {
    /// Creates `ROOT/kvtier-bench-<pid>` under every root (creating the roots
    /// as needed), after checking that each file system holds its share:
    /// `SPACE_FACTOR x` the blocks striped onto it, plus `extra_first` bytes
    /// on the first root (the device-limit file).
    pub fn create(
        roots: &[PathBuf],
        bytes_per_root: u64,
        extra_first: u64,
        keep: bool,
    ) -> Result<Self> {
        if roots.is_empty() {
            fail!("no bench directory given");
        }
        // Needs per file system (st_dev), so stripes on one device add up.
        let mut need: BTreeMap<u64, (u64, PathBuf)> = BTreeMap::new();
        for (i, root) in roots.iter().enumerate() {
            std::fs::create_dir_all(root)
                .with_step(|| format!("cannot create bench directory {}", root.display()))?;
            let meta =
                std::fs::metadata(root).with_step(|| format!("cannot stat {}", root.display()))?;
            if !meta.is_dir() {
                fail!("{} is not a directory", root.display());
            }
            let share = (bytes_per_root as f64 * SPACE_FACTOR).ceil() as u64
                + if i == 0 { extra_first } else { 0 };
            let entry = need.entry(meta.dev()).or_insert((0, root.clone()));
            entry.0 += share;
        }
        for (bytes, root) in need.values() {
            let free = free_bytes(root)
                .with_step(|| format!("cannot read free space of {}", root.display()))?;
            if free < *bytes {
                fail!(
                    "not enough free disk space in {}: the bench needs {} ({SPACE_FACTOR} x the block set plus the device-limit file) but {} is free; \
                     use a smaller --total-bytes or another --dir",
                    root.display(),
                    format_size(*bytes),
                    format_size(free)
                );
            }
        }
        let mut run = Self {
            dirs: Vec::new(),
            keep,
        };
        for root in roots {
            let dir = root.join(format!("kvtier-bench-{}", std::process::id()));
            std::fs::create_dir(&dir).with_step(|| {
                format!(
                    "cannot create {} (is {} writable?)",
                    dir.display(),
                    root.display()
                )
            })?;
            run.dirs.push(dir);
        }
        Ok(run)
    }

    /// The run directories, one per root.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The first run directory (holds the device-limit file).
    pub fn first(&self) -> &Path {
        &self.dirs[0]
    }
}

impl Drop for RunDirs {
    fn drop(&mut self) {
        if self.keep {
            for d in &self.dirs {
                tracing::info!("keeping bench files in {}", d.display());
            }
            return;
        }
        for d in &self.dirs {
            if let Err(e) = std::fs::remove_dir_all(d) {
                tracing::warn!("cannot remove bench files in {}: {e}", d.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_and_removes_or_keeps() {
        let root = tempfile::tempdir().unwrap();
        let roots = vec![root.path().join("a"), root.path().join("b")];
        let run = RunDirs::create(&roots, 1 << 20, 1 << 20, false).unwrap();
        let made: Vec<PathBuf> = run.dirs().to_vec();
        assert!(made.iter().all(|d| d.is_dir()));
        assert!(run.first().starts_with(&roots[0]));
        drop(run);
        assert!(made.iter().all(|d| !d.exists()));
        assert!(roots.iter().all(|r| r.is_dir()), "roots are left alone");

        let run = RunDirs::create(&roots[..1], 1 << 20, 0, true).unwrap();
        let kept = run.first().to_path_buf();
        drop(run);
        assert!(kept.is_dir());
    }

    #[test]
    fn refuses_when_space_is_short() {
        let root = tempfile::tempdir().unwrap();
        let err = RunDirs::create(&[root.path().to_path_buf()], u64::MAX / 4, 0, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not enough free disk space"), "{err}");
    }

    #[test]
    fn a_file_is_not_a_directory() {
        let root = tempfile::tempdir().unwrap();
        let f = root.path().join("file");
        std::fs::write(&f, b"x").unwrap();
        assert!(RunDirs::create(&[f], 4096, 0, false).is_err());
    }
}
