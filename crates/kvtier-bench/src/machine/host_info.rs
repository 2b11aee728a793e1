//! What `kvtier info` shows: the machine, the I/O backend, and O_DIRECT on
//! the cache directory.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kvtier_io::{IoEngine, probe_direct};
use serde::Serialize;

use crate::common::size::format_size;
use crate::machine::host;
use crate::reporting::text_report::TextReport;

/// What `kvtier info --json` prints (field names are a contract).
#[derive(Debug, Serialize)]
pub struct HostInfo {
    /// kvtier version.
    pub version: String,
    /// CPUs this process may use.
    pub cpus: usize,
    /// Physical memory in bytes.
    pub memory_bytes: u64,
    /// I/O backend in use: `io_uring` or `threads`.
    pub io_backend: String,
    /// Why io_uring is not used, when it is not.
    pub io_backend_fallback: Option<String>,
    /// The cache directory asked about.
    pub cache_dir: PathBuf,
    /// Whether the cache directory exists.
    pub cache_dir_exists: bool,
    /// Directory actually probed (the cache directory, or its nearest
    /// existing parent when it does not exist yet).
    pub probed_dir: PathBuf,
    /// True when O_DIRECT works there.
    pub direct_io: bool,
    /// Why buffered I/O would be used, when it would.
    pub direct_io_reason: Option<String>,
}

/// Gathers the facts for `cache_dir`, for the program at `version`.
pub fn gather(cache_dir: &Path, version: &str) -> HostInfo {
    let engine = IoEngine::shared();
    let exists = cache_dir.is_dir();
    let probed = if exists {
        cache_dir.to_path_buf()
    } else {
        nearest_existing_dir(cache_dir)
    };
    let probe = probe_direct(&probed);
    HostInfo {
        version: version.to_string(),
        cpus: host::cpus(),
        memory_bytes: host::memory_bytes(),
        io_backend: engine.backend().name().to_string(),
        io_backend_fallback: engine.fallback_reason().map(str::to_string),
        cache_dir: cache_dir.to_path_buf(),
        cache_dir_exists: exists,
        probed_dir: probed,
        direct_io: probe.direct,
        direct_io_reason: probe.reason,
    }
}

/// The closest ancestor of `path` that is an existing directory (`.` for a
/// relative path with none).
fn nearest_existing_dir(path: &Path) -> PathBuf {
    let mut p = path;
    while let Some(parent) = p.parent() {
        if parent.as_os_str().is_empty() {
            break;
        }
        if parent.is_dir() {
            return parent.to_path_buf();
        }
        p = parent;
    }
    if path.is_absolute() {
        PathBuf::from("/")
    } else {
        PathBuf::from(".")
    }
}

impl TextReport for HostInfo {
    fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "kvtier {}", self.version);
        let _ = writeln!(out, "cpus:        {}", self.cpus);
        let _ = writeln!(
            out,
            "memory:      {} ({} bytes)",
            format_size(self.memory_bytes),
            self.memory_bytes
        );
        let _ = writeln!(out, "io backend:  {}", IoEngine::shared().describe());
        let where_ = if self.cache_dir_exists {
            String::new()
        } else {
            format!(
                " (does not exist yet; probed {})",
                self.probed_dir.display()
            )
        };
        let _ = writeln!(out, "cache dir:   {}{where_}", self.cache_dir.display());
        match &self.direct_io_reason {
            None => {
                let _ = writeln!(out, "direct I/O:  direct");
            }
            Some(r) => {
                let _ = writeln!(out, "direct I/O:  buffered ({r})");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_existing_parent() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a/b/c");
        assert_eq!(nearest_existing_dir(&deep), dir.path());
        assert_eq!(
            nearest_existing_dir(Path::new("no-such-dir-kvtier")),
            Path::new(".")
        );
        assert_eq!(
            nearest_existing_dir(Path::new("/no-such-dir-kvtier/x")),
            Path::new("/")
        );
    }

    #[test]
    fn gather_probes_an_existing_dir() {
        let dir = tempfile::tempdir().unwrap();
        let info = gather(dir.path(), "0.0.0");
        assert!(info.cache_dir_exists);
        assert_eq!(info.direct_io, info.direct_io_reason.is_none());
        assert!(info.cpus >= 1);
    }
}
