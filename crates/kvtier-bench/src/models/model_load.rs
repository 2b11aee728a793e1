//! One model load with the kvtier loader, as `kvtier model load DIR` runs
//! it: GB/s, shards, direct or buffered I/O (and why) and the backend.
//!
//! The loader reads all shards in one engine batch and has no progress
//! callback, so the progress bar follows the bytes this process has read
//! from storage (`read_bytes` in `/proc/self/io`, which counts O_DIRECT and
//! io_uring reads too); a load served from the page cache jumps to the end.
//!
//! `device: "cuda:N"` (a `cuda` build) loads into GPU memory instead, through
//! the loader's ring of pinned staging buffers (`kvtier_io::loader::staged`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::bench_error::{BenchError, Result, StepContext, fail};
use indicatif::ProgressBar;
use kvtier_io::loader::{LoadStats, LoaderConfig, load_model_dir};
use kvtier_io::safetensors::read_header;
use serde::Serialize;

use crate::common::progress::progress_bar;
use crate::common::size::format_size;
use crate::reporting::text_report::TextReport;

/// What to load and how (`kvtier model load`).
#[derive(Debug, Clone)]
pub struct ModelLoadOptions {
    /// Model directory: `model.safetensors.index.json`, else
    /// `model.safetensors`, else every `*.safetensors` in it.
    pub dir: PathBuf,
    /// Where the weights go: `cpu` (host memory, reads land in place) or
    /// `cuda`/`cuda:N` (GPU memory through pinned staging buffers; needs the
    /// `cuda` feature).
    pub device: String,
    /// Pinned staging buffers of a GPU load (each `loader.chunk_bytes`).
    pub staging_buffers: usize,
    /// How to read.
    pub loader: LoaderConfig,
    /// After the timed load, read back every tensor from where it landed
    /// and compare it with the file's bytes (plain reads); a difference
    /// fails the command.
    pub verify: bool,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl ModelLoadOptions {
    /// `kvtier model load`'s defaults for the model in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            device: "cpu".into(),
            staging_buffers: kvtier_io::loader::staged::DEFAULT_RING,
            loader: LoaderConfig::default(),
            verify: false,
            progress: true,
        }
    }
}

/// What `kvtier model load --json` prints.
#[derive(Debug, Serialize)]
pub struct LoadReport {
    /// The model directory.
    pub dir: String,
    /// Bytes read (the shard files' total length).
    pub bytes: u64,
    /// Number of shard files.
    pub shards: usize,
    /// Number of tensors.
    pub tensors: usize,
    /// Seconds of the load (headers, reads, verification).
    pub seconds: f64,
    /// GB/s (10^9 bytes/s).
    pub gbps: f64,
    /// True when every shard was read with O_DIRECT.
    pub direct: bool,
    /// Why some shard was read buffered, when one was.
    pub buffered_reason: Option<String>,
    /// `io_uring` or `threads`.
    pub io_backend: String,
    /// Bytes per read.
    pub chunk_bytes: u64,
    /// Reads in flight.
    pub in_flight: u32,
    /// Where the weights went: `cpu` or `cuda:N`.
    pub device: String,
    /// Pinned staging buffers used (GPU loads only).
    pub staging_buffers: Option<usize>,
    /// Most host-to-device copies queued at once while reads ran (GPU
    /// loads only).
    pub max_queued_copies: Option<usize>,
    /// With `--verify`: every tensor's bytes, read back from where they
    /// landed, equal the file's (a difference is an error, so `true`).
    pub verified: Option<bool>,
}

/// What one load did, whichever the destination.
struct Loaded {
    stats: LoadStats,
    tensors: usize,
    staging_buffers: Option<usize>,
    max_queued_copies: Option<usize>,
}

/// Loads into host memory: reads land in place.
fn load_host(dir: &Path, cfg: &LoaderConfig, verify: bool) -> Result<Loaded> {
    let (shards, stats) = load_model_dir(dir, cfg).map_err(BenchError::other)?;
    if verify {
        for shard in &shards {
            let header = shard.header();
            let mut check = FileCheck::open(shard.path())?;
            for info in &header.tensors {
                let Some(view) = shard.tensor(&info.name) else {
                    fail!(
                        "{}: tensor {} was not loaded",
                        shard.path().display(),
                        info.name
                    );
                };
                let start = header.data_start() + info.data_offsets.0;
                check.range(start, view.data.len() as u64, |at, buf| {
                    let from = (at - start) as usize;
                    buf.copy_from_slice(&view.data[from..from + buf.len()]);
                    Ok(())
                })?;
            }
        }
    }
    Ok(Loaded {
        stats,
        tensors: shards.iter().map(|s| s.len()).sum(),
        staging_buffers: None,
        max_queued_copies: None,
    })
}

