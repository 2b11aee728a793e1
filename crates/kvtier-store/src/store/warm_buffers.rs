//! Read buffers faulted in ahead of the first restores
//! ([`StoreConfig::warm_read_buffers`](super::StoreConfig::warm_read_buffers)).
//!
//! A G3 or G4 hit is read into a buffer from the store's recycling
//! allocator and then kept by G2, so until G2 is full every restore reads
//! into fresh memory, and the kernel faults it in on the reading thread. On
//! some VMs fresh memory faults in several times slower than the disk
//! reads: the restores' reader threads then spend their CPU on page
//! faults, taken from the cores an engine computes on. Warmed buffers
//! move that cost to a background thread right after the store opens.
//!
//! Each buffer is handed to the allocator's cache as soon as it is faulted
//! in ([`HostAllocator::prefault`]), so reads that come while the thread is
//! still at work take the buffers already warm rather than fresh ones (a
//! thread that held every buffer until the end made those reads fault
//! memory of their own, twice the faults in all). [`Warming`] tells how far
//! it got, and lets a caller wait for the end: an engine that takes
//! requests right after a start (vLLM's worker) waits, so that its first
//! burst of restores does not fault memory in beside the warming thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_io::buffer::buffer_layout;
use kvtier_io::{DIRECT_IO_ALIGN, HostAllocator};
use parking_lot::{Condvar, Mutex};

/// How far the warming thread got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WarmProgress {
    /// Buffers faulted in and kept by the allocator so far.
    pub warmed: usize,
    /// Buffers asked for.
    pub target: usize,
    /// The thread has ended: every buffer is warm, or the allocator could
    /// keep no more (it does not recycle, or memory ran out).
    pub done: bool,
}

/// The warming thread's progress, shared with the store.
#[derive(Debug, Default)]
pub(crate) struct Warming {
    progress: Mutex<WarmProgress>,
    ended: Condvar,
}

impl Warming {
    /// What the thread has done so far.
    pub(crate) fn progress(&self) -> WarmProgress {
        *self.progress.lock()
    }

    /// Waits until the thread has ended, at most `limit` (`None`: no
    /// limit); its progress then.
    pub(crate) fn wait(&self, limit: Option<Duration>) -> WarmProgress {
        let deadline = limit.map(|l| Instant::now() + l);
        let mut p = self.progress.lock();
        while !p.done {
            match deadline {
                Some(d) => {
                    if self.ended.wait_until(&mut p, d).timed_out() {
                        break;
                    }
                }
                None => self.ended.wait(&mut p),
            }
        }
        *p
    }

    fn end(&self) {
        self.progress.lock().done = true;
        self.ended.notify_all();
    }
}

/// Starts a thread that faults in `count` read buffers of `slot_bytes`
/// (the allocation a read of that many bytes takes) through
/// `alloc.prefault`, each kept by the allocator as soon as it is warm.
/// Holds no reference to the store, so closing the store never waits on it.
pub(super) fn warm_in_background(
    alloc: Arc<dyn HostAllocator>,
    slot_bytes: usize,
    count: usize,
) -> Arc<Warming> {
    let warming = Arc::new(Warming {
        progress: Mutex::new(WarmProgress {
            target: count,
            ..WarmProgress::default()
        }),
        ended: Condvar::new(),
    });
    let w = warming.clone();
    let spawned = std::thread::Builder::new()
        .name("kvtier-warm".into())
        .spawn(move || {
            if let Some(layout) = buffer_layout(slot_bytes, DIRECT_IO_ALIGN) {
                for _ in 0..count {
                    if !alloc.prefault(layout) {
                        break;
                    }
                    w.progress.lock().warmed += 1;
                }
            }
            w.end();
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the read-buffer warming thread: {e}");
        warming.end();
    }
    warming
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use kvtier_io::AlignedBuf;
    use kvtier_io::recycle::RecyclingAllocator;

    use super::*;

    #[test]
    fn warms_distinct_buffers_that_reads_then_take_without_fresh_memory() {
        let slot = 3 * 4096 + 100;
        let alloc: Arc<dyn HostAllocator> = Arc::new(RecyclingAllocator::new(2));
        let warming = warm_in_background(alloc.clone(), slot, 5);
        let done = warming.wait(Some(Duration::from_secs(30)));
        assert_eq!(
            done,
            WarmProgress {
                warmed: 5,
                target: 5,
                done: true
            }
        );
        let fresh = alloc.fresh_allocations();
        assert_eq!(fresh, Some(5), "five buffers faulted in, no more");
        // Five reads' buffers: five distinct warm ones, none fresh.
        let bufs: Vec<AlignedBuf> = (0..5)
            .map(|_| AlignedBuf::for_overwrite_in(&alloc, slot, DIRECT_IO_ALIGN).unwrap())
            .collect();
        let addrs: HashSet<usize> = bufs.iter().map(|b| b.as_ptr() as usize).collect();
        assert_eq!(addrs.len(), 5, "distinct buffers");
        assert_eq!(alloc.fresh_allocations(), fresh, "a read took fresh memory");
        // A sixth is fresh: the count is exact.
        let _sixth = AlignedBuf::for_overwrite_in(&alloc, slot, DIRECT_IO_ALIGN).unwrap();
        assert_eq!(alloc.fresh_allocations(), Some(6));
    }

    #[test]
    fn an_allocator_that_keeps_nothing_ends_the_warming_at_once() {
        let alloc = kvtier_io::system_allocator();
        let warming = warm_in_background(alloc, 4096, 1000);
        let done = warming.wait(Some(Duration::from_secs(30)));
        assert!(done.done);
        assert_eq!(done.warmed, 0);
        assert_eq!(done.target, 1000);
    }
}
