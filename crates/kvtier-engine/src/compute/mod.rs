//! Where and how the arithmetic runs.
//!
//! * [`device`]: the device tensors live on, the CPU threads, the host
//!   allocator kept from returning scratch memory.
//! * [`parallel`]: the decode step's parts split over the CPU threads.
//! * [`gemv`]: the decode step's projections (streaming dot products).
//! * [`softmax`]: the prefill chunks' causal softmax, in place.

pub mod device;
pub mod parallel;

pub mod gemv;
pub mod softmax;
