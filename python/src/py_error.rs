//! Rust errors as Python exceptions.
//!
//! Each error becomes an instance of a class of `kvtier.errors` (defined in
//! Python, so that classes can also derive from `OSError`, `ValueError` or
//! `TypeError`), whose message is the Rust error's message and whose
//! `path` and `tensor` attributes name the file and tensor where the
//! error knows them; OS errors also carry `errno` (not `filename` or
//! `strerror`, which would replace the message in `str(error)`).

use std::path::Path;

use kvtier_io::checkpoint::CheckpointError;
use kvtier_io::loader::LoadError;
use kvtier_io::safetensors::SafetensorsError;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyModule;

/// Which exception class of `kvtier.errors` an error becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `KvtierError`: anything without a more precise class.
    Base,
    /// `SafetensorsFormatError`: a malformed safetensors file.
    Format,
    /// `ModelDirError`: the model directory or its index is unusable.
    ModelDir,
    /// `FileChangedError`: a file changed while it was being read.
    Changed,
    /// `KvtierOSError`: the operating system failed a file operation.
    Os,
    /// `DiskFullError`: the device ran out of space.
    DiskFull,
    /// `CheckpointError`: a checkpoint's manifest or shards disagree.
    Checkpoint,
    /// `NoCheckpointError`: the directory holds no committed checkpoint.
    NoCheckpoint,
    /// `ChecksumError`: a tensor's bytes fail their crc32c.
    Checksum,
    /// `InvalidTensorError`: a tensor cannot be saved as given.
    InvalidTensor,
    /// `StoreError`: the KV store refused an operation.
    Store,
    /// Python's `MemoryError`: a buffer could not be allocated.
    Memory,
}

impl Kind {
    fn class_name(self) -> &'static str {
        match self {
            Kind::Base => "KvtierError",
            Kind::Format => "SafetensorsFormatError",
            Kind::ModelDir => "ModelDirError",
            Kind::Changed => "FileChangedError",
            Kind::Os => "KvtierOSError",
            Kind::DiskFull => "DiskFullError",
            Kind::Checkpoint => "CheckpointError",
            Kind::NoCheckpoint => "NoCheckpointError",
            Kind::Checksum => "ChecksumError",
            Kind::InvalidTensor => "InvalidTensorError",
            Kind::Store => "StoreError",
            Kind::Memory => "MemoryError",
        }
    }
}

/// An error on its way to Python: its class, message and attributes.
#[derive(Debug)]
pub(crate) struct ErrorInfo {
    kind: Kind,
    message: String,
    path: Option<String>,
    tensor: Option<String>,
    errno: Option<i32>,
}

impl ErrorInfo {
    /// An error of `kind` saying `message`.
    pub(crate) fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            path: None,
            tensor: None,
            errno: None,
        }
    }

    /// Names the file or directory the error is about.
    pub(crate) fn path(mut self, path: &Path) -> Self {
        self.path = Some(path.display().to_string());
        self
    }

    /// Names the tensor the error is about.
    pub(crate) fn tensor(mut self, tensor: &str) -> Self {
        self.tensor = Some(tensor.to_string());
        self
    }

    fn errno(mut self, errno: Option<i32>) -> Self {
        self.errno = errno;
        self
    }

    /// The Python exception.
    pub(crate) fn into_py_err(self, py: Python<'_>) -> PyErr {
        if self.kind == Kind::Memory {
            return PyMemoryError::new_err(self.message);
        }
        match self.build(py) {
            Ok(err) => err,
            // Only when the `kvtier` package itself is broken.
            Err(e) => PyRuntimeError::new_err(format!(
                "{} (and kvtier.errors.{} could not be raised: {e})",
                self.message,
                self.kind.class_name()
            )),
        }
    }

    fn build(&self, py: Python<'_>) -> PyResult<PyErr> {
        static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
        let module = ERRORS
            .get_or_try_init(py, || py.import("kvtier.errors").map(Bound::unbind))?
            .bind(py);
        let exc = module
            .getattr(self.kind.class_name())?
            .call1((self.message.as_str(),))?;
        exc.setattr("path", self.path.as_deref())?;
        exc.setattr("tensor", self.tensor.as_deref())?;
        if let Some(errno) = self.errno {
            exc.setattr("errno", errno)?;
        }
        Ok(PyErr::from_value(exc))
    }
}

