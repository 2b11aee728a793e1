//! Eviction policies, kept together behind one trait ([`Eviction`]):
//!
//! * [`prefix_arc`]: kvtier's own policy for prefix KV (adaptive
//!   replacement over the prefix forest's leaves), G2's default.
//! * [`lru`]: LRU over the leaves of the prefix forest.
//! * [`fifo`]: FIFO, flat over keys.
//! * [`s3fifo`]: byte-weighted S3-FIFO over keys, flat.
//! * `ghost`: the ghost list of recently evicted keys (S3-FIFO, kvtier's).
//! * [`leaves`]: the resident prefix forest with its leaves in priority
//!   order, which the chain-aware policies share.
//! * [`clock`]: CLOCK (second chance): the hand's sweep, and CLOCK over
//!   keys ([`Clock`]).

pub mod clock;
pub mod fifo;
mod ghost;
pub mod leaves;
pub mod lru;
pub mod policy;
pub mod prefix_arc;
pub mod s3fifo;

pub use clock::{Clock, Visit, sweep};
pub use fifo::Fifo;
pub use leaves::LeafQueue;
pub use lru::Lru;
pub use policy::{Eviction, EvictionKind};
pub use prefix_arc::PrefixArc;
pub use s3fifo::S3Fifo;
