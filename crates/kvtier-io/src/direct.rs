//! Direct I/O (`O_DIRECT`): opening files and probing whether a directory's
//! file system accepts it.
//!
//! Direct I/O bypasses the page cache, so reads are cold by construction and
//! large writes do not evict the working set. Some file systems (tmpfs before
//! 6.6, some FUSE and network mounts) refuse it; kvtier then falls back to
//! buffered I/O and says so, with the reason, in logs, `kvtier info` and
//! metrics.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN};

/// Opens `path` for reading and writing (creating it when `create`), with
/// `O_DIRECT` when `direct` is true.
pub fn open_direct(path: &Path, create: bool, direct: bool) -> io::Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create(create);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    opts.open(path)
}

/// Opens `path` read-only, with `O_DIRECT` when `direct` is true.
pub fn open_read(path: &Path, direct: bool) -> io::Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    opts.open(path)
}

/// What a directory's file system accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectProbe {
    /// True when an aligned `O_DIRECT` write and read-back succeeded.
    pub direct: bool,
    /// Why direct I/O is not used, when it is not.
    pub reason: Option<String>,
}

impl DirectProbe {
    /// "direct" or "buffered", as shown in `kvtier info` and metrics.
    pub fn mode_name(&self) -> &'static str {
        if self.direct { "direct" } else { "buffered" }
    }
}

/// Name prefix of the probe's scratch file, followed by `<pid>-<n>`.
const PROBE_PREFIX: &str = ".kvtier-direct-probe-";

/// True when `name` is a probe scratch file (see [`probe_direct`]) of a
/// process that no longer exists: one killed between creating and removing
/// it. A file of a live process, this one included, is not stale.
pub(crate) fn is_stale_probe_file(name: &str) -> bool {
    let Some((pid, seq)) = name
        .strip_prefix(PROBE_PREFIX)
        .and_then(|rest| rest.split_once('-'))
    else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Ok(pid) = pid.parse::<libc::pid_t>() else {
        return false;
    };
    if !digits(seq) || pid <= 0 || pid as u32 == std::process::id() {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists; nothing is sent.
    let rc = unsafe { libc::kill(pid, 0) };
    rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Probes `dir` with a real aligned `O_DIRECT` write and read of one
/// 4 KiB block in a scratch file that is removed afterwards.
///
/// Set `KVTIER_DIRECT_IO=0` to force buffered I/O (the reason says so).
pub fn probe_direct(dir: &Path) -> DirectProbe {
    if std::env::var("KVTIER_DIRECT_IO").is_ok_and(|v| v == "0" || v == "false") {
        return DirectProbe {
            direct: false,
            reason: Some("disabled by KVTIER_DIRECT_IO=0".into()),
        };
    }
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let path = dir.join(format!(
        "{PROBE_PREFIX}{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = probe_file(&path);
    let _ = std::fs::remove_file(&path);
    match result {
        Ok(()) => DirectProbe {
            direct: true,
            reason: None,
        },
        Err(e) => {
            let reason = format!("O_DIRECT probe in {} failed: {e}", dir.display());
            tracing::warn!("{reason}; falling back to buffered I/O");
            DirectProbe {
                direct: false,
                reason: Some(reason),
            }
        }
    }
}

fn probe_file(path: &Path) -> io::Result<()> {
    let file = open_direct(path, true, true)?;
    let mut buf = AlignedBuf::zeroed(DIRECT_IO_ALIGN, DIRECT_IO_ALIGN).map_err(io::Error::other)?;
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    file.write_all_at(&buf, 0)?;
    let mut back =
        AlignedBuf::zeroed(DIRECT_IO_ALIGN, DIRECT_IO_ALIGN).map_err(io::Error::other)?;
    file.read_exact_at(&mut back, 0)?;
    if back[..] != buf[..] {
        return Err(io::Error::other("read-back differs from what was written"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reports_a_mode_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let probe = probe_direct(dir.path());
        // Either mode is legitimate, but a fallback must carry its reason.
        assert_eq!(probe.direct, probe.reason.is_none());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn stale_probe_files_are_those_of_dead_processes() {
        let me = std::process::id();
        assert!(!is_stale_probe_file(&format!(
            ".kvtier-direct-probe-{me}-0"
        )));
        // The parent of a test process is alive.
        let parent = std::os::unix::process::parent_id();
        assert!(!is_stale_probe_file(&format!(
            ".kvtier-direct-probe-{parent}-3"
        )));
        // A child that has exited and been reaped no longer exists.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(is_stale_probe_file(&format!(
            ".kvtier-direct-probe-{pid}-7"
        )));
        for other in [
            "manifest.json",
            ".kvtier-direct-probe-",
            &format!(".kvtier-direct-probe-{pid}"),
            &format!(".kvtier-direct-probe-{pid}-x"),
            ".kvtier-direct-probe-0-1",
            ".kvtier-direct-probe--5-1",
        ] {
            assert!(!is_stale_probe_file(other), "{other}");
        }
    }

    #[test]
    fn probe_of_missing_directory_falls_back_with_reason() {
        let probe = probe_direct(Path::new("/nonexistent/kvtier-probe-dir"));
        assert!(!probe.direct);
        assert!(probe.reason.unwrap().contains("/nonexistent"));
    }
}
