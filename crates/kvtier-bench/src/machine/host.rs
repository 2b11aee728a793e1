//! Facts about the machine: CPUs, memory, free disk space, and dropping the
//! page cache (the whole of it as root, or file by file otherwise).

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// CPUs this process may run on (affinity and cgroup limits applied).
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub use kvtier_io::host_memory::memory_bytes;

/// Bytes an unprivileged user may still write on the file system holding
/// `path` (`statvfs`: `f_bavail * f_frsize`).
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statvfs is plain old data; zeroed is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated string and `st` a valid out-pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Writes dirty pages out and drops the page cache (`sync; echo 3 >
/// /proc/sys/vm/drop_caches`). Needs root; the error says why it did not
/// happen.
pub fn drop_page_cache() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root".into());
    }
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", b"3\n")
        .map_err(|e| format!("writing /proc/sys/vm/drop_caches failed: {e}"))
}

/// Writes `path`'s dirty pages out and asks the kernel to drop its cached
/// pages (`fdatasync` then `posix_fadvise(POSIX_FADV_DONTNEED)`). Works
/// without root for any file this process can open.
pub fn evict_file(path: &Path) -> Result<(), String> {
    let f =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    f.sync_data()
        .map_err(|e| format!("fdatasync of {} failed: {e}", path.display()))?;
    // SAFETY: fadvise on a descriptor we own; no memory involved.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(format!(
            "posix_fadvise(DONTNEED) of {} failed: {}",
            path.display(),
            io::Error::from_raw_os_error(rc)
        ));
    }
    Ok(())
}

/// Makes measurements cold: drops the page cache before each one and
/// remembers how (and whether) every drop worked.
#[derive(Debug, Default)]
pub struct CacheDrops {
    /// Why the whole page cache could not be dropped, the first time it
    /// could not.
    pub failed: Option<String>,
    /// Why evicting single files failed, the first time it did.
    pub evict_failed: Option<String>,
    /// True once files were evicted one by one instead.
    pub evicted_files: bool,
}

impl CacheDrops {
    /// Drops the whole page cache (needs root); remembers the first failure.
    pub fn drop_now(&mut self) {
        if let Err(e) = drop_page_cache() {
            if self.failed.is_none() {
                tracing::info!("page cache not dropped: {e}");
            }
            self.failed.get_or_insert(e);
        }
    }

    /// Drops the whole page cache or, where that is not permitted, evicts
    /// `files` from it one by one ([`evict_file`]).
    pub fn drop_or_evict(&mut self, files: &[PathBuf]) {
        if drop_page_cache().is_ok() {
            return;
        }
        self.drop_now();
        self.evicted_files = true;
        for f in files {
            if let Err(e) = evict_file(f) {
                if self.evict_failed.is_none() {
                    tracing::warn!("cannot evict a file from the page cache: {e}");
                }
                self.evict_failed.get_or_insert(e);
            }
        }
    }

    /// True when every drop (or every eviction that replaced one) worked.
    pub fn all_cold(&self) -> bool {
        self.failed.is_none() || (self.evicted_files && self.evict_failed.is_none())
    }

    /// How the page cache was made cold, in words.
    pub fn describe(&self) -> String {
        match (&self.failed, self.evicted_files, &self.evict_failed) {
            (None, _, _) => "dropped before every measurement (drop_caches)".into(),
            (Some(why), true, None) => format!(
                "the bench files evicted before every measurement (fdatasync + fadvise DONTNEED; drop_caches: {why})"
            ),
            (Some(why), true, Some(evict)) => {
                format!("NOT cold: drop_caches: {why}; eviction: {evict}")
            }
            (Some(why), false, _) => format!("NOT dropped: {why}"),
        }
    }
}

/// Allocates `bytes` of fresh memory, writes one byte per 4 KiB page
/// (faulting every page in, as a loader writing into new memory must),
/// frees it, and returns the GB/s of the whole: the first-touch RAM rate,
/// a limit of any loader that reads into freshly allocated memory.
pub fn first_touch_gbps(bytes: usize) -> Result<f64, String> {
    let layout = std::alloc::Layout::from_size_align(bytes.max(4096), 4096)
        .map_err(|e| format!("bad first-touch size {bytes}: {e}"))?;
    let t = std::time::Instant::now();
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc(layout) };
    if ptr.is_null() {
        return Err(format!("cannot allocate {bytes} bytes"));
    }
    for off in (0..layout.size()).step_by(4096) {
        // SAFETY: `off < layout.size()`; the allocation is ours.
        unsafe { std::ptr::write_volatile(ptr.add(off), 1) };
    }
    let secs = t.elapsed().as_secs_f64();
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };
    Ok(layout.size() as f64 / secs.max(1e-9) / 1e9)
}

/// Waits `secs` seconds after freeing memory: a VM may hand freed RAM back
/// to its host within seconds, after which touching fresh memory is slow;
/// a cold measurement should start from that state, not from a lucky one.
pub fn settle(secs: f64) {
    if secs > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(secs));
    }
}

/// The CPU model name from `/proc/cpuinfo` ("unknown" if absent).
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_facts_are_plausible() {
        assert!(cpus() >= 1);
        assert!(memory_bytes() > 64 << 20);
        let dir = tempfile::tempdir().unwrap();
        assert!(free_bytes(dir.path()).unwrap() > 0);
        assert!(free_bytes(Path::new("/nonexistent/kvtier")).is_err());
        assert!(first_touch_gbps(1 << 20).unwrap() > 0.0);
    }

    #[test]
    fn evicts_a_file_and_reports_how() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, vec![7u8; 1 << 16]).unwrap();
        evict_file(&f).unwrap();
        assert!(evict_file(&dir.path().join("missing")).is_err());
        let mut drops = CacheDrops::default();
        drops.drop_or_evict(std::slice::from_ref(&f));
        assert!(drops.all_cold(), "{}", drops.describe());
        assert!(!drops.describe().is_empty());
    }
}
