//! kvtier-store: the tiered KV block store.
//!
//! Knows nothing about models: it stores fixed-size KV blocks named by
//! chained prefix hashes ([`key`]), in a versioned, checksummed format
//! ([`block`]), across G2 host memory and G3 disk tiers.

pub mod block;
pub mod key;
pub mod layout;
pub mod policy;
