//! `save_checkpoint` and `load_checkpoint`: the crash-safe checkpoint
//! writer of `kvtier-io` (atomic commit, per-tensor crc32c) and its
//! verified loader.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvtier_io::checkpoint::{LoadOptions, SaveOptions, TensorRef, load_with, save};
use kvtier_io::safetensors::Dtype;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::array_input::{ArrayBytes, array_bytes};
use crate::host_buffer::{HostBuffer, TensorSpan, hand_over, spans};
use crate::py_error::{ErrorInfo, Kind, checkpoint_error};

/// What `load_checkpoint` returns: the shard buffers, the tensors in the
/// order saved, the generation and the caller's metadata.
type LoadedCheckpoint = (
    Vec<HostBuffer>,
    Vec<TensorSpan>,
    u64,
    BTreeMap<String, String>,
);

/// Saves `tensors`, each `(name, dtype, array)` with `array` a C-contiguous
/// little-endian `numpy.ndarray` of `dtype`'s element size, as a new
/// checkpoint generation in `dir`, and returns once it is committed and
/// durable, with the GIL released while writing. Returns what the save
/// did: `generation`, `bytes`, `tensor_bytes`, `files`, `seconds`,
/// `direct`, `direct_reason`, `borrowed_bytes`.
#[pyfunction]
#[pyo3(signature = (dir, tensors, metadata, shard_bytes=None, direct=true))]
pub(crate) fn save_checkpoint<'py>(
    py: Python<'py>,
    dir: PathBuf,
    tensors: Vec<(String, String, Bound<'py, PyAny>)>,
    metadata: BTreeMap<String, String>,
    shard_bytes: Option<u64>,
    direct: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let mut dtypes = Vec::with_capacity(tensors.len());
    let mut arrays: Vec<ArrayBytes> = Vec::with_capacity(tensors.len());
    for (name, dtype, array) in &tensors {
        let Some(d) = Dtype::from_str_name(dtype) else {
            return Err(ErrorInfo::new(
                Kind::InvalidTensor,
                format!("invalid tensor {name:?}: unknown dtype {dtype:?}"),
            )
            .tensor(name)
            .into_py_err(py));
        };
        arrays.push(array_bytes(array, name, d)?);
        dtypes.push(d);
    }
    let mut opts = SaveOptions {
        direct,
        metadata,
        ..SaveOptions::default()
    };
    if let Some(b) = shard_bytes {
        opts.shard_bytes = b;
    }
    let names: Vec<&str> = tensors.iter().map(|(n, _, _)| n.as_str()).collect();
    let result = py.detach(|| {
        let refs: Vec<TensorRef<'_>> = names
            .iter()
            .zip(&dtypes)
            .zip(&arrays)
            .map(|((name, dtype), a)| {
                // SAFETY: `tensors` holds every array for this whole call,
                // so their memory outlives `refs`; the caller is told not to
                // change them while a save runs.
                let data = unsafe { a.bytes() };
                TensorRef::new(name, *dtype, &a.shape, data)
            })
            .collect();
        save(&dir, &refs, &opts)
    });
    let info = result.map_err(|e| checkpoint_error(&e).into_py_err(py))?;
    let d = PyDict::new(py);
    d.set_item("generation", info.generation)?;
    d.set_item("bytes", info.bytes)?;
    d.set_item("tensor_bytes", info.tensor_bytes)?;
    d.set_item("files", info.files)?;
    d.set_item("seconds", info.seconds)?;
    d.set_item("direct", info.direct)?;
    d.set_item("direct_reason", info.direct_reason)?;
    d.set_item("borrowed_bytes", info.borrowed_bytes)?;
    Ok(d)
}

/// Loads the committed checkpoint in `dir`, verifying every tensor's
/// crc32c unless `verify` is false, with the GIL released.
///
/// Returns `(buffers, tensors, generation, metadata)`: one `HostBuffer`
/// per shard file and the tensors in the order they were saved, each as
/// `(name, dtype, shape, buffer index, start, end)`.
#[pyfunction]
#[pyo3(signature = (dir, verify=true))]
pub(crate) fn load_checkpoint(
    py: Python<'_>,
    dir: PathBuf,
    verify: bool,
) -> PyResult<LoadedCheckpoint> {
    let opts = LoadOptions {
        verify,
        ..LoadOptions::default()
    };
    let ckpt = py
        .detach(|| load_with(&dir, &opts))
        .map_err(|e| checkpoint_error(&e).into_py_err(py))?;
    let manifest = ckpt.manifest().clone();
    let shards = ckpt.into_shards();
    let spans = spans(
        &shards,
        manifest.tensors.iter().map(|t| (t.shard, t.name.as_str())),
    )
    .map_err(|e| e.into_py_err(py))?;
    Ok((
        hand_over(shards),
        spans,
        manifest.generation,
        manifest.metadata,
    ))
}
