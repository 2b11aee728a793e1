//! `load_safetensors`: a safetensors file or a model directory through the
//! parallel direct-I/O weight loader of `kvtier-io`.

use std::path::{Path, PathBuf};

use kvtier_io::loader::{LoadError, LoadedShard, LoaderConfig, load_model_dir, load_shards};
use kvtier_io::{IoEngine, system_allocator};
use pyo3::prelude::*;

use crate::host_buffer::{HostBuffer, TensorSpan, hand_over, spans};
use crate::py_error::load_error;

/// Loads the safetensors file at `path`, or the model in the directory
/// `path` (its `model.safetensors.index.json`, else `model.safetensors`,
/// else every `*.safetensors` file), with the GIL released.
///
/// Returns `(buffers, tensors)`: one `HostBuffer` per file, and every
/// tensor as `(name, dtype, shape, buffer index, start, end)`, shard by
/// shard in file-offset order. `kvtier.load_safetensors` makes the arrays.
#[pyfunction]
pub(crate) fn load_safetensors(
    py: Python<'_>,
    path: PathBuf,
) -> PyResult<(Vec<HostBuffer>, Vec<TensorSpan>)> {
    let shards = py
        .detach(|| load(&path))
        .map_err(|e| load_error(&e).into_py_err(py))?;
    let wanted: Vec<(usize, String)> = shards
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.tensors().map(move |t| (i, t.name.to_string())))
        .collect();
    let spans = spans(&shards, wanted.iter().map(|(i, n)| (*i, n.as_str())))
        .map_err(|e| e.into_py_err(py))?;
    Ok((hand_over(shards), spans))
}

fn load(path: &Path) -> Result<Vec<LoadedShard>, LoadError> {
    let meta = std::fs::metadata(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let cfg = LoaderConfig::default();
    let (shards, _stats) = if meta.is_dir() {
        load_model_dir(path, &cfg)?
    } else {
        load_shards(
            &[path.to_path_buf()],
            &cfg,
            IoEngine::shared(),
            &system_allocator(),
        )?
    };
    Ok(shards)
}
