//! A [`HostAllocator`] that keeps freed buffers and hands them out again.
//!
//! The store reads, encodes and evicts thousands of equal-size blocks.
//! Fresh memory must be faulted in by the kernel, which on some VMs runs
//! slower than the disk (the host reclaims freed RAM within seconds), so
//! allocating every block anew makes restores wait on page faults, not the
//! disk. Recycling
//! buffers of the same layout costs one `memset` per reuse instead, and
//! nothing for a buffer asked for with
//! [`AlignedBuf::for_overwrite_in`](crate::AlignedBuf::for_overwrite_in)
//! (a read target, a block filled in place). The
//! tiered store uses it by default; benchmarks use it for their pools.
//!
//! Benchmarks of a warm destination go one step further: buffers can be
//! [reserved](RecyclingAllocator::reserve) (allocated and touched up front)
//! and [re-zeroed](RecyclingAllocator::rezero) between timed runs, so a
//! timed allocation hands out resident, already-zeroed memory with no
//! `memset` at all, as a reused pinned ring would.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::buffer::{HostAllocator, SystemAllocator};

/// A cached allocation: its layout, its address, and whether it is known to
/// be all zeros (then it is handed out without a `memset`).
#[derive(Debug, Clone, Copy)]
struct Cached {
    layout: Layout,
    addr: usize,
    zeroed: bool,
}

/// Recycles up to `max_cached` freed buffers; everything else goes to the
/// system allocator.
#[derive(Debug)]
pub struct RecyclingAllocator {
    cache: Mutex<Cache>,
    /// Allocations the cache could not serve (fresh memory from the system
    /// allocator, faulted in on first use), prefaulted ones included.
    fresh: AtomicU64,
}

/// Freed (or prefaulted) allocations, and how many may be kept.
#[derive(Debug)]
struct Cache {
    free: Vec<Cached>,
    max_cached: usize,
}

impl RecyclingAllocator {
    /// An allocator that keeps at most `max_cached` freed buffers.
    pub fn new(max_cached: usize) -> Self {
        Self {
            cache: Mutex::new(Cache {
                free: Vec::new(),
                max_cached,
            }),
            fresh: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocates `count` buffers of `layout` from the system allocator,
    /// touches every page (writing zeros), and caches them, zeroed, for
    /// later allocations (raising the cache limit if needed). Returns false
    /// when memory ran out (what was reserved stays cached).
    pub fn reserve(&mut self, layout: Layout, count: usize) -> bool {
        (0..count).all(|_| self.prefault_one(layout))
    }

    /// One buffer of [`reserve`](Self::reserve), through a shared
    /// reference: cached (and so handed out) as soon as it is faulted in.
    fn prefault_one(&self, layout: Layout) -> bool {
        let Some(ptr) = SystemAllocator.allocate_zeroed(layout) else {
            return false;
        };
        self.fresh.fetch_add(1, Ordering::Relaxed);
        touch_pages(ptr, layout.size());
        let mut cache = self.lock();
        cache.free.push(Cached {
            layout,
            addr: ptr.as_ptr() as usize,
            zeroed: true,
        });
        cache.max_cached = cache.max_cached.max(cache.free.len());
        true
    }

    /// Zeroes every cached buffer that is not known to be zero, so that the
    /// next allocations need no `memset` (call it outside timed regions).
    pub fn rezero(&self) {
        for c in self.lock().free.iter_mut().filter(|c| !c.zeroed) {
            // SAFETY: cached allocations are valid for `layout.size()` bytes
            // and referenced by nobody.
            unsafe { std::ptr::write_bytes(c.addr as *mut u8, 0, c.layout.size()) };
            c.zeroed = true;
        }
    }

    /// Bytes held in the cache.
    #[cfg(test)]
    pub fn cached_bytes(&self) -> usize {
        self.lock().free.iter().map(|c| c.layout.size()).sum()
    }
}

/// Writes a zero (volatile: not optimised away, even into memory the
/// compiler knows is zero) to the first byte of every 4 KiB page of
/// `ptr[..len]`, faulting every page in.
fn touch_pages(ptr: NonNull<u8>, len: usize) {
    for off in (0..len).step_by(4096) {
        // SAFETY: `off < len` and `ptr` is valid for writes of `len` bytes
        // (a fresh allocation of that size, exclusively ours); it is zero
        // already, so writing zero keeps it zeroed.
        unsafe { std::ptr::write_volatile(ptr.as_ptr().add(off), 0) };
    }
}

impl RecyclingAllocator {
    /// A recycled buffer of `layout` (zero-filled when `zero` asks for it
    /// and it is not known to be zero), else a fresh one from the system
    /// allocator.
    fn allocate(&self, layout: Layout, zero: bool) -> Option<NonNull<u8>> {
        let reused = {
            let mut cache = self.lock();
            let free = &mut cache.free;
            // Prefer a buffer that is already zero.
            let pos = free
                .iter()
                .position(|c| c.layout == layout && c.zeroed)
                .or_else(|| free.iter().position(|c| c.layout == layout));
            pos.map(|i| free.swap_remove(i))
        };
        match reused.and_then(|c| NonNull::new(c.addr as *mut u8).map(|p| (p, c.zeroed))) {
            Some((ptr, zeroed)) => {
                if zero && !zeroed {
                    // SAFETY: the allocation is valid for `layout.size()`
                    // bytes and exclusively ours.
                    unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, layout.size()) };
                }
                Some(ptr)
            }
            None => {
                self.fresh.fetch_add(1, Ordering::Relaxed);
                SystemAllocator.allocate_zeroed(layout)
            }
        }
    }
}

