//! Owned, aligned byte buffers: the unit every I/O in kvtier reads into or
//! writes from.
//!
//! Direct I/O needs the memory address, the file offset and the length all
//! aligned to the device's logical block size. [`AlignedBuf`] guarantees the
//! address; callers keep offsets and lengths aligned (see [`align_up`]).
//!
//! Allocation goes through one hook, [`HostAllocator`], so that pinned
//! (page-locked) host memory can replace the system allocator once a CUDA
//! device is present, without touching any caller.

use std::alloc::Layout;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

/// Alignment used for every direct-I/O buffer, offset and length: 4 KiB covers
/// 512-byte and 4 KiB logical-sector devices alike.
pub const DIRECT_IO_ALIGN: usize = 4096;

/// Rounds `n` up to the next multiple of `align` (a power of two).
pub const fn align_up(n: usize, align: usize) -> usize {
    (n + align - 1) & !(align - 1)
}

/// Where host buffers come from.
///
/// # Safety
///
/// `allocate_zeroed` must return memory valid for reads and writes of
/// `layout.size()` bytes, aligned to `layout.align()`, zero-filled, and not
/// aliased, until it is handed back to `deallocate` with the same layout.
/// `allocate_for_overwrite` must do the same except that the bytes may hold
/// any initialised values (never uninitialised memory).
pub unsafe trait HostAllocator: Send + Sync + fmt::Debug {
    /// Allocates zero-filled memory for `layout`; `None` when out of memory.
    fn allocate_zeroed(&self, layout: Layout) -> Option<NonNull<u8>>;
    /// Allocates memory for `layout` whose bytes are initialised but
    /// unspecified (a recycled buffer's old contents, or zeros), for a caller
    /// that overwrites what it uses (a read, a block being filled); `None`
    /// when out of memory. The default zero-fills.
    fn allocate_for_overwrite(&self, layout: Layout) -> Option<NonNull<u8>> {
        self.allocate_zeroed(layout)
    }
    /// Frees memory returned by either allocation call for the same layout.
    ///
    /// # Safety
    ///
    /// `ptr` must come from `allocate_zeroed(layout)` or
    /// `allocate_for_overwrite(layout)` on this allocator and must not be
    /// used afterwards.
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout);
    /// A short name for logs and metrics ("system", "cuda-pinned").
    fn name(&self) -> &'static str;
    /// Allocates one buffer of `layout`, faults every page of it in, and
    /// keeps it for a later allocation of that layout, which then finds
    /// resident memory (fresh memory faults in far slower than the disk
    /// reads on some VMs). True if it was kept; the default keeps nothing
    /// (an allocator that does not recycle has nowhere to keep it).
    fn prefault(&self, layout: Layout) -> bool {
        let _ = layout;
        false
    }
    /// Allocations served with fresh memory from the system so far
    /// (prefaulted ones included), for an allocator that counts them.
    fn fresh_allocations(&self) -> Option<u64> {
        None
    }
}

/// The process's global allocator.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemAllocator;

// SAFETY: delegates to the global allocator, which upholds the contract.
unsafe impl HostAllocator for SystemAllocator {
    fn allocate_zeroed(&self, layout: Layout) -> Option<NonNull<u8>> {
        if layout.size() == 0 {
            // A dangling but aligned pointer is valid for zero-sized access.
            return NonNull::new(layout.align() as *mut u8);
        }
        if is_mapped(layout) {
            return map_zeroed(layout.size());
        }
        // SAFETY: the layout has a non-zero size.
        NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if is_mapped(layout) {
            // SAFETY: `allocate_zeroed` mapped exactly this many bytes here
            // for the same layout, and the caller no longer uses them.
            unsafe { libc::munmap(ptr.as_ptr().cast(), layout.size()) };
            return;
        }
        if layout.size() != 0 {
            // SAFETY: the caller passes a pointer from `alloc_zeroed(layout)`.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) }
        }
    }

    fn name(&self) -> &'static str {
        "system"
    }
}

