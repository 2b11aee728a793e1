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
/// of a block that readers may hold at the same time, with no copy), or
/// borrowed read-only from the caller (writes straight from the caller's
/// memory, with no copy).
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
}

impl IoBuf<'_> {
    /// The owned buffer, if this is one.
    pub fn into_owned(self) -> Option<AlignedBuf> {
        match self {
            IoBuf::Owned(b) => Some(b),
            IoBuf::Shared(_) | IoBuf::Borrowed(_) => None,
        }
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.deref().as_ptr()
    }

    pub(crate) fn owned_mut(&mut self) -> Option<&mut AlignedBuf> {
        match self {
            IoBuf::Owned(b) => Some(b),
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
    /// The buffer; returned in [`IoDone`]. Reads need [`IoBuf::Owned`].
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
        None if kind == IoKind::Read && buf.owned_mut().is_none() => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a read needs an owned buffer",
        )),
        None if kind == IoKind::Write && done < buf.len() => Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("wrote {done} of {} bytes", buf.len()),
        )),
        None => Ok(done),
    };
    if let (IoKind::Read, Some(b)) = (kind, buf.owned_mut()) {
        b.set_len(done);
    }
    IoDone { buf, result }
}
