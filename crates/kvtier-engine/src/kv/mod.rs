//! G1, the engine's KV pages, and the store below them.
//!
//! * [`kv_pool`]: the paged KV pool (G1): pages, the per-layer tensors,
//!   page import and export to store blocks.
//! * [`prefix_cache`]: which G1 pages hold which prefixes, and which may be
//!   reclaimed.
//! * [`prefix_restore`]: a prompt's cached prefix restored from the store
//!   without waiting on it, then attached.
//! * [`layer_restore`]: the same restore layer by layer, the forward pass
//!   waiting only for the layer it is at.

pub mod kv_pool;
pub mod prefix_cache;
pub mod prefix_restore;

pub mod layer_restore;