/// [`SystemAllocator`] serves allocations of at least this many bytes (and
/// at most 4 KiB alignment) as fresh anonymous mappings.
///
/// Why: the global allocator's `alloc_zeroed` with an alignment above 16
/// bytes allocates and then zero-fills, touching every page on the calling
/// thread before the caller writes a byte. For a multi-GiB load destination
/// that is a full first-touch pass (slow on a VM, see the loader's
/// `prefault`) done serially before the first read. A fresh mapping is zero
/// by construction and faulted in where it is first written, which the
/// loader overlaps with its reads. Smaller buffers stay on the heap, where
/// freed memory is reused without new page faults.
pub const MAP_THRESHOLD: usize = 64 << 20;

fn is_mapped(layout: Layout) -> bool {
    layout.size() >= MAP_THRESHOLD && layout.align() <= DIRECT_IO_ALIGN
}

fn map_zeroed(len: usize) -> Option<NonNull<u8>> {
    // SAFETY: a new private anonymous mapping: no file, no fixed address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(p.cast::<u8>())
}

/// The allocator used when a caller names none.
pub fn system_allocator() -> Arc<dyn HostAllocator> {
    static SYSTEM: OnceLock<Arc<dyn HostAllocator>> = OnceLock::new();
    SYSTEM.get_or_init(|| Arc::new(SystemAllocator)).clone()
}

/// Allocation failed: the size overflowed or memory ran out.
#[derive(Debug, thiserror::Error)]
#[error("cannot allocate {bytes} bytes aligned to {align} with the {allocator} allocator")]
pub struct AllocError {
    /// Requested bytes.
    pub bytes: usize,
    /// Requested alignment.
    pub align: usize,
    /// Allocator name.
    pub allocator: &'static str,
}

impl From<AllocError> for std::io::Error {
    fn from(e: AllocError) -> Self {
        std::io::Error::new(std::io::ErrorKind::OutOfMemory, e.to_string())
    }
}

/// The allocation an [`AlignedBuf`] of `len` bytes aligned to `align` (a
/// power of two) takes: `len` rounded up to `align`. `None` for an
/// alignment that is not a power of two, or a size too large.
pub fn buffer_layout(len: usize, align: usize) -> Option<Layout> {
    if !align.is_power_of_two() {
        return None;
    }
    let cap = len.checked_add(align - 1)? & !(align - 1);
    Layout::from_size_align(cap, align).ok()
}

/// An owned, initialised, aligned byte buffer with a length that can shrink
/// and grow within its capacity (zero-filled unless made with
/// [`AlignedBuf::for_overwrite_in`]).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
    alloc: Arc<dyn HostAllocator>,
}

