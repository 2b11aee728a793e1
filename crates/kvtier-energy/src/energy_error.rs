//! Errors of the energy crate.
//!
//! A meter that cannot run on this machine (no RAPL, no NVIDIA driver) is not
//! an error: discovery answers [`crate::Probe::Unavailable`] with a reason.
//! [`EnergyError`] is for things that go wrong once a meter is in use, and for
//! bad configuration.

use std::path::PathBuf;

/// What can go wrong while starting or reading a meter, or validating its
/// configuration.
#[derive(Debug, thiserror::Error)]
pub enum EnergyError {
    /// `read()` or `poll()` was called before `start()`.
    #[error("meter `{0}` was read before start()")]
    NotStarted(String),
    /// A counter or statistics file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A counter or statistics file held something unexpected.
    #[error("cannot parse {path}: {detail}")]
    Parse {
        /// The file that failed.
        path: PathBuf,
        /// What was wrong with it.
        detail: String,
    },
    /// An NVML call failed after the library had been initialised.
    #[error("NVML call {call} failed with code {code}")]
    Nvml {
        /// The NVML function.
        call: &'static str,
        /// Its `nvmlReturn_t` code.
        code: u32,
    },
    /// A configuration value (model constants, cost model) is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
}

impl EnergyError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EnergyError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn parse(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        EnergyError::Parse {
            path: path.into(),
            detail: detail.into(),
        }
    }
}
