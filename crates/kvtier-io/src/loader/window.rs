//! Reading straight into sub-ranges of one shard buffer.
//!
//! The engine reads into owned [`AlignedBuf`]s. To land chunk reads in place
//! inside the single per-shard allocation (no bounce buffer, no copy), each
//! chunk gets an `AlignedBuf` whose memory is a window of the shard buffer,
//! handed out by a [`HostAllocator`] that owns nothing: `deallocate` is a
//! no-op, the shard buffer frees the memory.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::buffer::{AlignedBuf, AllocError, DIRECT_IO_ALIGN, HostAllocator};

/// A one-shot allocator that returns one fixed, pre-zeroed memory range.
#[derive(Debug)]
struct Window {
    addr: usize,
    len: usize,
    taken: AtomicBool,
}

// SAFETY: `allocate_zeroed` hands out the window once, only for a layout
// that fits it and whose alignment its address meets; `Window::carve`'s
// caller guarantees the range is valid, zeroed, unaliased and outlives every
// buffer made from it. `deallocate` frees nothing.
unsafe impl HostAllocator for Window {
    fn allocate_zeroed(&self, layout: Layout) -> Option<NonNull<u8>> {
        if layout.size() > self.len || !self.addr.is_multiple_of(layout.align()) {
            return None;
        }
        if self.taken.swap(true, Ordering::AcqRel) {
            return None;
        }
        NonNull::new(self.addr as *mut u8)
    }

    unsafe fn deallocate(&self, _ptr: NonNull<u8>, _layout: Layout) {}

    fn name(&self) -> &'static str {
        "shard-window"
    }
}

/// An [`AlignedBuf`] of `len` bytes whose memory is `base[off..off + len]`.
///
/// # Safety
///
/// `base[off..off + len]` must lie inside one live allocation that is
/// zero-filled (or whose contents the caller is about to overwrite and never
/// reads meanwhile), aligned to [`DIRECT_IO_ALIGN`] at `off`, and not
/// accessed through any other path, nor freed, until the returned buffer
/// has been dropped (or leaked for good). Windows carved from one
/// allocation must not overlap.
pub(crate) unsafe fn carve(
    base: *mut u8,
    off: usize,
    len: usize,
) -> Result<AlignedBuf, AllocError> {
    let window: Arc<dyn HostAllocator> = Arc::new(Window {
        addr: base as usize + off,
        len,
        taken: AtomicBool::new(false),
    });
    AlignedBuf::zeroed_in(&window, len, DIRECT_IO_ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_alias_the_big_buffer_and_free_nothing() {
        let mut big = AlignedBuf::zeroed(3 * 4096, DIRECT_IO_ALIGN).unwrap();
        let base = big.as_mut_ptr();
        {
            // SAFETY: disjoint windows of a live, zeroed buffer not touched
            // until both are dropped.
            let mut a = unsafe { carve(base, 0, 4096) }.unwrap();
            let mut b = unsafe { carve(base, 4096, 8192) }.unwrap();
            assert_eq!(b.as_ptr() as usize, base as usize + 4096);
            a.fill(1);
            b.fill(2);
        }
        assert!(big[..4096].iter().all(|&x| x == 1));
        assert!(big[4096..].iter().all(|&x| x == 2));
    }

    #[test]
    fn a_window_is_handed_out_once_and_only_if_it_fits() {
        let w = Window {
            addr: 4096,
            len: 4096,
            taken: AtomicBool::new(false),
        };
        let too_big = Layout::from_size_align(8192, 4096).unwrap();
        assert!(w.allocate_zeroed(too_big).is_none());
        let misaligned = Layout::from_size_align(16, 8192).unwrap();
        assert!(w.allocate_zeroed(misaligned).is_none());
        let ok = Layout::from_size_align(4096, 4096).unwrap();
        assert!(w.allocate_zeroed(ok).is_some());
        assert!(w.allocate_zeroed(ok).is_none());
    }
}
