//! Engine errors: every one names what was wrong and where.

use std::path::PathBuf;

/// Why the engine could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Reading a file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `config.json` is malformed or unsupported.
    #[error("bad model config {path}: {msg}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// Weights are missing, malformed or do not match the config.
    #[error("bad weights: {0}")]
    Weights(String),
    /// The tokenizer could not be loaded or used.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A chat template does not compile.
    #[error("chat template ({origin}): {msg}")]
    ChatTemplate {
        /// Where it came from (a file, or `chat_template` of a config).
        origin: String,
        /// What is wrong.
        msg: String,
    },
    /// The request cannot be served (empty or over-long prompt, ...).
    #[error("invalid request: {0}")]
    Request(String),
    /// The G1 KV pool has no free page.
    #[error("KV pool exhausted: {0}")]
    PoolExhausted(String),
    /// A tensor operation failed.
    #[error("tensor op failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] kvtier_store::StoreError),
    /// A KV page could not be coded for the store (fp8/int8 and a NaN or
    /// Inf value) or decoded from it.
    #[error("KV codec: {0}")]
    Codec(#[from] kvtier_store::CodecError),
    /// The device asked for cannot be used.
    #[error("device {name}: {msg}")]
    Device {
        /// The device as named (`cpu`, `cuda:0`).
        name: String,
        /// Why it cannot be used.
        msg: String,
    },
}
