//! What the staging ring copies into: device memory and its copy engine.

use std::sync::Arc;

use crate::buffer::HostAllocator;

/// Completion of one queued copy.
pub trait CopyFence: Send {
    /// Blocks until the copy has finished reading its source; an error
    /// means the device failed and the copy's state is unknown.
    fn wait(&self) -> Result<(), String>;
}

/// A device the staging ring loads into: it allocates the destination,
/// provides the staging memory, and runs copies asynchronously, in the
/// order they are queued.
pub trait DeviceSink: Send {
    /// One shard's destination memory.
    type Memory: Send;
    /// Completion of one queued copy.
    type Fence: CopyFence;

    /// A name for reports and errors, e.g. "cuda:0".
    fn describe(&self) -> String;

    /// Where staging buffers come from (page-locked memory for a GPU, so
    /// that copies from it are true DMA and run asynchronously).
    fn staging_allocator(&self) -> Arc<dyn HostAllocator>;

    /// Allocates `len` bytes of destination memory.
    fn allocate(&mut self, len: usize) -> Result<Self::Memory, String>;

    /// Queues a copy of `src` into `dst[offset..offset + src.len()]` and
    /// returns without waiting for it. Copies complete in queue order.
    ///
    /// # Safety
    ///
    /// The copy reads `src` after this call returns: the caller must keep
    /// `src` alive and unmodified until the returned fence's `wait` has
    /// returned `Ok`, and must never free or reuse it if `wait` fails or
    /// this call returns an error.
    unsafe fn copy_async(
        &mut self,
        src: &[u8],
        dst: &mut Self::Memory,
        offset: usize,
    ) -> Result<Self::Fence, String>;
}
