//! `kvtier._kvtier`: the native module of the `kvtier` Python package.
//!
//! The Python package (`python/kvtier/`) is the public surface: it turns
//! what this module returns into numpy arrays or torch tensors and raises
//! the exception classes of `kvtier.errors`. This module does the I/O
//! through `kvtier-io`, with the GIL released:
//!
//! * `host_buffer`: `HostBuffer`, one loaded file's bytes, viewed by the
//!   arrays through numpy's array interface (no copy);
//! * `py_load`: `load_safetensors`, a file or a model directory through
//!   the parallel direct-I/O weight loader;
//! * `py_checkpoint`: `save_checkpoint` and `load_checkpoint`, the
//!   crash-safe checkpoint writer and its verified loader;
//! * `array_input`: reading the bytes of numpy arrays handed in;
//! * `py_error`: every Rust error as a `kvtier.errors` exception;
//! * `py_device`: `device_read_gbps`, the device's read limit for the
//!   benchmarks;
//! * `py_store`: `Store`, `Namespace`, `Layout`, `Transfer`,
//!   `BlockResult`: the tiered KV store (`kvtier.Store`);
//! * `py_completions`: `Completions`, a completion queue with an eventfd
//!   over a namespace's loads and saves (`kvtier.lmcache`).

mod array_input;
mod host_buffer;
mod py_checkpoint;
mod py_completions;
mod py_device;
mod py_error;
mod py_load;
mod py_store;

use pyo3::prelude::*;

/// The module `kvtier._kvtier`.
#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<host_buffer::HostBuffer>()?;
    m.add_function(wrap_pyfunction!(py_load::load_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(py_checkpoint::save_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(py_checkpoint::load_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(py_device::device_read_gbps, m)?)?;
    m.add_class::<py_store::Store>()?;
    m.add_class::<py_store::Namespace>()?;
    m.add_class::<py_store::Layout>()?;
    m.add_class::<py_store::Transfer>()?;
    m.add_class::<py_store::BlockResult>()?;
    m.add_class::<py_completions::Completions>()?;
    Ok(())
}
