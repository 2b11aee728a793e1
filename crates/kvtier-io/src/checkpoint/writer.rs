//! The save pipeline: write every shard with large aligned parallel writes,
//! make it durable, commit the manifest, then retire the old generation.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use super::checkpoint_error::CheckpointError;
use super::cleanup::cleanup_locked;
use super::dirs::{self, DirLock, shard_file_name};
use super::manifest::{self, MANIFEST_FORMAT, MANIFEST_VERSION, Manifest, ShardEntry, TensorEntry};
use super::options::{CheckpointInfo, MANIFEST_TMP, SaveOptions, TensorRef};
use super::shard_layout::{self, Chunk, Plan};
use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN};
use crate::direct::{DirectProbe, open_direct, probe_direct};
use crate::io_op::{IoBuf, IoKind, IoOp};
use crate::safetensors::Dtype;

/// Name, dtype and shape of one tensor, owned (the manifest outlives the
/// caller's borrow in an asynchronous save).
#[derive(Debug, Clone)]
pub(crate) struct TensorMeta {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// Where the bytes of the shard images come from.
pub(crate) enum Source<'a> {
    /// The caller's tensors, gathered into reusable chunk buffers while
    /// writing (synchronous save).
    Borrowed(Vec<&'a [u8]>),
    /// The complete file images, one buffer per [`Plan::chunks`] entry
    /// (asynchronous save: the snapshot).
    Snapshot(Vec<Arc<AlignedBuf>>),
}

/// A save ready to be written: its layout, its bytes and its tensor list.
pub(crate) struct Prepared<'a> {
    pub plan: Plan,
    pub source: Source<'a>,
    pub meta: Vec<TensorMeta>,
    /// When the save call began (for [`CheckpointInfo::seconds`]).
    pub started: Instant,
    /// Seconds spent taking the snapshot (asynchronous saves).
    pub snapshot_seconds: f64,
}

