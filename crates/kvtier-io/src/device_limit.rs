//! The device's own read limit, measured in the same run as what is
//! benchmarked against it (the store, the weight loader, checkpoints): one
//! large file written and read back sequentially with O_DIRECT, 4 MiB per
//! I/O by default, 32 in flight, into buffers allocated (and touched) once.
//!
//! [`measure_write`] is the write side: a new file written sequentially with
//! O_DIRECT, 32 writes in flight, then `fdatasync`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use std::io;

use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN};
use crate::direct::{open_direct, open_read};
use crate::io_engine::IoEngine;
use crate::io_op::IoOp;

type Result<T> = io::Result<T>;

/// An error that is not the OS's: bad arguments or a short read.
macro_rules! fail {
    ($($arg:tt)*) => {
        return Err(io::Error::other(format!($($arg)*)))
    };
}

/// Names the step an I/O call was part of, keeping its kind.
trait StepContext<T> {
    fn step(self, what: &str) -> Result<T>;
    fn with_step(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: std::fmt::Display + Into<io::Error>> StepContext<T> for std::result::Result<T, E> {
    fn step(self, what: &str) -> Result<T> {
        self.with_step(|| what.to_string())
    }

    fn with_step(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| {
            let e: io::Error = e.into();
            io::Error::new(e.kind(), format!("{}: {e}", what()))
        })
    }
}

/// Bytes per device-limit I/O.
pub const LIMIT_IO_BYTES: u64 = 4 << 20;
/// I/Os in flight for the device limit.
pub const LIMIT_IN_FLIGHT: usize = 32;
/// Largest device-limit file.
pub const MAX_LIMIT_FILE_BYTES: u64 = 1 << 30;

/// Size of the device-limit file for a block set of `total_bytes`:
/// min(total, 1 GiB), rounded up to whole 4 MiB reads.
pub fn limit_file_bytes(total_bytes: u64) -> u64 {
    total_bytes
        .min(MAX_LIMIT_FILE_BYTES)
        .div_ceil(LIMIT_IO_BYTES)
        .max(1)
        * LIMIT_IO_BYTES
}

/// The device-limit file (or files) and the buffers its reads reuse.
#[derive(Debug)]
pub struct DeviceLimit {
    files: Vec<File>,
    /// The reads of one measurement: (index into `files`, offset).
    reads: Vec<(usize, u64)>,
    path: PathBuf,
    bytes: u64,
    /// One buffer per read: the whole file is read as one batch, so no batch
    /// boundary ever drains the queue.
    pool: Vec<AlignedBuf>,
    /// Bytes per read.
    io_bytes: u64,
}

/// Bytes over seconds in GB/s (10^9 bytes per second).
pub fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

/// Writes `bytes / io` I/Os of `io` bytes (the patterns' length)
/// sequentially into `file` (cycling through `patterns`), [`LIMIT_IN_FLIGHT`]
/// in flight, then `fdatasync`s it. Returns GB/s over the writes and the
/// sync.
fn write_sequential(
    file: &File,
    path: &Path,
    bytes: u64,
    patterns: &[Arc<AlignedBuf>],
    engine: &IoEngine,
) -> Result<f64> {
    let Some(io) = patterns.first().map(|p| p.len() as u64).filter(|&n| n > 0) else {
        fail!("no write pattern");
    };
    let n = bytes / io;
    let t = Instant::now();
    let ops = (0..n)
        .map(|i| {
            let p = &patterns[(i % patterns.len() as u64) as usize];
            IoOp::write_shared(file, i * io, p.clone())
        })
        .collect();
    for (i, d) in engine
        .run_batch(ops, LIMIT_IN_FLIGHT)
        .into_iter()
        .enumerate()
    {
        d.result
            .with_step(|| format!("writing {} (I/O {i})", path.display()))?;
    }
    file.sync_data()
        .with_step(|| format!("syncing {}", path.display()))?;
    Ok(gbps(bytes, t.elapsed().as_secs_f64()))
}

/// Buffers of pseudo-random bytes for [`measure_write`]: 8 distinct
/// buffers of `io_bytes` (a multiple of 4 KiB: the write size), so the data
/// neither compresses nor repeats within 8 writes.
pub fn random_write_patterns(io_bytes: usize) -> Result<Vec<Arc<AlignedBuf>>> {
    (0..8u64)
        .map(|k| {
            let mut b =
                AlignedBuf::zeroed(io_bytes, DIRECT_IO_ALIGN).step("allocating a write pattern")?;
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (k + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            for w in b.chunks_exact_mut(8) {
                // xorshift64*
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                w.copy_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
            }
            Ok(Arc::new(b))
        })
        .collect()
}

/// The device's sequential write limit: creates `path`, writes `bytes`
/// (rounded up to whole writes of the patterns' length) of `patterns` with
/// O_DIRECT when `direct`, [`LIMIT_IN_FLIGHT`] in flight, `fdatasync`s it,
/// and removes it. Returns GB/s over the writes and the sync.
pub fn measure_write(
    path: &Path,
    bytes: u64,
    direct: bool,
    patterns: &[Arc<AlignedBuf>],
    engine: &IoEngine,
) -> Result<f64> {
    let io = patterns
        .first()
        .map_or(LIMIT_IO_BYTES, |p| p.len() as u64)
        .max(1);
    let bytes = bytes.div_ceil(io).max(1) * io;
    let file = open_direct(path, true, direct)
        .with_step(|| format!("cannot create device write-limit file {}", path.display()))?;
    let result = write_sequential(&file, path, bytes, patterns, engine);
    drop(file);
    if let Err(e) = std::fs::remove_file(path) {
        tracing::warn!("cannot remove {}: {e}", path.display());
    }
    result
}

impl DeviceLimit {
    /// Writes `bytes` (a multiple of [`LIMIT_IO_BYTES`]) to `path` with
    /// O_DIRECT when `direct`, syncs it, and allocates the read buffers.
    /// Returns the file and the write GB/s.
    pub fn create(path: &Path, bytes: u64, direct: bool, engine: &IoEngine) -> Result<(Self, f64)> {
        Self::create_with_io(path, bytes, LIMIT_IO_BYTES, direct, engine)
    }

    /// Like [`create`](Self::create), with reads (and writes) of `io_bytes`
    /// (a non-zero multiple of 4 KiB) instead of [`LIMIT_IO_BYTES`];
    /// `bytes` is rounded up to a whole number of them. Some virtual disks
    /// only reach their limit with I/Os larger than 4 MiB.
    pub fn create_with_io(
        path: &Path,
        bytes: u64,
        io_bytes: u64,
        direct: bool,
        engine: &IoEngine,
    ) -> Result<(Self, f64)> {
        if io_bytes == 0 || !io_bytes.is_multiple_of(DIRECT_IO_ALIGN as u64) {
            fail!("device-limit I/O size {io_bytes} is not a non-zero multiple of 4 KiB");
        }
        let bytes = bytes.div_ceil(io_bytes).max(1) * io_bytes;
        let file = open_direct(path, true, direct)
            .with_step(|| format!("cannot create device-limit file {}", path.display()))?;
        let io = io_bytes as usize;
        let mut pattern =
            AlignedBuf::zeroed(io, DIRECT_IO_ALIGN).step("allocating a write pattern")?;
        for (i, b) in pattern.iter_mut().enumerate() {
            *b = (i % 251) as u8 ^ 0xa5;
        }
        let write_gbps = write_sequential(&file, path, bytes, &[Arc::new(pattern)], engine)?;
        let n = bytes / io_bytes;
        let pool = (0..n)
            .map(|_| AlignedBuf::zeroed(io, DIRECT_IO_ALIGN))
            .collect::<std::result::Result<Vec<_>, _>>()
            .step("allocating device-limit read buffers")?;
        Ok((
            Self {
                files: vec![file],
                reads: (0..n).map(|i| (0, i * io_bytes)).collect(),
                path: path.to_path_buf(),
                bytes,
                pool,
                io_bytes,
            },
            write_gbps,
        ))
    }

    /// Measures on existing files instead of a file of its own (nothing is
    /// written): about `bytes` in all, an equal share from the start of
    /// each of `paths`, in reads of `io_bytes` (a non-zero multiple of
    /// 4 KiB; a file shorter than its share is read whole, its last read
    /// ending short at end of file). Opened with O_DIRECT when `direct`.
    ///
    /// Used to measure the device on the very files a benchmark reads: a
    /// file written just before it is measured can read slower or faster
    /// than old data while the host below a virtual disk still flushes it.
    pub fn over_files(paths: &[PathBuf], bytes: u64, io_bytes: u64, direct: bool) -> Result<Self> {
        if io_bytes == 0 || !io_bytes.is_multiple_of(DIRECT_IO_ALIGN as u64) {
            fail!("device-limit I/O size {io_bytes} is not a non-zero multiple of 4 KiB");
        }
        let Some(first) = paths.first() else {
            fail!("no file to measure the device on");
        };
        let share = (bytes / paths.len() as u64).div_ceil(io_bytes).max(1) * io_bytes;
        let mut files = Vec::with_capacity(paths.len());
        let mut reads = Vec::new();
        let mut planned = 0u64;
        for (i, p) in paths.iter().enumerate() {
            let f = open_read(p, direct)
                .with_step(|| format!("cannot open {} for the device limit", p.display()))?;
            let len = f
                .metadata()
                .with_step(|| format!("cannot stat {}", p.display()))?
                .len();
            let mut off = 0;
            while off < len.min(share) {
                reads.push((i, off));
                planned += io_bytes.min(len - off);
                off += io_bytes;
            }
            files.push(f);
        }
        if reads.is_empty() {
            fail!("the files to measure the device on are empty");
        }
        let pool = (0..reads.len())
            .map(|_| AlignedBuf::zeroed(io_bytes as usize, DIRECT_IO_ALIGN))
            .collect::<std::result::Result<Vec<_>, _>>()
            .step("allocating device-limit read buffers")?;
        Ok(Self {
            files,
            reads,
            path: first.clone(),
            bytes: planned,
            pool,
            io_bytes,
        })
    }

    /// Bytes of the file.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes per read.
    pub fn io_bytes(&self) -> u64 {
        self.io_bytes
    }

    /// Reads the whole file (or the planned part of the files) once;
    /// returns GB/s.
    pub fn measure(&mut self, engine: &IoEngine) -> Result<f64> {
        let io = self.io_bytes as usize;
        let t = Instant::now();
        let ops = self
            .pool
            .drain(..)
            .zip(&self.reads)
            .map(|(mut buf, &(f, off))| {
                buf.set_len(io);
                IoOp::read(&self.files[f], off, buf)
            })
            .collect();
        let done = engine.run_batch(ops, LIMIT_IN_FLIGHT);
        let secs = t.elapsed().as_secs_f64();
        let mut short = None;
        let mut got = 0u64;
        for (i, d) in done.into_iter().enumerate() {
            match d.result {
                Ok(n) if n > 0 => got += n as u64,
                Ok(n) => short = short.or(Some(format!("read {i} returned {n} of {io} bytes"))),
                Err(e) => short = short.or(Some(format!("read {i} failed: {e}"))),
            }
            if let Some(b) = d.buf.into_owned() {
                self.pool.push(b);
            }
        }
        if let Some(why) = short {
            fail!("device-limit read of {} failed: {why}", self.path.display());
        }
        if got != self.bytes {
            fail!(
                "device-limit reads of {} returned {got} bytes, expected {} (did a file shrink?)",
                self.path.display(),
                self.bytes
            );
        }
        Ok(gbps(got, secs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_size_rule() {
        assert_eq!(limit_file_bytes(4 << 30), 1 << 30);
        assert_eq!(limit_file_bytes(16 << 20), 16 << 20);
        assert_eq!(limit_file_bytes(1 << 20), 4 << 20);
        assert_eq!(limit_file_bytes((8 << 20) + 1), 12 << 20);
    }

    #[test]
    fn writes_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let direct = crate::probe_direct(dir.path()).direct;
        let engine = IoEngine::shared();
        let (mut lim, w) =
            DeviceLimit::create(&dir.path().join("limit"), 8 << 20, direct, engine).unwrap();
        assert!(w > 0.0);
        assert_eq!(lim.bytes(), 8 << 20);
        assert!(lim.measure(engine).unwrap() > 0.0);
        assert!(lim.measure(engine).unwrap() > 0.0);
    }

    #[test]
    fn measures_writes_and_removes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let direct = crate::probe_direct(dir.path()).direct;
        let patterns = random_write_patterns(1 << 20).unwrap();
        assert_eq!(patterns.len(), 8);
        assert_ne!(patterns[0][..64], patterns[1][..64]);
        let path = dir.path().join("w");
        let g = measure_write(&path, 5 << 20, direct, &patterns, IoEngine::shared()).unwrap();
        assert!(g > 0.0);
        assert!(!path.exists());
    }

    #[test]
    fn measures_over_existing_files() {
        let dir = tempfile::tempdir().unwrap();
        let direct = crate::probe_direct(dir.path()).direct;
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::write(&a, vec![1u8; (3 << 20) + 100]).unwrap();
        std::fs::write(&b, vec![2u8; 10 << 20]).unwrap();
        // 8 MiB asked: 4 MiB from each; `a` is shorter, read whole.
        let mut lim =
            DeviceLimit::over_files(&[a.clone(), b.clone()], 8 << 20, 1 << 20, direct).unwrap();
        assert_eq!(lim.bytes(), (3 << 20) + 100 + (4 << 20));
        assert!(lim.measure(IoEngine::shared()).unwrap() > 0.0);
        assert!(lim.measure(IoEngine::shared()).unwrap() > 0.0);
        assert!(DeviceLimit::over_files(&[], 1, 4096, direct).is_err());
        assert!(DeviceLimit::over_files(&[a], 1, 1000, direct).is_err());
    }

    #[test]
    fn larger_reads_round_the_file_up() {
        let dir = tempfile::tempdir().unwrap();
        let direct = crate::probe_direct(dir.path()).direct;
        let engine = IoEngine::shared();
        let (mut lim, _) =
            DeviceLimit::create_with_io(&dir.path().join("l"), 5 << 20, 2 << 20, direct, engine)
                .unwrap();
        assert_eq!((lim.bytes(), lim.io_bytes()), (6 << 20, 2 << 20));
        assert!(lim.measure(engine).unwrap() > 0.0);
        assert!(
            DeviceLimit::create_with_io(&dir.path().join("m"), 1, 1000, direct, engine).is_err()
        );
    }
}
