//! Why the server (or a prefill) could not start or stopped with an error.
//!
//! Every variant reads as the message the user sees, and keeps its cause as
//! the error's source, so `kvtier` prints the whole chain (`what: cause`).

use kvtier_engine::EngineError;
use kvtier_store::StoreError;

/// An error of [`crate::start`], [`crate::run`] or [`crate::prefill()`].
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Bad options or a model directory that cannot be served.
    #[error("{0}")]
    Invalid(String),
    /// The engine failed (config, tokenizer, device).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The engine failed at the step `what` names.
    #[error("{what}")]
    EngineStep {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: EngineError,
    },
    /// The store failed at the step `what` names.
    #[error("{what}")]
    Store {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: StoreError,
    },
    /// An I/O step failed (binding, the cache directory, stdout).
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A helper thread of the server failed.
    #[error("{what}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl ServeError {
    /// An I/O error at the step `what`.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }

    /// An engine error at the step `what`.
    pub fn engine(what: impl Into<String>, source: EngineError) -> Self {
        Self::EngineStep {
            what: what.into(),
            source,
        }
    }
}