/// Saves `tensors` as a new checkpoint generation in `dir` (created if
/// missing) and returns once it is committed and durable.
///
/// See the [module documentation](super) for the file layout and the
/// commit protocol. On any error before the commit point, the new
/// generation's files are removed and the previous checkpoint stays the
/// committed one; a full device gives [`CheckpointError::DiskFull`].
pub fn save(
    dir: &Path,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CheckpointInfo, CheckpointError> {
    let started = Instant::now();
    let plan = shard_layout::plan(tensors, opts)?;
    let prepared = Prepared {
        plan,
        source: Source::Borrowed(tensors.iter().map(|t| t.data).collect()),
        meta: meta_of(tensors),
        started,
        snapshot_seconds: 0.0,
    };
    commit(dir, prepared, opts)
}

pub(crate) fn meta_of(tensors: &[TensorRef<'_>]) -> Vec<TensorMeta> {
    tensors
        .iter()
        .map(|t| TensorMeta {
            name: t.name.to_string(),
            dtype: t.dtype,
            shape: t.shape.to_vec(),
        })
        .collect()
}

/// Writes, fsyncs and commits a prepared save; retires the old generation.
pub(crate) fn commit(
    dir: &Path,
    prepared: Prepared<'_>,
    opts: &SaveOptions,
) -> Result<CheckpointInfo, CheckpointError> {
    if !dir.is_dir() {
        fs::create_dir_all(dir).map_err(|e| CheckpointError::io("create directory", dir, e))?;
        // Make the new directory's own entry durable too.
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            dirs::fsync_dir(parent)?;
        }
    }
    let _lock = DirLock::acquire(dir)?;
    let committed = manifest::read_manifest(dir)?;
    cleanup_locked(dir, committed.as_ref())?;
    let previous = committed.as_ref().map(|m| m.generation);
    let generation = previous.map_or(1, |g| g + 1);

    let probe = if opts.direct {
        probe_direct(dir)
    } else {
        DirectProbe {
            direct: false,
            reason: Some("disabled by SaveOptions::direct = false".into()),
        }
    };
    if let Some(reason) = &probe.reason {
        tracing::warn!(
            "checkpoint save in {} uses buffered writes: {reason}",
            dir.display()
        );
    }

    let Prepared {
        plan,
        source,
        meta,
        started,
        snapshot_seconds,
    } = prepared;
    let plan = &plan;
    let n = plan.shards.len();
    let names: Vec<String> = (0..n).map(|i| shard_file_name(generation, i, n)).collect();
    let paths: Vec<PathBuf> = names.iter().map(|f| dir.join(f)).collect();

    let abandon = |e: CheckpointError| -> CheckpointError {
        remove_quietly(&paths, dir);
        match e {
            CheckpointError::Io { op, path, source }
                if super::checkpoint_error::is_enospc(&source) =>
            {
                CheckpointError::DiskFull {
                    op,
                    path,
                    generation,
                    needed: plan.file_bytes(),
                    previous,
                    source,
                }
            }
            other => other,
        }
    };

    let (crcs, borrowed_bytes) =
        write_shards(&paths, plan, &source, probe.direct, opts).map_err(abandon)?;
    // Written and durable: an asynchronous save's snapshot can go now.
    drop(source);
    dirs::fsync_dir(dir).map_err(abandon)?;

    let manifest = build_manifest(generation, plan, &meta, &names, &crcs, opts);
    manifest::write_and_rename(dir, &manifest).map_err(abandon)?;
    // The rename happened. Until the directory is fsynced it may not survive
    // a crash, so if that fails keep every file: the next save's cleanup
    // removes whichever generation `manifest.json` does not name.
    dirs::fsync_dir(dir)?;

    if let Some(old) = &committed {
        for s in &old.shards {
            let p = dir.join(&s.file);
            if let Err(e) = fs::remove_file(&p)
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(
                    "cannot remove {} of retired generation {}: {e}",
                    p.display(),
                    old.generation
                );
            }
        }
    }

    let info = CheckpointInfo {
        generation,
        bytes: plan.file_bytes(),
        tensor_bytes: manifest.tensor_bytes(),
        files: paths,
        seconds: started.elapsed().as_secs_f64(),
        snapshot_seconds,
        direct: probe.direct,
        direct_reason: probe.reason,
        borrowed_bytes,
    };
    tracing::info!(
        "checkpoint generation {} committed in {}: {} bytes in {} file(s), {:.3} s, {}",
        info.generation,
        dir.display(),
        info.bytes,
        info.files.len(),
        info.seconds,
        probe_mode(info.direct)
    );
    Ok(info)
}

fn probe_mode(direct: bool) -> &'static str {
    if direct { "O_DIRECT" } else { "buffered" }
}

fn remove_quietly(paths: &[PathBuf], dir: &Path) {
    for p in paths.iter().cloned().chain([dir.join(MANIFEST_TMP)]) {
        if let Err(e) = fs::remove_file(&p)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!("cannot remove partial checkpoint file {}: {e}", p.display());
        }
    }
}

fn build_manifest(
    generation: u64,
    plan: &Plan,
    meta: &[TensorMeta],
    names: &[String],
    crcs: &[u32],
    opts: &SaveOptions,
) -> Manifest {
    Manifest {
        format: MANIFEST_FORMAT.to_string(),
        version: MANIFEST_VERSION,
        generation,
        shards: plan
            .shards
            .iter()
            .zip(names)
            .map(|(s, file)| ShardEntry {
                file: file.clone(),
                bytes: s.file_len,
                data_start: s.data_start(),
            })
            .collect(),
        tensors: meta
            .iter()
            .zip(&plan.placed)
            .zip(crcs)
            .map(|((m, p), &crc32c)| TensorEntry {
                name: m.name.clone(),
                shard: p.shard,
                dtype: m.dtype.as_str().to_string(),
                shape: m.shape.clone(),
                data_offsets: (p.begin, p.end),
                crc32c,
            })
            .collect(),
        metadata: opts.metadata.clone(),
    }
}

