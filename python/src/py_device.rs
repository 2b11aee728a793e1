//! `device_read_gbps`: the device's own O_DIRECT read limit, measured on
//! the files a benchmark reads (`kvtier.bench`), with kvtier-io's probe.

use std::path::PathBuf;

use kvtier_io::device_limit::{DeviceLimit, LIMIT_IO_BYTES};
use kvtier_io::{IoEngine, probe_direct};
use pyo3::prelude::*;

use crate::py_error::{ErrorInfo, Kind};

/// Reads about `bytes` from the start of `paths` (an equal share of each)
/// with O_DIRECT where the file system takes it, 4 MiB per read, 32 in
/// flight, and returns `(GB/s, direct)`; the GIL is released meanwhile.
#[pyfunction]
#[pyo3(signature = (paths, bytes = 1 << 30))]
pub fn device_read_gbps(py: Python<'_>, paths: Vec<PathBuf>, bytes: u64) -> PyResult<(f64, bool)> {
    let direct = paths
        .first()
        .and_then(|p| p.parent())
        .is_some_and(|dir| probe_direct(dir).direct);
    py.detach(|| {
        let mut limit = DeviceLimit::over_files(&paths, bytes, LIMIT_IO_BYTES, direct)?;
        limit.measure(IoEngine::shared())
    })
    .map(|gbps| (gbps, direct))
    .map_err(|e| ErrorInfo::new(Kind::Os, e.to_string()).into_py_err(py))
}
