//! Why a G4 operation failed.

use std::time::Duration;

/// Why a G4 operation failed. Callers of the store never see these: they
/// become misses; they are logged and counted.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RemoteError {
    /// The URL or settings cannot work (reported when the store opens).
    #[error("{0}")]
    Config(String),
    /// The pool answered with an error, or the connection failed.
    #[error("G4 error: {0}")]
    Backend(String),
    /// The operation ran past its time limit.
    #[error("G4 operation timed out after {0:?}")]
    Timeout(Duration),
    /// The circuit breaker is open: the operation was not sent.
    #[error("G4 unavailable (circuit breaker open)")]
    Unavailable,
}