// SAFETY: the buffer exclusively owns its memory, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (capacity rounded up to `align`) from
    /// the system allocator.
    pub fn zeroed(len: usize, align: usize) -> Result<Self, AllocError> {
        Self::zeroed_in(&system_allocator(), len, align)
    }

    /// A zeroed buffer of `len` bytes from `alloc`; capacity is `len` rounded
    /// up to `align`, so the whole capacity can be used for direct I/O.
    pub fn zeroed_in(
        alloc: &Arc<dyn HostAllocator>,
        len: usize,
        align: usize,
    ) -> Result<Self, AllocError> {
        Self::alloc_in(alloc, len, align, true)
    }

    /// A buffer of `len` bytes from `alloc` whose contents are unspecified
    /// (initialised, but possibly a recycled buffer's old bytes), for a
    /// caller that overwrites what it reads: a read into it, a block filled
    /// in place. Saves the zero fill [`zeroed_in`](Self::zeroed_in) pays for
    /// recycled memory.
    pub fn for_overwrite_in(
        alloc: &Arc<dyn HostAllocator>,
        len: usize,
        align: usize,
    ) -> Result<Self, AllocError> {
        Self::alloc_in(alloc, len, align, false)
    }

    fn alloc_in(
        alloc: &Arc<dyn HostAllocator>,
        len: usize,
        align: usize,
        zeroed: bool,
    ) -> Result<Self, AllocError> {
        let err = || AllocError {
            bytes: len,
            align,
            allocator: alloc.name(),
        };
        let layout = buffer_layout(len, align).ok_or_else(err)?;
        let ptr = if zeroed {
            alloc.allocate_zeroed(layout)
        } else {
            alloc.allocate_for_overwrite(layout)
        }
        .ok_or_else(err)?;
        Ok(Self {
            ptr,
            len,
            layout,
            alloc: alloc.clone(),
        })
    }

    /// An empty buffer that owns no memory (never fails).
    pub fn empty() -> Self {
        // Zero-sized layout: `deallocate` frees nothing for it.
        let layout = Layout::new::<()>();
        Self {
            ptr: NonNull::dangling(),
            len: 0,
            layout,
            alloc: system_allocator(),
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8], align: usize) -> Result<Self, AllocError> {
        let mut buf = Self::zeroed(data.len(), align)?;
        buf.copy_from_slice(data);
        Ok(buf)
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no bytes are in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated (a multiple of the alignment).
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }

    /// Alignment of the start address.
    pub fn align(&self) -> usize {
        self.layout.align()
    }

    /// Sets the length in use, clamped to the capacity. Bytes past the old
    /// length keep whatever they held (zero, or earlier contents).
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.capacity());
    }

    /// The whole capacity as a mutable slice (for reads that fill it).
    pub fn spare_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is valid and initialised for `capacity` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity()) }
    }

    /// Raw pointer to the first byte, for I/O submission.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Mutable raw pointer to the first byte, for I/O submission.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The allocator this buffer came from.
    pub fn allocator(&self) -> &Arc<dyn HostAllocator> {
        &self.alloc
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= capacity` and the memory is initialised.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len <= capacity`, the memory is initialised and owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr and layout came from this allocator.
        unsafe { self.alloc.deallocate(self.ptr, self.layout) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("align", &self.align())
            .field("allocator", &self.alloc.name())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_fresh_zeroed_mappings() {
        let len = MAP_THRESHOLD + 5000;
        let mut buf = AlignedBuf::zeroed(len, DIRECT_IO_ALIGN).unwrap();
        assert!(is_mapped(buf.layout));
        assert_eq!(buf.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
        assert!(buf.iter().step_by(4096).all(|&b| b == 0));
        assert_eq!(buf[len - 1], 0);
        buf.fill(9);
        assert!(buf.iter().step_by(4096).all(|&b| b == 9));
        drop(buf);
        // Larger alignments stay with the global allocator.
        let wide = AlignedBuf::zeroed(MAP_THRESHOLD, 1 << 16).unwrap();
        assert!(!is_mapped(wide.layout));
        assert_eq!(wide.as_ptr() as usize % (1 << 16), 0);
    }

    #[test]
    fn aligned_and_zeroed() {
        let buf = AlignedBuf::zeroed(5000, DIRECT_IO_ALIGN).unwrap();
        assert_eq!(buf.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
        assert_eq!(buf.len(), 5000);
        assert_eq!(buf.capacity(), 8192);
        assert!(buf.iter().all(|&b| b == 0));
    }

    #[test]
    fn set_len_clamps_to_capacity() {
        let mut buf = AlignedBuf::zeroed(10, 512).unwrap();
        buf.set_len(100_000);
        assert_eq!(buf.len(), 512);
        buf.set_len(3);
        assert_eq!(&buf[..], &[0, 0, 0]);
    }

    #[test]
    fn bad_alignment_and_overflow_are_errors() {
        assert!(AlignedBuf::zeroed(10, 3000).is_err());
        assert!(AlignedBuf::zeroed(usize::MAX - 10, 4096).is_err());
    }

    #[test]
    fn align_up_rounds() {
        assert_eq!(align_up(0, 4096), 0);
        assert_eq!(align_up(1, 4096), 4096);
        assert_eq!(align_up(4096, 4096), 4096);
        assert_eq!(align_up(4097, 512), 4608);
    }
}