// SAFETY: recycled memory came from the system allocator with the same
// layout and is no longer referenced by its previous owner (it was handed to
// `deallocate`). It is initialised (it was zeroed when first allocated and
// only ever written since) and, for `allocate_zeroed`, zeroed before it is
// handed out again (now, or by `reserve` / `rezero`, which set `zeroed` only
// after writing zeros).
unsafe impl HostAllocator for RecyclingAllocator {
    fn allocate_zeroed(&self, layout: Layout) -> Option<NonNull<u8>> {
        self.allocate(layout, true)
    }

    fn allocate_for_overwrite(&self, layout: Layout) -> Option<NonNull<u8>> {
        self.allocate(layout, false)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() != 0 {
            let mut cache = self.lock();
            let max_cached = cache.max_cached;
            let free = &mut cache.free;
            // A full cache makes room by dropping a buffer of another
            // layout: buffers of a layout no longer asked for (the 4 KiB
            // header reads of an index rebuild) must not fill it for good
            // and turn every block buffer away.
            let stale = if free.len() < max_cached {
                None
            } else {
                free.iter().position(|c| c.layout != layout)
            };
            if free.len() < max_cached || stale.is_some() {
                let evicted = stale.map(|i| free.swap_remove(i));
                free.push(Cached {
                    layout,
                    addr: ptr.as_ptr() as usize,
                    zeroed: false,
                });
                drop(cache);
                if let Some(c) = evicted
                    && let Some(old) = NonNull::new(c.addr as *mut u8)
                {
                    // SAFETY: cached allocations came from the system
                    // allocator with `c.layout` and are referenced by nobody.
                    unsafe { SystemAllocator.deallocate(old, c.layout) }
                }
                return;
            }
        }
        // SAFETY: forwarded from our caller; the memory came from the
        // system allocator with this layout.
        unsafe { SystemAllocator.deallocate(ptr, layout) }
    }

    fn name(&self) -> &'static str {
        "recycling"
    }

    fn prefault(&self, layout: Layout) -> bool {
        self.prefault_one(layout)
    }

    fn fresh_allocations(&self) -> Option<u64> {
        Some(self.fresh.load(Ordering::Relaxed))
    }
}

