//! Eviction policies, kept together:
//!
//! * [`s3fifo`]: byte-weighted S3-FIFO over keys, for G2 (host memory),
//!   where one-hit blocks must not push out the shared prefixes.
//! * [`clock`]: CLOCK (second chance) over fixed slots, for G3, where a
//!   victim is a slot to overwrite and pinned slots are never chosen.

pub mod clock;
pub mod s3fifo;

pub use clock::{Visit, sweep};
pub use s3fifo::S3Fifo;