/// Loads into the memory of GPU `device` through `ring` pinned staging
/// buffers, on the stream candle would use for it.
#[cfg(feature = "cuda")]
fn load_gpu(
    dir: &Path,
    cfg: &LoaderConfig,
    device: &str,
    ring: usize,
    verify: bool,
) -> Result<Loaded> {
    use kvtier_io::loader::staged::{CudaSink, load_model_dir_staged};
    let dev = kvtier_engine::open_device(device)?;
    let Some(stream) = kvtier_engine::cuda_stream(&dev) else {
        fail!("--device {device} is not a GPU");
    };
    let load = load_model_dir_staged(dir, cfg, ring, CudaSink::on_stream(stream.clone()))
        .map_err(BenchError::other)?;
    if verify {
        for shard in &load.shards {
            // The device memory holds the whole file: header and tensors.
            let memory = shard.memory();
            FileCheck::open(shard.path())?.range(0, memory.len() as u64, |at, buf| {
                let from = at as usize;
                stream
                    .memcpy_dtoh(&memory.slice(from..from + buf.len()), buf)
                    .map_err(|e| BenchError::Failed(format!("reading back from {device}: {e}")))
            })?;
        }
    }
    Ok(Loaded {
        tensors: load.shards.iter().map(|s| s.header().tensors.len()).sum(),
        staging_buffers: Some(load.stats.staging_buffers),
        max_queued_copies: Some(load.stats.max_queued_copies),
        stats: load.stats.load,
    })
}

/// Without the `cuda` feature there is no GPU to load into: the device
/// name is checked, and the error says how to build with it.
#[cfg(not(feature = "cuda"))]
fn load_gpu(
    _dir: &Path,
    _cfg: &LoaderConfig,
    device: &str,
    _ring: usize,
    _verify: bool,
) -> Result<Loaded> {
    kvtier_engine::open_device(device)?;
    fail!("--device {device} is not a GPU")
}

/// Bytes `--verify` compares at a time: its memory stays bounded whatever
/// the size of a shard or a tensor.
const VERIFY_PIECE: u64 = 64 << 20;

/// The reference side of `--verify`: one shard file, opened once and read
/// plainly a piece at a time into buffers kept across its ranges.
struct FileCheck<'a> {
    path: &'a Path,
    file: std::fs::File,
    size: u64,
    want: Vec<u8>,
    got: Vec<u8>,
}

impl<'a> FileCheck<'a> {
    fn open(path: &'a Path) -> Result<Self> {
        let file = std::fs::File::open(path)
            .with_step(|| format!("cannot open {} to verify it", path.display()))?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(Self {
            path,
            file,
            size,
            want: Vec::new(),
            got: Vec::new(),
        })
    }