impl Drop for RecyclingAllocator {
    fn drop(&mut self) {
        for c in self.lock().free.drain(..) {
            if let Some(ptr) = NonNull::new(c.addr as *mut u8) {
                // SAFETY: cached allocations came from the system allocator
                // with `c.layout` and are referenced by nobody.
                unsafe { SystemAllocator.deallocate(ptr, c.layout) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::buffer::AlignedBuf;

    use super::*;

    #[test]
    fn buffers_of_an_old_layout_do_not_keep_new_ones_out_of_a_full_cache() {
        let alloc = Arc::new(RecyclingAllocator::new(2));
        let dyn_alloc: Arc<dyn HostAllocator> = alloc.clone();
        // Two small buffers (an index rebuild's header reads) fill the cache.
        let small: Vec<_> = (0..2)
            .map(|_| AlignedBuf::for_overwrite_in(&dyn_alloc, 4096, 4096).unwrap())
            .collect();
        drop(small);
        assert_eq!(alloc.cached_bytes(), 2 * 4096);
        // Block buffers freed now replace them, and are handed out again.
        let block = AlignedBuf::for_overwrite_in(&dyn_alloc, 16384, 4096).unwrap();
        let addr = block.as_ptr() as usize;
        drop(block);
        assert_eq!(alloc.cached_bytes(), 4096 + 16384);
        let again = AlignedBuf::for_overwrite_in(&dyn_alloc, 16384, 4096).unwrap();
        assert_eq!(again.as_ptr() as usize, addr, "recycled, not fresh");
        let (a, b) = (
            AlignedBuf::for_overwrite_in(&dyn_alloc, 16384, 4096).unwrap(),
            AlignedBuf::for_overwrite_in(&dyn_alloc, 16384, 4096).unwrap(),
        );
        drop((again, a, b));
        assert_eq!(alloc.cached_bytes(), 2 * 16384, "the small one made room");
    }

    #[test]
    fn reuses_zeroed_buffers_of_the_same_layout() {
        let alloc: Arc<dyn HostAllocator> = Arc::new(RecyclingAllocator::new(2));
        let mut a = AlignedBuf::zeroed_in(&alloc, 8192, 4096).unwrap();
        a.fill(7);
        let addr = a.as_ptr() as usize;
        drop(a);
        let b = AlignedBuf::zeroed_in(&alloc, 8192, 4096).unwrap();
        assert_eq!(b.as_ptr() as usize, addr, "recycled");
        assert!(b.iter().all(|&x| x == 0), "zeroed on reuse");
        let c = AlignedBuf::zeroed_in(&alloc, 4096, 4096).unwrap();
        assert_ne!(c.as_ptr() as usize, addr);
        assert!((c.as_ptr() as usize).is_multiple_of(4096));
        let many: Vec<_> = (0..5)
            .map(|_| AlignedBuf::zeroed_in(&alloc, 8192, 4096).unwrap())
            .collect();
        drop(many); // three go back to the system allocator
        drop((b, c));
    }

    #[test]
    fn buffers_for_overwrite_skip_the_zero_fill_and_zeroed_ones_do_not() {
        let alloc: Arc<dyn HostAllocator> = Arc::new(RecyclingAllocator::new(2));
        let mut a = AlignedBuf::zeroed_in(&alloc, 8192, 4096).unwrap();
        a.fill(7);
        let addr = a.as_ptr() as usize;
        drop(a);
        let b = AlignedBuf::for_overwrite_in(&alloc, 8192, 4096).unwrap();
        assert_eq!(b.as_ptr() as usize, addr, "recycled");
        assert!(b.iter().all(|&x| x == 7), "old bytes kept: no memset");
        drop(b);
        let c = AlignedBuf::zeroed_in(&alloc, 8192, 4096).unwrap();
        assert_eq!(c.as_ptr() as usize, addr, "recycled");
        assert!(c.iter().all(|&x| x == 0), "zeroed when zeros are asked for");
        // Nothing to recycle: fresh memory is zero either way.
        let d = AlignedBuf::for_overwrite_in(&alloc, 3 * 4096, 4096).unwrap();
        assert!(d.iter().all(|&x| x == 0));
    }

    #[test]
    fn reserved_buffers_are_handed_out_zeroed_and_rezeroed() {
        let layout = Layout::from_size_align(3 * 4096, 4096).unwrap();
        let mut pool = RecyclingAllocator::new(0);
        assert!(pool.reserve(layout, 2));
        assert_eq!(pool.cached_bytes(), 2 * 3 * 4096);
        let alloc: Arc<dyn HostAllocator> = Arc::new(pool);
        let mut a = AlignedBuf::zeroed_in(&alloc, 3 * 4096, 4096).unwrap();
        assert!(a.iter().all(|&x| x == 0));
        a.fill(9);
        let addr = a.as_ptr() as usize;
        drop(a);
        // Dirty now; allocation zeroes it (the other reserved one is taken
        // first, as it is already zero).
        let b = AlignedBuf::zeroed_in(&alloc, 3 * 4096, 4096).unwrap();
        assert_ne!(b.as_ptr() as usize, addr);
        let c = AlignedBuf::zeroed_in(&alloc, 3 * 4096, 4096).unwrap();
        assert_eq!(c.as_ptr() as usize, addr);
        assert!(c.iter().all(|&x| x == 0));
        drop((b, c));
    }
}
