//! A loaded shard and zero-copy views of its tensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::buffer::AlignedBuf;
use crate::safetensors::{Dtype, Header, TensorInfo};

/// One safetensors file, read whole into a single aligned buffer.
///
/// Tensors are handed out as [`TensorView`]s that borrow the buffer: no
/// copy, and the borrow checker guarantees the buffer outlives (and is not
/// reused under) every view. Dropping or reusing the shard while a view is
/// alive does not compile:
///
/// ```compile_fail,E0505
/// fn use_after_drop(shard: kvtier_io::loader::LoadedShard) {
///     let view = shard.tensors().next();
///     drop(shard);
///     println!("{:?}", view.map(|v| v.data.len()));
/// }
/// ```
#[derive(Debug)]
pub struct LoadedShard {
    path: PathBuf,
    header: Header,
    buf: AlignedBuf,
    index: HashMap<String, usize>,
    direct: bool,
}

impl LoadedShard {
    /// Wraps a buffer holding the whole file whose validated header is
    /// `header`; `buf.len()` must be the file length.
    pub(crate) fn new(path: PathBuf, header: Header, buf: AlignedBuf, direct: bool) -> Self {
        let index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Self {
            path,
            header,
            buf,
            index,
            direct,
        }
    }

    /// The file this shard was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The tensor named `name`, borrowing the shard's buffer.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let i = *self.index.get(name)?;
        self.view(self.header.tensors.get(i)?)
    }

    /// Every tensor, in file (offset) order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.header.tensors.iter().filter_map(|t| self.view(t))
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.header.tensors.len()
    }

    /// True when the shard holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.header.tensors.is_empty()
    }

    /// Bytes read: the file's length.
    pub fn bytes(&self) -> u64 {
        self.buf.len() as u64
    }

    /// The whole file as read (prefix, header, data).
    pub fn file_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The data section: every tensor's bytes, contiguous.
    pub fn data(&self) -> &[u8] {
        let start = usize::try_from(self.header.data_start()).unwrap_or(usize::MAX);
        self.buf.get(start..).unwrap_or_default()
    }

    /// The underlying aligned buffer (capacity rounded up to 4 KiB), e.g.
    /// for a single host-to-device copy of the whole shard.
    pub fn buffer(&self) -> &AlignedBuf {
        &self.buf
    }

    /// True when the shard was read with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Gives the buffer back (for reuse), ending every borrow of it.
    pub fn into_buffer(self) -> AlignedBuf {
        self.buf
    }

    fn view<'a>(&'a self, t: &'a TensorInfo) -> Option<TensorView<'a>> {
        let data = self.buf.get(self.header.file_range(t)?)?;
        Some(TensorView {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            data,
        })
    }
}

/// One tensor of a [`LoadedShard`]: its bytes borrowed from the shard buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorView<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: &'a [usize],
    /// Row-major little-endian element bytes (not necessarily aligned to
    /// the element size: safetensors does not align tensor data).
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Number of elements (1 for a scalar).
    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }
}