    /// Compares `len` loaded bytes that belong at `offset` of the file with
    /// it: `loaded(at, buf)` fills `buf` with the loaded bytes of file
    /// offset `at`. The error names the first byte that differs.
    fn range(
        &mut self,
        offset: u64,
        len: u64,
        mut loaded: impl FnMut(u64, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let path = self.path;
        let end = offset.checked_add(len).filter(|&end| end <= self.size);
        let Some(end) = end else {
            fail!(
                "{}: {len} loaded bytes at offset {offset} lie past the file's end ({} bytes)",
                path.display(),
                self.size
            );
        };
        let piece = len.min(VERIFY_PIECE) as usize;
        if self.want.len() < piece {
            self.want.resize(piece, 0);
            self.got.resize(piece, 0);
        }
        let mut at = offset;
        while at < end {
            let n = (end - at).min(VERIFY_PIECE) as usize;
            let (want, got) = (&mut self.want[..n], &mut self.got[..n]);
            self.file
                .read_exact_at(want, at)
                .with_step(|| format!("cannot read {} to verify it", path.display()))?;
            loaded(at, got)?;
            if let Some(i) = want.iter().zip(got.iter()).position(|(a, b)| a != b) {
                fail!(
                    "{}: the loaded bytes differ from the file at offset {}",
                    path.display(),
                    at + i as u64
                );
            }
            at += n as u64;
        }
        Ok(())
    }
}

/// Bytes this process has read from storage so far (`None` when
/// `/proc/self/io` is not readable).
fn storage_read_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Moves `pb` along with this process's storage reads until `stop`.
fn follow_reads(pb: ProgressBar, total: u64, stop: Arc<AtomicBool>) {
    let Some(start) = storage_read_bytes() else {
        return;
    };
    while !stop.load(Ordering::Relaxed) {
        if let Some(now) = storage_read_bytes() {
            pb.set_position(now.saturating_sub(start).min(total));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sum of the shard lengths the headers describe (for the bar's total).
fn expected_bytes(dir: &Path) -> u64 {
    kvtier_io::loader::model_shards(dir)
        .map(|paths| {
            paths
                .iter()
                .filter_map(|p| read_header(p).ok())
                .map(|h| h.file_len())
                .sum()
        })
        .unwrap_or(0)
}

/// Fails with a plain message when `dir` is not an existing directory.
pub fn check_model_dir(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => fail!(
            "{} is not a directory (expected a model directory)",
            dir.display()
        ),
        Err(e) => fail!("cannot open model directory {}: {e}", dir.display()),
    }
}

/// Loads the model, following the reads with a progress bar, and returns
/// the report.
pub fn run_model_load(opts: &ModelLoadOptions) -> Result<LoadReport> {
    check_model_dir(&opts.dir)?;
    let cfg = opts.loader.clone();
    let total = expected_bytes(&opts.dir);
    let pb = progress_bar(total, !opts.progress);
    pb.set_message("loading");
    let stop = Arc::new(AtomicBool::new(false));
    let follower = {
        let (pb, stop) = (pb.clone(), stop.clone());
        std::thread::spawn(move || follow_reads(pb, total, stop))
    };
    let loaded = if opts.device == "cpu" {
        load_host(&opts.dir, &cfg, opts.verify)
    } else {
        load_gpu(
            &opts.dir,
            &cfg,
            &opts.device,
            opts.staging_buffers,
            opts.verify,
        )
    };
    stop.store(true, Ordering::Relaxed);
    let _ = follower.join();
    pb.finish_and_clear();
    let loaded = loaded.with_step(|| format!("cannot load the model in {}", opts.dir.display()))?;
    let stats = &loaded.stats;
    Ok(LoadReport {
        dir: opts.dir.display().to_string(),
        bytes: stats.bytes,
        shards: stats.shards,
        tensors: loaded.tensors,
        seconds: stats.seconds,
        gbps: stats.gbps(),
        direct: stats.direct,
        buffered_reason: stats.buffered_reason.clone(),
        io_backend: stats.io_backend.to_string(),
        chunk_bytes: cfg.chunk_bytes as u64,
        in_flight: cfg.in_flight as u32,
        device: opts.device.clone(),
        staging_buffers: loaded.staging_buffers,
        max_queued_copies: loaded.max_queued_copies,
        verified: opts.verify.then_some(true),
    })
}

impl TextReport for LoadReport {
    fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "loaded {} into {}: {} in {} shard(s), {} tensors, {:.2} s, {:.2} GB/s",
            self.dir,
            self.device,
            format_size(self.bytes),
            self.shards,
            self.tensors,
            self.seconds,
            self.gbps
        );
        let _ = writeln!(
            out,
            "reads: {}, {}, {} x {} in flight",
            if self.direct {
                "O_DIRECT".to_string()
            } else {
                format!(
                    "buffered ({})",
                    self.buffered_reason.as_deref().unwrap_or("reason unknown")
                )
            },
            self.io_backend,
            format_size(self.chunk_bytes),
            self.in_flight
        );
        if let (Some(n), Some(q)) = (self.staging_buffers, self.max_queued_copies) {
            let _ = writeln!(
                out,
                "staging: {n} pinned buffers, up to {q} copies queued while reads ran"
            );
        }
        if self.verified == Some(true) {
            let _ = writeln!(out, "verified: every tensor equals the file's bytes");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_own_io_counters() {
        // Present on Linux; the bar simply does not move elsewhere.
        if Path::new("/proc/self/io").exists() {
            assert!(storage_read_bytes().is_some());
        }
        assert_eq!(expected_bytes(Path::new("/nonexistent/model")), 0);
    }

    #[test]
    fn verify_names_the_first_differing_byte_and_a_short_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, [1u8, 2, 3, 4, 5, 6]).unwrap();
        let from = |bytes: &'static [u8], start: u64| {
            move |at: u64, buf: &mut [u8]| {
                let i = (at - start) as usize;
                buf.copy_from_slice(&bytes[i..i + buf.len()]);
                Ok(())
            }
        };
        assert!(
            FileCheck::open(&path)
                .unwrap()
                .range(2, 3, from(&[3, 4, 5], 2))
                .is_ok()
        );
        let e = FileCheck::open(&path)
            .unwrap()
            .range(1, 3, from(&[2, 3, 9], 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("differ from the file at offset 3"), "{e}");
        let e = FileCheck::open(&path)
            .unwrap()
            .range(4, 3, from(&[5, 6, 7], 4))
            .unwrap_err()
            .to_string();
        assert!(e.contains("past the file's end (6 bytes)"), "{e}");
        let e = FileCheck::open(&path)
            .unwrap()
            .range(u64::MAX, 1, from(&[1], 0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("past the file's end"), "{e}");
        let gone = dir.path().join("gone");
        let e = FileCheck::open(&gone).err().unwrap().to_string();
        assert!(e.contains("cannot open"), "{e}");
    }

    #[test]
    fn verify_compares_a_range_larger_than_a_piece_piece_by_piece() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big");
        let len = VERIFY_PIECE as usize + 5000;
        let mut data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let mut pieces = 0;
        let mut file = FileCheck::open(&path).unwrap();
        let mut check = |data: &[u8]| {
            file.range(0, len as u64, |at, buf| {
                pieces += 1;
                buf.copy_from_slice(&data[at as usize..at as usize + buf.len()]);
                Ok(())
            })
        };
        assert!(check(&data).is_ok());
        data[len - 10] ^= 1;
        let e = check(&data).unwrap_err().to_string();
        assert!(e.contains(&format!("offset {}", len - 10)), "{e}");
        assert_eq!(pieces, 4, "two pieces per pass");
    }
}