/// Creates the shard files, writes them, truncates each to its exact
/// length and fsyncs it. Returns the tensors' crc32c values (computed
/// while the writes run) and the bytes written from the caller's memory.
fn write_shards(
    paths: &[PathBuf],
    plan: &Plan,
    source: &Source<'_>,
    direct: bool,
    opts: &SaveOptions,
) -> Result<(Vec<u32>, u64), CheckpointError> {
    let mut files = Vec::with_capacity(paths.len());
    for (path, shard) in paths.iter().zip(&plan.shards) {
        let file = open_direct(path, true, direct)
            .and_then(|f| f.set_len(0).map(|()| f))
            .map_err(|e| CheckpointError::io("create", path, e))?;
        if opts.preallocate {
            preallocate(
                &file,
                shard.file_len.next_multiple_of(DIRECT_IO_ALIGN as u64),
            )
            .map_err(|e| CheckpointError::io("preallocate", path, e))?;
        }
        files.push(file);
    }

    let written = match source {
        Source::Borrowed(data) => write_gathered(&files, plan, data, direct, opts),
        Source::Snapshot(bufs) => std::thread::scope(|s| {
            let crc = s.spawn(|| snapshot_crcs(plan, bufs));
            let written = write_snapshot(&files, plan, bufs, opts);
            let crcs = crc.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            written.map(|()| (crcs, 0))
        }),
    };
    let (crcs, borrowed) =
        written.map_err(|(shard, e)| CheckpointError::io("write", &paths[shard], e))?;

    // Exact lengths, then durability, a few files at a time.
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<CheckpointError>> = Mutex::new(None);
    let workers = opts.threads.clamp(1, files.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= files.len() {
                        break;
                    }
                    let r = files[i]
                        .set_len(plan.shards[i].file_len)
                        .map_err(|e| CheckpointError::io("truncate", &paths[i], e))
                        .and_then(|()| {
                            files[i]
                                .sync_all()
                                .map_err(|e| CheckpointError::io("fsync", &paths[i], e))
                        });
                    if let Err(e) = r {
                        let mut slot = failed.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(e);
                        break;
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok((crcs, borrowed)),
    }
}

/// Reserves `len` bytes for `file` so that a full device shows up before the
/// first write and extents are allocated once. File systems without
/// `fallocate` are written without it.
fn preallocate(file: &File, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(len).map_err(io::Error::other)?;
    loop {
        // SAFETY: fallocate on a file descriptor we own; no memory involved.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => return Ok(()),
            _ => return Err(e),
        }
    }
}

/// crc32c of every input tensor's bytes, in input order, read from the
/// snapshot (on a thread of its own while the writes run).
fn snapshot_crcs(plan: &Plan, bufs: &[Arc<AlignedBuf>]) -> Vec<u32> {
    (0..plan.placed.len())
        .map(|i| {
            let shard = &plan.shards[plan.placed[i].shard];
            let (start, end) = plan.file_range(i);
            let chunks = &plan.chunks[shard.first_chunk..shard.first_chunk + shard.n_chunks];
            let bufs = &bufs[shard.first_chunk..shard.first_chunk + shard.n_chunks];
            let mut crc = 0u32;
            for (c, b) in chunks.iter().zip(bufs) {
                let (cs, ce) = (c.offset, c.offset + c.len as u64);
                let (s, e) = (start.max(cs), end.min(ce));
                if s < e {
                    crc = crc32c::crc32c_append(crc, &b[(s - cs) as usize..(e - cs) as usize]);
                }
            }
            crc
        })
        .collect()
}

type WriteFailure = (usize, io::Error);

