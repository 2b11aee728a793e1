//! Experiments on kvtier-engine: compute speed, restore TTFT, decode
//! beside a restore.
//!
//! * [`speed`]: prefill and decode speed of a model directory.
//! * [`restore_ttft`]: one long prompt's TTFT, recomputed and restored from
//!   G3.
//! * [`layer_restore_ttft`]: a restored prefix plus a new suffix, the
//!   prefix restored whole first and layer by layer.
//! * [`idle_ttft`]: a G1-cached request's TTFT against the idle time before
//!   it and the CPU work beside it.
//! * [`decode_beside_restore`]: decoders' inter-token latency while other
//!   requests restore long prefixes.

pub mod speed;

pub mod restore_ttft;

pub mod layer_restore_ttft;

pub mod idle_ttft;

pub mod decode_beside_restore;
