//! Opening shards (header validated first, `O_DIRECT` probed) and reading
//! them whole, in large aligned chunks, straight into their final buffers.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN};
use crate::direct::open_read;
use crate::io_engine::IoEngine;
use crate::io_op::IoOp;
use crate::safetensors::{Header, read_header_from};

use super::LoaderConfig;
use super::load_error::LoadError;
use super::prefault;
use super::window::carve;

/// A shard whose header is validated, open for the bulk read.
#[derive(Debug)]
pub(crate) struct OpenShard {
    pub(crate) path: PathBuf,
    pub(crate) header: Header,
    /// The 8-byte length and header bytes as validated.
    pub(crate) prefix: Vec<u8>,
    pub(crate) file: File,
    pub(crate) len: u64,
    pub(crate) direct: bool,
    /// Why `O_DIRECT` is not used, when it is not.
    pub(crate) buffered_reason: Option<String>,
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> LoadError + '_ {
    move |source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Validates `path`'s header (reading only the prefix) and opens it for
/// the bulk read, with `O_DIRECT` as configured or probed.
pub(crate) fn open_shard(path: &Path, cfg: &LoaderConfig) -> Result<OpenShard, LoadError> {
    let plain = open_regular(path)?;
    let (header, prefix) = read_header_from(&plain, path)?;
    let len = header.file_len();
    drop(plain);
    let (file, direct, buffered_reason) = open_bulk(path, cfg.direct)?;
    let now = file.metadata().map_err(io_err(path))?.len();
    if now != len {
        return Err(LoadError::Changed {
            path: path.to_path_buf(),
            msg: format!("length was {len}, is now {now}"),
        });
    }
    Ok(OpenShard {
        path: path.to_path_buf(),
        header,
        prefix,
        file,
        len,
        direct,
        buffered_reason,
    })
}

/// Opens `path` for reading and checks that it is a regular file (symlinks
/// followed). `O_NONBLOCK` keeps the open from waiting for a writer when
/// `path` is a FIFO; a FIFO, a device (`/dev/zero`), a socket or a
/// directory is an error naming the path, not a hang or an endless read.
fn open_regular(path: &Path) -> Result<File, LoadError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err(path))?;
    let kind = file.metadata().map_err(io_err(path))?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    let what = if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(LoadError::Io {
        path: path.to_path_buf(),
        source: io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("not a safetensors file: {what}, not a regular file"),
        ),
    })
}

/// Opens the bulk-read descriptor: `Some(true)` requires `O_DIRECT`,
/// `Some(false)` is buffered, `None` probes with one aligned direct read of
/// the file itself (read-only: works on read-only mounts) and falls back to
/// buffered I/O with a logged reason. `KVTIER_DIRECT_IO=0` forces buffered.
fn open_bulk(path: &Path, want: Option<bool>) -> Result<(File, bool, Option<String>), LoadError> {
    match want {
        Some(true) => {
            let f = open_read(path, true).map_err(io_err(path))?;
            Ok((f, true, None))
        }
        Some(false) => {
            let f = open_read(path, false).map_err(io_err(path))?;
            Ok((f, false, Some("buffered I/O requested".into())))
        }
        None => {
            if std::env::var("KVTIER_DIRECT_IO").is_ok_and(|v| v == "0" || v == "false") {
                let f = open_read(path, false).map_err(io_err(path))?;
                return Ok((f, false, Some("disabled by KVTIER_DIRECT_IO=0".into())));
            }
            match probe_direct_read(path) {
                Ok(f) => Ok((f, true, None)),
                Err(e) => {
                    let reason = format!("O_DIRECT read of {} failed: {e}", path.display());
                    tracing::warn!("{reason}; falling back to buffered I/O");
                    let f = open_read(path, false).map_err(io_err(path))?;
                    Ok((f, false, Some(reason)))
                }
            }
        }
    }
}

fn probe_direct_read(path: &Path) -> io::Result<File> {
    let f = open_read(path, true)?;
    let mut block =
        AlignedBuf::zeroed(DIRECT_IO_ALIGN, DIRECT_IO_ALIGN).map_err(io::Error::other)?;
    f.read_at(&mut block, 0)?;
    Ok(f)
}

