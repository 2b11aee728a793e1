//! The forward pass over paged KV.
//!
//! * [`model`]: the decoder-only transformer (prefill chunks on candle, the
//!   decode step hand-written in `model/decode.rs`).
//! * [`attention`]: paged attention for prefill chunks (sliding windows).
//! * [`rope`]: rotary position embeddings (linear, Llama 3, YaRN; partial
//!   rotary).

pub mod model;

pub mod attention;
pub mod rope;
