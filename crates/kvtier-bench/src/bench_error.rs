//! Benchmark errors.
//!
//! A step that fails says what it was doing ([`BenchError::Step`]) and
//! keeps its cause as the error's source, so `kvtier` prints the whole
//! chain (`what: cause: ...`).

use std::error::Error;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Bad configuration, caught before any work starts.
    #[error("bad benchmark configuration: {0}")]
    Config(String),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] kvtier_engine::EngineError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] kvtier_store::StoreError),
    /// The energy meter failed.
    #[error(transparent)]
    Energy(#[from] kvtier_energy::EnergyError),
    /// The target failed.
    #[error("target: {0}")]
    Target(String),
    /// A benchmark could not run or went wrong; the message says why.
    #[error("{0}")]
    Failed(String),
    /// A step failed: `what` says which, the source why.
    #[error("{what}")]
    Step {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: Box<dyn Error + Send + Sync>,
    },
    /// An I/O error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Any other error, as it describes itself.
    #[error(transparent)]
    Other(Box<dyn Error + Send + Sync>),
}

impl BenchError {
    /// Wraps any error as it describes itself.
    pub fn other(e: impl Error + Send + Sync + 'static) -> Self {
        Self::Other(Box::new(e))
    }
}

/// A result whose error is a [`BenchError`] unless said otherwise.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// Errors that describe themselves well enough to pass through `?` as
/// [`BenchError::Other`].
macro_rules! as_other {
    ($($t:ty),* $(,)?) => {$(
        impl From<$t> for BenchError {
            fn from(e: $t) -> Self {
                Self::other(e)
            }
        }
    )*};
}
as_other!(
    serde_json::Error,
    std::alloc::LayoutError,
    std::num::TryFromIntError,
    kvtier_io::buffer::AllocError,
    kvtier_io::checkpoint::CheckpointError,
    kvtier_io::loader::LoadError,
    kvtier_io::safetensors::SafetensorsError,
);

/// Names the step a fallible call was part of (as `anyhow`'s `context`).
pub trait StepContext<T> {
    /// On error: [`BenchError::Step`] with `what` and the error as source.
    fn step(self, what: impl Into<String>) -> Result<T, BenchError>;
    /// [`step`](Self::step) with a message built only on error.
    fn with_step(self, what: impl FnOnce() -> String) -> Result<T, BenchError>;
}

impl<T, E: Error + Send + Sync + 'static> StepContext<T> for Result<T, E> {
    fn step(self, what: impl Into<String>) -> Result<T, BenchError> {
        self.map_err(|e| BenchError::Step {
            what: what.into(),
            source: Box::new(e),
        })
    }

    fn with_step(self, what: impl FnOnce() -> String) -> Result<T, BenchError> {
        self.map_err(|e| BenchError::Step {
            what: what(),
            source: Box::new(e),
        })
    }
}

/// Returns early with [`BenchError::Failed`] and a formatted message.
macro_rules! fail {
    ($($arg:tt)*) => {
        return Err($crate::bench_error::BenchError::Failed(format!($($arg)*)))
    };
}
pub(crate) use fail;
