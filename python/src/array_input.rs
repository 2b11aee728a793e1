//! The bytes of a numpy array handed to `save_checkpoint`.
//!
//! The Python layer turns every numpy array and torch CPU tensor into a
//! C-contiguous, little-endian `numpy.ndarray` whose element size is the
//! dtype's (torch dtypes numpy lacks, such as bfloat16, as a same-size
//! integer view). Here the array's own `__array_interface__` gives its
//! address; nothing but a real `numpy.ndarray` is accepted, so the address
//! is the array's memory, which stays alive while the caller holds the
//! array.

use kvtier_io::safetensors::Dtype;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::py_error::{ErrorInfo, Kind};

/// Address and length of one array's bytes, and its shape.
#[derive(Debug, Clone)]
pub(crate) struct ArrayBytes {
    addr: usize,
    len: usize,
    /// The array's dimensions, outermost first.
    pub(crate) shape: Vec<usize>,
}

impl ArrayBytes {
    /// The bytes.
    ///
    /// # Safety
    ///
    /// The array these bytes were read from must be alive, and not resized
    /// or written to, for as long as the slice is used.
    pub(crate) unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `addr` and `len` describe the memory of a live,
        // C-contiguous numpy array (checked in `array_bytes`); the caller
        // keeps it alive and unchanged while the slice is used.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

/// Reads where the bytes of `array`, the tensor `name` of dtype `dtype`,
/// are: it must be a C-contiguous little-endian `numpy.ndarray` whose
/// elements are `dtype`'s size.
pub(crate) fn array_bytes(
    array: &Bound<'_, PyAny>,
    name: &str,
    dtype: Dtype,
) -> PyResult<ArrayBytes> {
    let py = array.py();
    let bad = |reason: String| {
        ErrorInfo::new(
            Kind::InvalidTensor,
            format!("invalid tensor {name:?}: {reason}"),
        )
        .tensor(name)
        .into_py_err(py)
    };
    static NDARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let ndarray = NDARRAY.import(py, "numpy", "ndarray")?;
    if !array.is_instance(ndarray)? {
        return Err(bad(format!(
            "expected a numpy.ndarray, got {}",
            array.get_type().name()?
        )));
    }
    let iface = array
        .getattr("__array_interface__")?
        .cast_into::<PyDict>()?;
    let item = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        iface
            .get_item(key)?
            .ok_or_else(|| bad(format!("its __array_interface__ has no {key:?}")))
    };
    if !item("strides")?.is_none() {
        return Err(bad("the array is not C-contiguous".into()));
    }
    let typestr: String = item("typestr")?.extract()?;
    let (order, size) = typestr.split_at(typestr.len().min(2));
    let itemsize: usize = size
        .parse()
        .map_err(|_| bad(format!("unreadable element type {typestr:?}")))?;
    if order.starts_with('>') {
        return Err(bad(format!("big-endian element type {typestr:?}")));
    }
    if itemsize != dtype.size_bytes() {
        return Err(bad(format!(
            "dtype {dtype} has {}-byte elements, the array {itemsize}-byte ones ({typestr})",
            dtype.size_bytes()
        )));
    }
    let shape: Vec<usize> = item("shape")?.cast_into::<PyTuple>()?.extract()?;
    let (addr, _readonly): (usize, bool) = item("data")?.extract()?;
    let len = shape
        .iter()
        .try_fold(itemsize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    Ok(ArrayBytes { addr, len, shape })
}