/// Synchronous save: `threads` filler threads prepare chunks while one
/// engine stream keeps `in_flight` chunk writes outstanding. A chunk that a
/// single tensor fills ([`Chunk::tensor`](super::shard_layout::Chunk)) whose
/// bytes sit at an address the device can read from directly is written
/// straight from the caller's memory; every other chunk is gathered into an
/// aligned buffer, which goes back to the fillers as soon as its write
/// completes (at most `in_flight + threads` chunk buffers exist). Returns
/// the tensors' crc32c values, computed by the fillers on each piece (a
/// gathered one right after copying it, so tensor bytes are read from
/// memory once; a borrowed one while its write is in flight) and the bytes
/// written from the caller's memory.
///
/// Why this shape (docs/decisions.md): gathering a group of chunks and
/// then waiting for the whole group let the device queue drain between
/// groups, and gathering on the submitting thread alone made the copy the
/// limit, below the device write limit that the same save reached with the
/// copy left out. Even spread over filler threads, the copy kept a save
/// CPU-bound whenever the VM's CPUs were slow; writing aligned tensors
/// without the copy removes it.
fn write_gathered<'a>(
    files: &'a [File],
    plan: &Plan,
    data: &[&'a [u8]],
    direct: bool,
    opts: &SaveOptions,
) -> Result<(Vec<u32>, u64), WriteFailure> {
    let n = plan.chunks.len();
    if n == 0 {
        return Ok((vec![0; plan.placed.len()], 0));
    }
    // Per chunk, the crc32c of each tensor piece it holds: (tensor, crc, len).
    let partials: Vec<Mutex<Vec<(usize, u32, usize)>>> =
        (0..n).map(|_| Mutex::new(Vec::new())).collect();
    let fillers = opts.threads.clamp(1, n);
    let pool = BufPool::new(opts.in_flight + fillers);
    let next_chunk = AtomicUsize::new(0);
    let borrowed = AtomicU64::new(0);
    let abort = AtomicBool::new(false);
    let failed: Mutex<Option<WriteFailure>> = Mutex::new(None);
    let fail = |f: WriteFailure| {
        abort.store(true, Ordering::Relaxed);
        failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(f);
    };
    // The chunk index of each op, by stream position, to name a failure.
    let order: Mutex<Vec<usize>> = Mutex::new(Vec::with_capacity(n));
    let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, IoBuf<'a>)>(opts.in_flight + fillers);
    std::thread::scope(|s| {
        for _ in 0..fillers {
            let tx = tx.clone();
            let (pool, next_chunk, abort, fail) = (&pool, &next_chunk, &abort, &fail);
            let borrowed = &borrowed;
            let partials = &partials;
            s.spawn(move || {
                while !abort.load(Ordering::Relaxed) {
                    let k = next_chunk.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = plan.chunks.get(k) else {
                        break;
                    };
                    if let Some((i, src)) = borrowable(plan, c, data, direct) {
                        if tx.send((k, IoBuf::Borrowed(src))).is_err() {
                            break;
                        }
                        *partials[k].lock().unwrap_or_else(|p| p.into_inner()) =
                            vec![(i, crc32c::crc32c(src), src.len())];
                        borrowed.fetch_add(src.len() as u64, Ordering::Relaxed);
                        continue;
                    }
                    let mut buf = match pool.take(|| {
                        AlignedBuf::zeroed_in(&opts.allocator, plan.chunk_bytes, DIRECT_IO_ALIGN)
                    }) {
                        Ok(b) => b,
                        Err(e) => {
                            fail((c.shard, io::Error::new(io::ErrorKind::OutOfMemory, e)));
                            break;
                        }
                    };
                    buf.set_len(c.len);
                    let mut parts: Vec<(usize, u32, usize)> = Vec::new();
                    plan.fill_with(c.shard, c.offset, &mut buf, data, |i, bytes| {
                        match parts.last_mut() {
                            Some((t, crc, len)) if *t == i => {
                                *crc = crc32c::crc32c_append(*crc, bytes);
                                *len += bytes.len();
                            }
                            _ => parts.push((i, crc32c::crc32c(bytes), bytes.len())),
                        }
                    });
                    *partials[k].lock().unwrap_or_else(|p| p.into_inner()) = parts;
                    if tx.send((k, IoBuf::Owned(buf))).is_err() {
                        break;
                    }
                }
            });
        }
        // The stream ends when every filler has finished and the channel is empty.
        drop(tx);
        let order = &order;
        opts.engine.run_stream(
            opts.in_flight,
            move || {
                let (k, buf) = rx.recv().ok()?;
                let c = &plan.chunks[k];
                order.lock().unwrap_or_else(|p| p.into_inner()).push(k);
                Some(IoOp {
                    kind: IoKind::Write,
                    file: &files[c.shard],
                    offset: c.offset,
                    buf,
                })
            },
            |i, done| {
                if let Err(e) = done.result {
                    let k = order.lock().unwrap_or_else(|p| p.into_inner())[i];
                    fail((plan.chunks[k].shard, e));
                }
                if let Some(b) = done.buf.into_owned() {
                    pool.put(b);
                }
            },
        );
    });
    if let Some(f) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(f);
    }
    // Every chunk was filled; join each tensor's pieces in file order.
    let mut crcs = vec![0u32; plan.placed.len()];
    let mut begun = vec![false; plan.placed.len()];
    for part in partials {
        for (i, crc, len) in part.into_inner().unwrap_or_else(|p| p.into_inner()) {
            crcs[i] = if begun[i] {
                crc32c::crc32c_combine(crcs[i], crc, len)
            } else {
                crc
            };
            begun[i] = true;
        }
    }
    Ok((crcs, borrowed.into_inner()))
}

