//! Serving requests: the engine, the scheduler over it, token choice.
//!
//! * [`engine`]: sequences, the batched step (decode rows and prefill
//!   chunks in one forward pass), offload of full blocks to the store.
//! * [`scheduler`]: one thread owns the engine and serves many requests
//!   (continuous batching, chunked prefill).
//! * [`sampling`]: the next token from logits, and log probabilities.

pub mod engine;
pub mod scheduler;

pub mod sampling;
