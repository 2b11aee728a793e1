//! Asynchronous saves: snapshot into host buffers, return, write and commit
//! on a background thread.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use super::checkpoint_error::CheckpointError;
use super::options::{CheckpointInfo, SaveOptions, TensorRef};
use super::shard_layout::{self, Plan};
use super::writer::{self, Prepared, Source};
use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN};

/// A save running in the background. [`SaveHandle::wait`] returns its
/// outcome; dropping the handle without waiting also waits (so a save is
/// never silently cut short by the handle going away), but discards the
/// outcome.
#[derive(Debug)]
pub struct SaveHandle {
    dir: PathBuf,
    done: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<CheckpointInfo, CheckpointError>>>,
}

impl SaveHandle {
    /// True once the background save has finished (committed or failed).
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Blocks until the save has finished and returns its outcome.
    pub fn wait(mut self) -> Result<CheckpointInfo, CheckpointError> {
        self.join()
    }

    fn join(&mut self) -> Result<CheckpointInfo, CheckpointError> {
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| {
                Err(CheckpointError::BackgroundPanic {
                    dir: self.dir.clone(),
                })
            }),
            None => Err(CheckpointError::BackgroundPanic {
                dir: self.dir.clone(),
            }),
        }
    }
}

impl Drop for SaveHandle {
    fn drop(&mut self) {
        if self.thread.is_some()
            && let Err(e) = self.join()
        {
            tracing::error!("background checkpoint save dropped without wait() failed: {e}");
        }
    }
}

/// Snapshots `tensors` into host buffers from `opts.allocator` (laid out as
/// the shard files' aligned write chunks), then writes and commits them on
/// a background thread, exactly as [`save`](super::save) would. The caller
/// may modify or free its tensors as soon as this returns.
///
/// Invalid tensors or options and allocation failures are reported here;
/// I/O errors (including a full disk) come from [`SaveHandle::wait`].
pub fn save_async(
    dir: &Path,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<SaveHandle, CheckpointError> {
    let started = Instant::now();
    let plan = shard_layout::plan(tensors, opts)?;
    let data: Vec<&[u8]> = tensors.iter().map(|t| t.data).collect();
    let bufs = snapshot(&plan, &data, opts)?;
    let meta = writer::meta_of(tensors);
    let snapshot_seconds = started.elapsed().as_secs_f64();

    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    let owned_dir = dir.to_path_buf();
    let opts = opts.clone();
    let thread = std::thread::Builder::new()
        .name("kvtier-ckpt-save".into())
        .spawn(move || {
            let prepared = Prepared {
                plan,
                source: Source::Snapshot(bufs),
                meta,
                started,
                snapshot_seconds,
            };
            let r = writer::commit(&owned_dir, prepared, &opts);
            flag.store(true, Ordering::Release);
            r
        })
        .map_err(|e| CheckpointError::io("spawn save thread for", dir, e))?;
    Ok(SaveHandle {
        dir: dir.to_path_buf(),
        done,
        thread: Some(thread),
    })
}

/// Copies the shard images into one aligned buffer per chunk, on up to
/// `opts.threads` threads.
fn snapshot(
    plan: &Plan,
    data: &[&[u8]],
    opts: &SaveOptions,
) -> Result<Vec<Arc<AlignedBuf>>, CheckpointError> {
    let n = plan.chunks.len();
    let mut bufs = Vec::with_capacity(n);
    for c in &plan.chunks {
        bufs.push(AlignedBuf::zeroed_in(
            &opts.allocator,
            c.len,
            DIRECT_IO_ALIGN,
        )?);
    }
    let workers = opts.threads.clamp(1, n.max(1));
    let next = AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<&mut AlignedBuf>> =
        bufs.iter_mut().map(std::sync::Mutex::new).collect();
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let c = plan.chunks[i];
                    let mut buf = slots[i].lock().unwrap_or_else(|p| p.into_inner());
                    plan.fill(c.shard, c.offset, &mut buf[..], data);
                }
            });
        }
    });
    drop(slots);
    Ok(bufs.into_iter().map(Arc::new).collect())
}
