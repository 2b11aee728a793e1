//! Read buffers faulted in ahead of the first restores
//! ([`StoreConfig::warm_read_buffers`](super::StoreConfig::warm_read_buffers)).
//!
//! A G3 or G4 hit is read into a buffer from the store's recycling
//! allocator and then kept by G2, so until G2 is full every restore reads
//! into fresh memory, and the kernel faults it in on the reading thread. On the
//! reference VM fresh memory faults in at 1.4-1.8 GB/s: a 4,096-token
//! prefix of the `small` preset (64 MiB) cost its reader threads about
//! 46 ms of CPU, taken from the cores the decode step was using, and the
//! decoders' steps ran 40-72 ms instead of 28 ms while it lasted
//! (`kvtier-engine/examples/decode_beside_restore.rs`). Warmed buffers
//! move that cost to a background thread right after the store opens.

use std::sync::Arc;

use kvtier_io::{AlignedBuf, DIRECT_IO_ALIGN, HostAllocator};

/// Starts a thread that allocates `count` read buffers of `slot_bytes`
/// from `alloc`, writes every page of each, and then frees them all into
/// `alloc`'s cache, where reads of that size take them. Holds no reference
/// to the store, so closing the store never waits on it.
pub(super) fn warm_in_background(alloc: Arc<dyn HostAllocator>, slot_bytes: usize, count: usize) {
    let spawned = std::thread::Builder::new()
        .name("kvtier-warm".into())
        .spawn(move || {
            let mut held = Vec::with_capacity(count);
            for _ in 0..count {
                let Ok(mut buf) = AlignedBuf::for_overwrite_in(&alloc, slot_bytes, DIRECT_IO_ALIGN)
                else {
                    break;
                };
                buf.fill(0);
                held.push(buf);
            }
            // Dropped together, so each is a distinct buffer in the cache.
            drop(held);
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the read-buffer warming thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use std::alloc::Layout;
    use std::ptr::NonNull;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use kvtier_io::buffer::SystemAllocator;

    use super::*;

    /// The system allocator, counting what it hands out and takes back,
    /// and checking that each buffer comes back written as zeros.
    #[derive(Debug, Default)]
    struct Counting {
        allocated: AtomicUsize,
        freed_zeroed: AtomicUsize,
    }

    // SAFETY: delegates to the system allocator.
    unsafe impl HostAllocator for Counting {
        fn allocate_zeroed(&self, layout: Layout) -> Option<NonNull<u8>> {
            self.allocated.fetch_add(1, Ordering::SeqCst);
            let p = SystemAllocator.allocate_zeroed(layout)?;
            // Mark it, so a buffer the warmer did not write is caught.
            // SAFETY: a fresh allocation of `layout.size() >= 1` bytes.
            unsafe { p.as_ptr().write(0xAB) };
            Some(p)
        }

        unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
            // SAFETY: the buffer is valid for `layout.size()` bytes until freed.
            let bytes = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), layout.size()) };
            if bytes.iter().all(|&b| b == 0) {
                self.freed_zeroed.fetch_add(1, Ordering::SeqCst);
            }
            // SAFETY: allocated above with this layout.
            unsafe { SystemAllocator.deallocate(ptr, layout) }
        }

        fn name(&self) -> &'static str {
            "counting"
        }
    }

    #[test]
    fn warms_distinct_buffers_writes_every_byte_and_hands_them_back() {
        let counting = Arc::new(Counting::default());
        let alloc: Arc<dyn HostAllocator> = counting.clone();
        warm_in_background(alloc, 3 * 4096 + 100, 5);
        let deadline = Instant::now() + Duration::from_secs(30);
        while counting.freed_zeroed.load(Ordering::SeqCst) < 5 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            counting.allocated.load(Ordering::SeqCst),
            5,
            "five distinct buffers"
        );
        assert_eq!(
            counting.freed_zeroed.load(Ordering::SeqCst),
            5,
            "each written in full, then handed back"
        );
    }
}
