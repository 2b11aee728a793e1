//! One I/O of a batch and its completion: the op (file, offset, owned,
//! shared or borrowed buffer), what comes back, and the limit on how many
//! may be in flight. The engine ([`crate::io_engine`]) and both backends
//! (`uring`, `threads`) speak these types.

use std::fs::File;
use std::io;
use std::ops::Deref;
use std::sync::Arc;

use crate::buffer::AlignedBuf;

/// Largest in-flight count a batch may ask for.
pub const MAX_IN_FLIGHT: usize = 256;

/// Direction of one I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// Fill `buf[..buf.len()]` from the file (short only at end of file).
    Read,
    /// Write all of `buf[..buf.len()]` to the file.
    Write,
}

/// The buffer of one op: owned (reads and writes), shared read-only (writes
/// of a block that readers may hold at the same time, with no copy),
/// borrowed read-only from the caller (writes straight from the caller's
/// memory, with no copy), or a part of the caller's memory to read into
/// ([`IoOp::read_raw`]: several reads filling one buffer, each part usable
/// as soon as its own read is done).
#[derive(Debug)]
pub enum IoBuf<'b> {
    /// Exclusively owned; required for reads.
    Owned(AlignedBuf),
    /// Shared; the `Arc` keeps it alive while the kernel reads from it.
    Shared(Arc<AlignedBuf>),
    /// Borrowed; the borrow lasts until the op's [`IoDone`] is dropped, and
    /// the engine never returns before the kernel is done with it. With
    /// `O_DIRECT` its address must be aligned as the file system asks
    /// ([`DIRECT_IO_ALIGN`](crate::DIRECT_IO_ALIGN) always is).
    Borrowed(&'b [u8]),
    /// Caller's memory that a read fills ([`IoOp::read_raw`]).
    Raw(RawTarget),
}

/// Memory a read fills in place: where and how long. Built only by
/// [`IoOp::read_raw`], whose caller vouches for the memory.
#[derive(Debug)]
pub struct RawTarget {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: a `RawTarget` is only a place that one op writes; whoever built
// it with `IoOp::read_raw` guarantees the memory stays valid and untouched
// by anyone else until that op completes, so moving it to the thread that
// runs the op is sound.
unsafe impl Send for RawTarget {}
// SAFETY: shared access only reads through it after the op completed (see
// `Send`).
unsafe impl Sync for RawTarget {}

impl IoBuf<'_> {
    /// The owned buffer, if this is one.
    pub fn into_owned(self) -> Option<AlignedBuf> {
        match self {
            IoBuf::Owned(b) => Some(b),
            IoBuf::Shared(_) | IoBuf::Borrowed(_) | IoBuf::Raw(_) => None,
        }
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.deref().as_ptr()
    }

    /// The memory a read may fill: an owned buffer or a raw target.
    pub(crate) fn read_target(&mut self) -> Option<&mut [u8]> {
        match self {
            IoBuf::Owned(b) => Some(b),
            // SAFETY: `IoOp::read_raw`'s caller guarantees the memory is
            // valid and used by nobody else until the op completes.
            IoBuf::Raw(r) => Some(unsafe { std::slice::from_raw_parts_mut(r.ptr.as_ptr(), r.len) }),
            IoBuf::Shared(_) | IoBuf::Borrowed(_) => None,
        }
    }
}

impl Deref for IoBuf<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            IoBuf::Owned(b) => b,
            IoBuf::Shared(b) => b,
            IoBuf::Borrowed(b) => b,
            // SAFETY: see `read_target`; a done op's memory is only read.
            IoBuf::Raw(r) => unsafe { std::slice::from_raw_parts(r.ptr.as_ptr(), r.len) },
        }
    }
}

/// One I/O of a batch. The buffer's current length is the transfer size.
#[derive(Debug)]
pub struct IoOp<'f> {
    /// Read or write.
    pub kind: IoKind,
    /// The open file (with `O_DIRECT` when the offset, length and buffer are
    /// aligned for it).
    pub file: &'f File,
    /// Byte offset in the file.
    pub offset: u64,
    /// The buffer; returned in [`IoDone`]. Reads need [`IoBuf::Owned`] or [`IoBuf::Raw`].
    pub buf: IoBuf<'f>,
}

impl<'f> IoOp<'f> {
    /// A read of `buf.len()` bytes at `offset`.
    pub fn read(file: &'f File, offset: u64, buf: AlignedBuf) -> Self {
        Self {
            kind: IoKind::Read,
            file,
            offset,
            buf: IoBuf::Owned(buf),
        }
    }

    /// A write of `buf.len()` bytes at `offset`.
    pub fn write(file: &'f File, offset: u64, buf: AlignedBuf) -> Self {
        Self {
            kind: IoKind::Write,
            file,
            offset,
            buf: IoBuf::Owned(buf),
        }
    }

    /// A read of `len` bytes at `offset` into caller memory at `ptr`, in
    /// place: several such reads can fill the disjoint parts of one buffer,
    /// and each part can be used as soon as its own read is done (from the
    /// completion callback of [`IoEngine::run_batch_map`](crate::IoEngine::run_batch_map)) while the
    /// others are still in flight. [`IoDone::result`] says how many bytes
    /// landed.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must stay valid for writes, and nothing else may
    /// read or write it, from this call until the op has completed (its
    /// [`IoDone`] is handed to the batch's callback or returned). With
    /// `O_DIRECT`, `ptr`, `len` and `offset` must be aligned as the file
    /// system asks.
    pub unsafe fn read_raw(
        file: &'f File,
        offset: u64,
        ptr: std::ptr::NonNull<u8>,
        len: usize,
    ) -> Self {
        Self {
            kind: IoKind::Read,
            file,
            offset,
            buf: IoBuf::Raw(RawTarget { ptr, len }),
        }
    }

    /// A write of a shared buffer (no copy; the kernel only reads it).
    pub fn write_shared(file: &'f File, offset: u64, buf: Arc<AlignedBuf>) -> Self {
        Self {
            kind: IoKind::Write,
            file,
            offset,
            buf: IoBuf::Shared(buf),
        }
    }
}

/// A finished I/O: its buffer back, and the bytes moved or the error.
///
/// For reads, `buf.len()` is set to the bytes actually read (shorter than
/// asked only at end of file).
#[derive(Debug)]
pub struct IoDone<'b> {
    /// The op's buffer, handed back.
    pub buf: IoBuf<'b>,
    /// Bytes transferred, or the error that stopped the op.
    pub result: io::Result<usize>,
}

/// Turns a finished transfer into its result: reads may end short at end of
/// file, writes may not.
pub(crate) fn finish(
    kind: IoKind,
    mut buf: IoBuf<'_>,
    done: usize,
    err: Option<io::Error>,
) -> IoDone<'_> {
    let result = match err {
        Some(e) => Err(e),
        None if kind == IoKind::Read && buf.read_target().is_none() => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a read needs an owned buffer or a raw target",
        )),
        None if kind == IoKind::Write && done < buf.len() => Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("wrote {done} of {} bytes", buf.len()),
        )),
        None => Ok(done),
    };
    if let (IoKind::Read, IoBuf::Owned(b)) = (kind, &mut buf) {
        b.set_len(done);
    }
    IoDone { buf, result }
}
