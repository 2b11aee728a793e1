//! The staging ring's CUDA sink: page-locked staging buffers and
//! asynchronous host-to-device copies on one stream (feature `cuda`).
//!
//! Built on cudarc, the CUDA binding candle uses, so a shard's device
//! memory ([`CudaSlice<u8>`]) lives in the same context as the engine's
//! tensors.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, result};

use crate::buffer::HostAllocator;

use super::sink::{CopyFence, DeviceSink};

/// Page-locked host memory from `cuMemHostAlloc`: the copy engine DMAs
/// from it directly, so a copy from it is truly asynchronous (from
/// pageable memory the driver would stage it through its own buffer).
#[derive(Debug)]
pub struct CudaPinnedAllocator {
    ctx: Arc<CudaContext>,
}

impl CudaPinnedAllocator {
    /// Page-locked memory registered with `ctx`.
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        Self { ctx }
    }
}

// SAFETY: `cuMemHostAlloc` returns page-aligned memory valid for the size
// asked; it is zeroed here before being handed out, checked against the
// layout's alignment, and freed only by `cuMemFreeHost`.
unsafe impl HostAllocator for CudaPinnedAllocator {
    fn allocate_zeroed(&self, layout: Layout) -> Option<NonNull<u8>> {
        if layout.size() == 0 {
            return NonNull::new(layout.align() as *mut u8);
        }
        self.ctx.bind_to_thread().ok()?;
        // Flags 0, not write-combined: the ring reads header bytes back on
        // the host, and reads from write-combined memory are uncached.
        // SAFETY: a plain allocation call; the result is checked below.
        let p = unsafe { result::malloc_host(layout.size(), 0) }.ok()?;
        let p = NonNull::new(p.cast::<u8>())?;
        if !(p.as_ptr() as usize).is_multiple_of(layout.align()) {
            // SAFETY: just allocated by `malloc_host`, never handed out.
            let _ = unsafe { result::free_host(p.as_ptr().cast()) };
            return None;
        }
        // SAFETY: `p` is valid for `layout.size()` bytes.
        unsafe { std::ptr::write_bytes(p.as_ptr(), 0, layout.size()) };
        Some(p)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!("cannot free pinned memory: {e}");
            return;
        }
        // SAFETY: the caller passes memory from `allocate_zeroed`, which
        // came from `malloc_host`.
        if let Err(e) = unsafe { result::free_host(ptr.as_ptr().cast()) } {
            tracing::warn!("cuMemFreeHost failed: {e}");
        }
    }

    fn name(&self) -> &'static str {
        "cuda-pinned"
    }
}

/// Copies into CUDA device memory on one stream, from pinned staging
/// buffers.
#[derive(Debug)]
pub struct CudaSink {
    stream: Arc<CudaStream>,
    pinned: Arc<dyn HostAllocator>,
}

impl CudaSink {
    /// A sink on a new stream of `ctx`, so that the copies do not wait on
    /// (or hold up) work queued on the context's default stream.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, String> {
        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
        Ok(Self::on_stream(stream))
    }

    /// A sink on `stream` (e.g. candle's device stream, so that tensors
    /// made from the memory are ordered after the copies).
    pub fn on_stream(stream: Arc<CudaStream>) -> Self {
        let pinned = Arc::new(CudaPinnedAllocator::new(stream.context().clone()));
        Self { stream, pinned }
    }
}

impl CopyFence for CudaEvent {
    fn wait(&self) -> Result<(), String> {
        self.synchronize().map_err(|e| e.to_string())
    }
}

impl DeviceSink for CudaSink {
    type Memory = CudaSlice<u8>;
    type Fence = CudaEvent;

    fn describe(&self) -> String {
        format!("cuda:{}", self.stream.context().ordinal())
    }

    fn staging_allocator(&self) -> Arc<dyn HostAllocator> {
        self.pinned.clone()
    }

    fn allocate(&mut self, len: usize) -> Result<CudaSlice<u8>, String> {
        self.stream
            .alloc_zeros::<u8>(len)
            .map_err(|e| e.to_string())
    }

    unsafe fn copy_async(
        &mut self,
        src: &[u8],
        dst: &mut CudaSlice<u8>,
        offset: usize,
    ) -> Result<CudaEvent, String> {
        let mut view = dst
            .try_slice_mut(offset..offset.saturating_add(src.len()))
            .ok_or_else(|| format!("copy of {} bytes at {offset} is out of range", src.len()))?;
        // `src` is pinned (from `staging_allocator`), so this returns once
        // the copy is queued; the event marks when it has read `src`.
        self.stream
            .memcpy_htod(src, &mut view)
            .map_err(|e| e.to_string())?;
        self.stream
            .record_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| e.to_string())
    }
}
