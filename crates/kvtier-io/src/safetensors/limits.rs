//! The numbers every part of the safetensors reader and encoder agree on.

/// Largest header accepted (same limit as the `safetensors` crate).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Bytes of the little-endian header-length prefix.
pub const PREFIX_BYTES: u64 = 8;

/// The path reported by errors from [`encode_header`](super::encode::encode_header), which has no file.
pub const ENCODE_PATH: &str = "<header being encoded>";
