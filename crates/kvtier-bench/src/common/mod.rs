//! What every benchmark uses.
//!
//! * [`fill`]: pseudo-random data nothing below can compress or dedup.
//! * [`progress`]: the progress bars (bytes, requests) on stderr.
//! * [`size`]: human byte sizes, parsed and printed.

pub mod fill;
pub mod progress;
pub mod size;
