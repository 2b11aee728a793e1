//! What can go wrong reading a trace.

use std::path::PathBuf;

/// A trace that cannot be read: always names the file, and the line when
/// the fault is on one.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file or folder cannot be opened or read.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        error: std::io::Error,
    },
    /// A line (or, for whole-file JSON, a position) is malformed.
    #[error("{path}:{line}: {why}")]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        why: String,
    },
    /// A field of a whole-file JSON trace is malformed; `at` is its path
    /// in the document (`requests[3].requests[1].in`).
    #[error("{path}: {at}: {why}")]
    Field {
        /// The file.
        path: PathBuf,
        /// Where in the document.
        at: String,
        /// What is wrong with it.
        why: String,
    },
    /// The trace as a whole cannot be used.
    #[error("{path}: {why}")]
    Trace {
        /// The file or folder.
        path: PathBuf,
        /// Why.
        why: String,
    },
}

impl TraceError {
    /// A malformed line.
    pub(crate) fn line(path: &std::path::Path, line: usize, why: impl Into<String>) -> Self {
        Self::Line {
            path: path.to_path_buf(),
            line,
            why: why.into(),
        }
    }

    /// A trace-wide fault.
    pub(crate) fn trace(path: &std::path::Path, why: impl Into<String>) -> Self {
        Self::Trace {
            path: path.to_path_buf(),
            why: why.into(),
        }
    }

    /// An I/O fault.
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            error: source,
        }
    }
}