/// The caller's bytes for chunk `c`, when one tensor fills it and (with
/// `O_DIRECT`) they start at an address the device can read from: input
/// index and slice.
fn borrowable<'a>(
    plan: &Plan,
    c: &Chunk,
    data: &[&'a [u8]],
    direct: bool,
) -> Option<(usize, &'a [u8])> {
    let i = c.tensor?;
    let (start, _) = plan.file_range(i);
    let from = usize::try_from(c.offset.checked_sub(start)?).ok()?;
    let src = data.get(i)?.get(from..from.checked_add(c.len)?)?;
    (!direct || (src.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN)).then_some((i, src))
}

/// Chunk buffers shared by the fillers and the write stream: at most `cap`
/// are ever allocated; a filler waits for a completed write to hand one
/// back when all are in use.
struct BufPool {
    state: Mutex<(Vec<AlignedBuf>, usize)>,
    returned: Condvar,
    cap: usize,
}

impl BufPool {
    fn new(cap: usize) -> Self {
        Self {
            state: Mutex::new((Vec::new(), 0)),
            returned: Condvar::new(),
            cap,
        }
    }

    /// A free buffer, a new one from `alloc` while fewer than `cap` exist,
    /// or the next one handed back.
    fn take<E>(&self, alloc: impl FnOnce() -> Result<AlignedBuf, E>) -> Result<AlignedBuf, E> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(b) = st.0.pop() {
                return Ok(b);
            }
            if st.1 < self.cap {
                st.1 += 1;
                drop(st);
                return alloc();
            }
            st = self.returned.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn put(&self, buf: AlignedBuf) {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .push(buf);
        self.returned.notify_one();
    }
}

/// Asynchronous save: the snapshot already holds every chunk, so one batch
/// keeps `in_flight` writes outstanding with no copying.
fn write_snapshot(
    files: &[File],
    plan: &Plan,
    bufs: &[Arc<AlignedBuf>],
    opts: &SaveOptions,
) -> Result<(), WriteFailure> {
    let ops = plan
        .chunks
        .iter()
        .zip(bufs)
        .map(|(c, b)| IoOp::write_shared(&files[c.shard], c.offset, b.clone()))
        .collect();
    for (done, c) in opts
        .engine
        .run_batch(ops, opts.in_flight)
        .into_iter()
        .zip(&plan.chunks)
    {
        if let Err(e) = done.result {
            return Err((c.shard, e));
        }
    }
    Ok(())
}
