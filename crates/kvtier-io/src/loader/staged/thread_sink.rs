//! A [`DeviceSink`] whose "device" is host memory and whose copy engine is
//! one thread running copies in queue order, as a GPU stream does.
//!
//! On a machine without a GPU it runs the staging ring end to end: reads
//! land in staging buffers while earlier chunks are still being copied out
//! of others, so the ring's ordering and buffer lifetimes are exercised for
//! real. With a per-copy delay, a buffer reused before its copy finished
//! would put the wrong bytes in the destination, which the tests check.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator, system_allocator};

use super::sink::{CopyFence, DeviceSink};

/// One queued copy: raw addresses, kept valid by the ring's contract.
struct Job {
    src: usize,
    dst: usize,
    len: usize,
}

/// How many copies have finished, and whether the copy thread is gone.
#[derive(Debug, Default)]
struct Progress {
    state: Mutex<(u64, bool)>,
    changed: Condvar,
}

/// Copies into host memory on a copy thread, in queue order.
#[derive(Debug)]
pub struct ThreadCopySink {
    /// Where destination memory comes from.
    memory: Arc<dyn HostAllocator>,
    jobs: Option<Sender<Job>>,
    progress: Arc<Progress>,
    queued: u64,
    worker: Option<JoinHandle<()>>,
}

/// Completion of one [`ThreadCopySink`] copy.
#[derive(Debug)]
pub struct ThreadFence {
    seq: u64,
    progress: Arc<Progress>,
}

impl CopyFence for ThreadFence {
    fn wait(&self) -> Result<(), String> {
        let mut g = self
            .progress
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while g.0 < self.seq {
            if g.1 {
                return Err("the copy thread stopped".into());
            }
            g = self
                .progress
                .changed
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }
}

impl ThreadCopySink {
    /// Starts the copy thread; each copy first sleeps `delay` (zero for
    /// none), to stand for a slow copy engine.
    pub fn new(delay: Duration) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let progress = Arc::new(Progress::default());
        let p = progress.clone();
        let worker = std::thread::Builder::new()
            .name("kvtier-copy".into())
            .spawn(move || {
                for job in rx {
                    if !delay.is_zero() {
                        std::thread::sleep(delay);
                    }
                    // SAFETY: `copy_async`'s caller keeps the source alive
                    // and unmodified until this copy's fence completes, and
                    // `allocate`d memory stays alive (owned by the caller)
                    // while copies into it are queued; ranges were checked.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            job.src as *const u8,
                            job.dst as *mut u8,
                            job.len,
                        );
                    }
                    let mut g = p.state.lock().unwrap_or_else(PoisonError::into_inner);
                    g.0 += 1;
                    p.changed.notify_all();
                }
                let mut g = p.state.lock().unwrap_or_else(PoisonError::into_inner);
                g.1 = true;
                p.changed.notify_all();
            })?;
        Ok(Self {
            memory: system_allocator(),
            jobs: Some(tx),
            progress,
            queued: 0,
            worker: Some(worker),
        })
    }
}

impl ThreadCopySink {
    /// Takes destination memory from `alloc` instead of the system
    /// allocator (e.g. a recycling allocator, for a resident destination).
    pub fn with_memory(mut self, alloc: Arc<dyn HostAllocator>) -> Self {
        self.memory = alloc;
        self
    }
}

impl Drop for ThreadCopySink {
    fn drop(&mut self) {
        // Closing the queue lets the thread finish what is queued and stop.
        self.jobs = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl DeviceSink for ThreadCopySink {
    type Memory = AlignedBuf;
    type Fence = ThreadFence;

    fn describe(&self) -> String {
        "host (copy thread)".into()
    }

    fn staging_allocator(&self) -> Arc<dyn HostAllocator> {
        system_allocator()
    }

    fn allocate(&mut self, len: usize) -> Result<AlignedBuf, String> {
        AlignedBuf::zeroed_in(&self.memory, len, DIRECT_IO_ALIGN).map_err(|e| e.to_string())
    }

    unsafe fn copy_async(
        &mut self,
        src: &[u8],
        dst: &mut AlignedBuf,
        offset: usize,
    ) -> Result<ThreadFence, String> {
        let dst = dst
            .get_mut(offset..offset.saturating_add(src.len()))
            .ok_or_else(|| format!("copy of {} bytes at {offset} is out of range", src.len()))?;
        let job = Job {
            src: src.as_ptr() as usize,
            dst: dst.as_mut_ptr() as usize,
            len: src.len(),
        };
        let tx = self.jobs.as_ref().ok_or("the copy thread is stopped")?;
        tx.send(job).map_err(|_| "the copy thread stopped")?;
        self.queued += 1;
        Ok(ThreadFence {
            seq: self.queued,
            progress: self.progress.clone(),
        })
    }
}