/// A loader error as Python sees it.
pub(crate) fn load_error(e: &LoadError) -> ErrorInfo {
    let info = ErrorInfo::new(Kind::Base, e.to_string());
    match e {
        LoadError::Safetensors(s) => safetensors_error(s),
        LoadError::Io { path, source } => ErrorInfo {
            kind: Kind::Os,
            ..info
        }
        .path(path)
        .errno(source.raw_os_error()),
        LoadError::MissingShard { index, .. } | LoadError::BadIndex { path: index, .. } => {
            ErrorInfo {
                kind: Kind::ModelDir,
                ..info
            }
            .path(index)
        }
        LoadError::TensorNotInShard { index, tensor, .. } => ErrorInfo {
            kind: Kind::ModelDir,
            ..info
        }
        .path(index)
        .tensor(tensor),
        LoadError::NoShards { dir } => ErrorInfo {
            kind: Kind::ModelDir,
            ..info
        }
        .path(dir),
        LoadError::Changed { path, .. } => ErrorInfo {
            kind: Kind::Changed,
            ..info
        }
        .path(path),
        LoadError::Alloc(_) => ErrorInfo {
            kind: Kind::Memory,
            ..info
        },
        LoadError::Device { .. } | LoadError::BadConfig(_) => info,
    }
}

/// A safetensors reader error: a malformed file, or a failed read.
fn safetensors_error(e: &SafetensorsError) -> ErrorInfo {
    let (kind, errno) = match e {
        SafetensorsError::Io { source, .. } => (Kind::Os, source.raw_os_error()),
        _ => (Kind::Format, None),
    };
    let info = ErrorInfo::new(kind, e.to_string())
        .path(e.path())
        .errno(errno);
    match e.tensor() {
        Some(t) => info.tensor(t),
        None => info,
    }
}

/// A checkpoint error as Python sees it.
pub(crate) fn checkpoint_error(e: &CheckpointError) -> ErrorInfo {
    let message = e.to_string();
    let info = ErrorInfo::new(Kind::Checkpoint, message.clone());
    match e {
        CheckpointError::InvalidTensor { name, .. } => ErrorInfo {
            kind: Kind::InvalidTensor,
            ..info
        }
        .tensor(name),
        CheckpointError::InvalidOptions(_) => ErrorInfo {
            kind: Kind::Base,
            ..info
        },
        CheckpointError::Io { path, source, .. } => ErrorInfo {
            kind: if e.is_disk_full() {
                Kind::DiskFull
            } else {
                Kind::Os
            },
            ..info
        }
        .path(path)
        .errno(source.raw_os_error()),
        CheckpointError::DiskFull { path, source, .. } => ErrorInfo {
            kind: Kind::DiskFull,
            ..info
        }
        .path(path)
        .errno(source.raw_os_error()),
        CheckpointError::NoCheckpoint { dir } => ErrorInfo {
            kind: Kind::NoCheckpoint,
            ..info
        }
        .path(dir)
        .errno(Some(libc::ENOENT)),
        CheckpointError::Manifest { path, .. } | CheckpointError::Shard { path, .. } => {
            info.path(path)
        }
        CheckpointError::Checksum { name, path, .. } => ErrorInfo {
            kind: Kind::Checksum,
            ..info
        }
        .path(path)
        .tensor(name),
        CheckpointError::Header { .. } | CheckpointError::BackgroundPanic { .. } => info,
        // The loader's own class (a malformed shard, a failed read), with
        // the checkpoint's message, which includes the loader's.
        CheckpointError::Load { source, .. } => ErrorInfo {
            message,
            ..load_error(source)
        },
        CheckpointError::Alloc(_) => ErrorInfo {
            kind: Kind::Memory,
            ..info
        },
    }
}
