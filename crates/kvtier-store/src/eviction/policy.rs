//! The one interface every eviction policy has, and the choice of one by
//! name.
//!
//! G2 (`memory.rs`) holds its policy as a `Box<dyn Eviction<BlockKey>>`,
//! and the trace simulator (`kvtier-trace`) drives the very same types
//! through the same trait, so a hit rate the simulator reports is the one
//! the store's code gives, not a second implementation's.

use std::fmt;
use std::hash::Hash;
use std::str::FromStr;

use super::{Clock, Fifo, Lru, PrefixArc, S3Fifo};

/// An eviction policy over keys with weights (bytes, or 1 per block).
///
/// The policy tracks keys only; the caller holds the values and drops
/// every key the policy returns as evicted.
pub trait Eviction<K>: Send + fmt::Debug {
    /// The policy's name, as [`EvictionKind`] spells it.
    fn name(&self) -> &'static str;

    /// The capacity, in weight units.
    fn capacity(&self) -> u64;

    /// Sum of the resident keys' weights; never above the capacity.
    fn used(&self) -> u64;

    /// Number of resident keys.
    fn len(&self) -> usize;

    /// True when no key is resident.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when `key` is resident.
    fn contains(&self, key: &K) -> bool;

    /// Records a hit on a resident key; false when absent.
    fn touch(&mut self, key: &K) -> bool;

    /// Inserts `key` with `weight`, or re-weights it when resident.
    /// `parent` is the block before it in its prefix chain, when the
    /// caller knows it: a chain-aware policy keeps a parent while its
    /// children are resident. Evicts until the weights fit and returns the
    /// evicted keys in eviction order; a key that could not be admitted is
    /// returned too (and is not resident).
    fn insert(&mut self, key: K, weight: u64, parent: Option<&K>) -> Vec<K>;

    /// Removes a key without any record of it; returns its weight.
    fn remove(&mut self, key: &K) -> Option<u64>;

    /// Evicts one key by the policy's rule; `None` when empty.
    fn evict_one(&mut self) -> Option<K>;

    /// Evicts one key `may_take` accepts, by the policy's rule among
    /// those (G3 passes over slots pinned by readers); `None` when no
    /// resident key is accepted. Refused keys stay resident.
    fn evict_where(&mut self, may_take: &mut dyn FnMut(&K) -> bool) -> Option<K>;
}

/// The eviction policies a tier can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EvictionKind {
    /// Least recently used, leaves of the prefix forest only.
    Lru,
    /// First in, first out, flat over keys.
    Fifo,
    /// Byte-weighted S3-FIFO (flat over keys), G2's policy before kvtier's.
    S3Fifo,
    /// CLOCK (second chance), flat over keys: G3's rule over its slots.
    Clock,
    /// kvtier's own, [`PrefixArc`]: adaptive replacement over the prefix
    /// forest's leaves.
    #[default]
    Kvtier,
}

impl EvictionKind {
    /// Every kind, in the order the docs and `--help` list them.
    pub const ALL: [EvictionKind; 5] = [
        Self::Kvtier,
        Self::Lru,
        Self::Fifo,
        Self::S3Fifo,
        Self::Clock,
    ];

    /// The kind's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Fifo => "fifo",
            Self::S3Fifo => "s3fifo",
            Self::Clock => "clock",
            Self::Kvtier => "kvtier",
        }
    }

    /// A policy of this kind holding at most `capacity` weight.
    pub fn build<K: Hash + Eq + Clone + Send + fmt::Debug + 'static>(
        self,
        capacity: u64,
    ) -> Box<dyn Eviction<K>> {
        match self {
            Self::Lru => Box::new(Lru::new(capacity)),
            Self::Fifo => Box::new(Fifo::new(capacity)),
            Self::S3Fifo => Box::new(S3Fifo::new(capacity)),
            Self::Clock => Box::new(Clock::new(capacity)),
            Self::Kvtier => Box::new(PrefixArc::new(capacity)),
        }
    }
}

impl fmt::Display for EvictionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EvictionKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|k| k.as_str()).collect();
                format!(
                    "unknown eviction policy {s:?}: expected one of {}",
                    names.join(", ")
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_parses_by_name_and_passes_over_refused_keys() {
        for kind in EvictionKind::ALL {
            assert_eq!(kind.as_str().parse::<EvictionKind>(), Ok(kind));
            let mut p = kind.build::<u32>(4);
            for k in 0..4 {
                assert!(p.insert(k, 1, None).is_empty(), "{kind}");
            }
            // Only 3 may go: whatever the rule's order, 3 is the one taken,
            // the refused keys stay resident, and with nothing acceptable
            // left nothing is taken.
            assert_eq!(p.evict_where(&mut |k| *k == 3), Some(3), "{kind}");
            assert_eq!(p.len(), 3, "{kind}");
            assert!((0..3).all(|k| p.contains(&k)), "{kind}");
            assert_eq!(p.evict_where(&mut |_| false), None, "{kind}");
            assert_eq!(p.len(), 3, "{kind}");
            assert_eq!(p.used(), 3, "{kind}");
        }
        assert!("mru".parse::<EvictionKind>().is_err());
    }
}