/// Allocates one buffer per shard and reads every shard whole into it with
/// `chunk_bytes` reads at aligned offsets (the last one rounded up to 4 KiB
/// and ending short at end of file), all in one batch with `in_flight`
/// outstanding. Reads land in place: no bounce buffer, no copy. With
/// `cfg.prefault`, helper threads fault the buffers in ahead of the reads
/// while they run (see [`prefault`]).
pub(crate) fn read_shards(
    shards: &[OpenShard],
    bufs: &mut [AlignedBuf],
    cfg: &LoaderConfig,
    engine: &IoEngine,
) -> Result<(), LoadError> {
    struct Chunk {
        shard: usize,
        offset: usize,
        len: usize,
        addr: usize,
    }
    let mut ops = Vec::new();
    let mut plan = Vec::new();
    let mut ranges = Vec::with_capacity(bufs.len());
    for (i, (shard, buf)) in shards.iter().zip(bufs.iter_mut()).enumerate() {
        let cap = buf.capacity();
        let base = buf.as_mut_ptr();
        ranges.push((base as usize, cap));
        let mut offset = 0usize;
        while offset < cap {
            let len = cfg.chunk_bytes.min(cap - offset);
            // SAFETY: `buf` is live for this whole function and was just
            // allocated zeroed; chunks are disjoint, 4 KiB-aligned ranges
            // inside its capacity; `buf` is not accessed until every chunk
            // buffer has come back from the batch and been dropped, and is
            // leaked if the engine could not hand them back.
            let chunk = unsafe { carve(base, offset, len) }?;
            ops.push(IoOp::read(&shard.file, offset as u64, chunk));
            plan.push(Chunk {
                shard: i,
                offset,
                len,
                addr: base as usize + offset,
            });
            offset += len;
        }
    }
    let stop = AtomicBool::new(false);
    // The first `in_flight` reads are submitted at once and fault their own
    // pages: the helpers start after them.
    let work = prefault::Work::new(&ranges, cfg.in_flight.saturating_mul(cfg.chunk_bytes));
    let done = std::thread::scope(|s| {
        if cfg.prefault {
            // The buffers outlive this scope. Failing to start a helper only
            // costs speed.
            for i in 0..std::env::var("PF_THREADS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(prefault::THREADS)
            {
                let helper = std::thread::Builder::new()
                    .name(format!("kvtier-prefault-{i}"))
                    .spawn_scoped(s, {
                        let (work, stop) = (&work, &stop);
                        move || work.populate(stop)
                    });
                if let Err(e) = helper {
                    tracing::debug!("no prefault thread: {e}");
                    break;
                }
            }
        }
        let done = engine.run_batch(ops, cfg.in_flight);
        stop.store(true, Ordering::Relaxed);
        done
    });
    let intact = done.len() == plan.len()
        && done
            .iter()
            .zip(&plan)
            .all(|(d, c)| d.buf.as_ptr() as usize == c.addr);
    if !intact {
        // The engine kept (leaked) buffers it could not reclaim from the
        // kernel: the shard memory may still be written to. Leak it too.
        for buf in bufs.iter_mut() {
            std::mem::forget(std::mem::replace(buf, AlignedBuf::empty()));
        }
        let path = shards.first().map(|s| s.path.clone()).unwrap_or_default();
        return Err(LoadError::Io {
            path,
            source: io::Error::other("the I/O engine failed with reads in flight"),
        });
    }
    let mut first_err = None;
    for (d, c) in done.into_iter().zip(&plan) {
        let shard = &shards[c.shard];
        let want = (shard.len - c.offset as u64).min(c.len as u64) as usize;
        if let (Err(e), None) = (check_read(shard, c.offset, want, d.result), &first_err) {
            first_err = Some(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Checks one chunk read's outcome: `want` bytes read at `offset`.
pub(crate) fn check_read(
    shard: &OpenShard,
    offset: usize,
    want: usize,
    result: io::Result<usize>,
) -> Result<(), LoadError> {
    match result {
        Err(source) => Err(LoadError::Io {
            path: shard.path.clone(),
            source,
        }),
        Ok(got) if got != want => Err(LoadError::Changed {
            path: shard.path.clone(),
            msg: format!("read {got} bytes at offset {offset}, expected {want}"),
        }),
        Ok(_) => Ok(()),
    }
}

/// The shard's length as a buffer size.
pub(crate) fn shard_len(shard: &OpenShard) -> Result<usize, LoadError> {
    usize::try_from(shard.len).map_err(|_| {
        LoadError::BadConfig(format!(
            "{}: too large for this platform",
            shard.path.display()
        ))
    })
}

/// Checks that the file's length is still the one validated.
pub(crate) fn check_unchanged(shard: &OpenShard) -> Result<(), LoadError> {
    let now = shard.file.metadata().map_err(io_err(&shard.path))?.len();
    if now != shard.len {
        return Err(LoadError::Changed {
            path: shard.path.clone(),
            msg: format!("length was {}, is now {now}", shard.len),
        });
    }
    Ok(())
}

/// Checks that what was read is what was validated: the header bytes
/// match and the file length has not changed.
pub(crate) fn verify(shard: &OpenShard, buf: &AlignedBuf) -> Result<(), LoadError> {
    check_prefix(shard, 0, buf)?;
    check_unchanged(shard)
}

/// Checks that the header bytes among `bytes`, read at `offset` of the
/// file, are the ones validated (bytes past the header are not checked).
pub(crate) fn check_prefix(
    shard: &OpenShard,
    offset: usize,
    bytes: &[u8],
) -> Result<(), LoadError> {
    let Some(want) = shard.prefix.get(offset..) else {
        return Ok(());
    };
    let n = want.len().min(bytes.len());
    if want[..n] != bytes[..n] {
        return Err(LoadError::Changed {
            path: shard.path.clone(),
            msg: "the header differs from the one validated".into(),
        });
    }
    Ok(())
}
