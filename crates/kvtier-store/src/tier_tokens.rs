//! [`TierTokens`]: prompt tokens served from cache, counted per tier. The
//! one count type of the engine's prefill, the server's usage field
//! (`kvtier.cached_tokens`), the benchmarks' records and the simulator of
//! the server.

use std::ops::AddAssign;

/// Prompt tokens served from cache, by tier. Its JSON field names (`g1` to
/// `g4`) are the server's `usage.kvtier.cached_tokens` contract; a record
/// without `g4` reads as 0 there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TierTokens {
    /// From G1 (the engine's accelerator pages).
    pub g1: usize,
    /// From G2 (host memory).
    pub g2: usize,
    /// From G3 (disk).
    pub g3: usize,
    /// From G4 (the pool shared by nodes).
    #[serde(default)]
    pub g4: usize,
}

impl TierTokens {
    /// Tokens from every tier.
    pub fn total(&self) -> usize {
        self.g1 + self.g2 + self.g3 + self.g4
    }
}

impl AddAssign for TierTokens {
    fn add_assign(&mut self, o: TierTokens) {
        self.g1 += o.g1;
        self.g2 += o.g2;
        self.g3 += o.g3;
        self.g4 += o.g4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_per_tier_and_a_record_without_g4_reads_as_zero() {
        let mut a = TierTokens {
            g1: 1,
            g2: 2,
            g3: 3,
            g4: 4,
        };
        a += TierTokens {
            g1: 10,
            ..TierTokens::default()
        };
        assert_eq!((a.g1, a.total()), (11, 20));
        let read: TierTokens = serde_json::from_str(r#"{"g1":1,"g2":0,"g3":5}"#).unwrap();
        assert_eq!(read.total(), 6);
        assert_eq!(read.g4, 0);
    }
}
