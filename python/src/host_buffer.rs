//! `HostBuffer`: the bytes of one loaded file, owned by a Python object,
//! which numpy arrays view without a copy.
//!
//! The abi3 wheel targets CPython 3.10, whose limited API has no buffer
//! protocol (it joined the limited API in 3.11), so the buffer is exposed
//! through numpy's array interface instead: `__array_interface__` gives
//! its address and length, and `numpy.asarray(buffer)` makes a `uint8`
//! array over it whose `base` is the buffer. Every tensor array is a view
//! of that array, so the memory lives until the last one is gone. torch
//! tensors are made from those arrays with `torch.from_numpy`, which keeps
//! them (and so the buffer) alive.

use std::path::PathBuf;

use kvtier_io::AlignedBuf;
use kvtier_io::loader::LoadedShard;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::py_error::{ErrorInfo, Kind};

/// One loaded file's bytes (header included), for the arrays that view it.
///
/// Made only by this module's loaders; Python code reads it through
/// `numpy.asarray`. The arrays may write into it: Rust never reads the
/// bytes again after handing the buffer over, it only frees them when the
/// last Python reference is dropped.
#[pyclass(frozen, module = "kvtier._kvtier")]
pub struct HostBuffer {
    /// The memory; freed when this object is.
    _buf: AlignedBuf,
    /// Its address, taken from an exclusive borrow when it was handed over.
    addr: usize,
    /// Bytes that belong to the file (the buffer's capacity may be larger).
    len: usize,
    path: PathBuf,
}

impl HostBuffer {
    /// Takes ownership of `buf`, the bytes of the file at `path`.
    pub(crate) fn new(mut buf: AlignedBuf, path: PathBuf) -> Self {
        let addr = buf.as_mut_ptr() as usize;
        let len = buf.len();
        Self {
            _buf: buf,
            addr,
            len,
            path,
        }
    }
}

#[pymethods]
impl HostBuffer {
    /// numpy's array interface (version 3): a writable one-dimensional
    /// `uint8` array over the file's bytes.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.len,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.addr, false))?;
        Ok(d)
    }

    /// The file these bytes were read from.
    #[getter]
    fn path(&self) -> String {
        self.path.display().to_string()
    }

    /// Bytes held: the file's length.
    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!(
            "HostBuffer({:?}, {} bytes)",
            self.path.display().to_string(),
            self.len
        )
    }
}

/// Where one tensor lies: `(name, dtype, shape, buffer, start, end)`, its
/// bytes `[start, end)` of the `buffer`-th [`HostBuffer`] of a load.
pub(crate) type TensorSpan = (String, &'static str, Vec<usize>, usize, usize, usize);

/// The spans of the tensors `wanted` (shard index, tensor name), in that
/// order, within `shards`' buffers. A name missing from its shard is an
/// error (a loader that validated the shards never hands one over).
pub(crate) fn spans<'a>(
    shards: &[LoadedShard],
    wanted: impl IntoIterator<Item = (usize, &'a str)>,
) -> Result<Vec<TensorSpan>, ErrorInfo> {
    wanted
        .into_iter()
        .map(|(i, name)| {
            let missing = || {
                ErrorInfo::new(
                    Kind::Base,
                    format!("internal error: tensor {name:?} is not in loaded shard {i}"),
                )
                .tensor(name)
            };
            let shard = shards.get(i).ok_or_else(missing)?;
            let view = shard.tensor(name).ok_or_else(missing)?;
            let start = (view.data.as_ptr() as usize) - (shard.file_bytes().as_ptr() as usize);
            Ok((
                name.to_string(),
                view.dtype.as_str(),
                view.shape.to_vec(),
                i,
                start,
                start + view.data.len(),
            ))
        })
        .collect()
}

/// Hands every shard's buffer over to a [`HostBuffer`], in order.
pub(crate) fn hand_over(shards: Vec<LoadedShard>) -> Vec<HostBuffer> {
    shards
        .into_iter()
        .map(|s| {
            let path = s.path().to_path_buf();
            HostBuffer::new(s.into_buffer(), path)
        })
        .collect()
}
