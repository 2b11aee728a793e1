//! What the simulator reports: prompt tokens served per tier, where the
//! store holds a block, how a request ended or failed, running counts.

pub use kvtier_store::TierTokens;

/// Where the store holds one block
/// ([`ServerSim::store_places`](super::ServerSim::store_places)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockPlace {
    /// G2 holds it.
    pub g2: bool,
    /// G3 holds it.
    pub g3: bool,
}

/// How a request's generation ended, which decides how many generated
/// tokens the server computed (and cached) for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It reached `max_tokens` (`finish_reason` "length"): the last token
    /// was sent, never computed.
    Length,
    /// The model produced a stop token (`finish_reason` "stop"), which is
    /// not in the output: every output token was computed.
    StopToken,
}

/// Why the server would not answer a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The prompt holds no token.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// G1 ran out of pages for the sequence (all held by it): the server
    /// answers with an error; what it found cached is in `hits`.
    #[error("G1 has no page left for the sequence")]
    PoolExhausted {
        /// What its prefix restore found.
        hits: TierTokens,
    },
}

/// What the simulated server did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Requests simulated.
    pub requests: u64,
    /// Requests the server would have failed.
    pub failed: u64,
    /// Cached G1 pages reclaimed for other use.
    pub g1_reclaimed: u64,
    /// G1 pages cached now (idle, reclaimable: the scheduler's
    /// `g1_cached`).
    pub g1_cached_pages: usize,
    /// Blocks in G2 now.
    pub g2_blocks: usize,
    /// Blocks G2 evicted to make room (the store's `evictions` of G2).
    pub g2_evicted: u64,
    /// Blocks in G3 now.
    pub g3_blocks: usize,
    /// Blocks written to G3.
    pub g3_written: u64,
    /// Blocks G3 evicted to free a slot.
    pub g3_evicted: u64,
    /// Of those, the ones evicted while a restart wrote G2's blocks to G3
    /// (the rest were evicted while requests ran, where a server whose G3
    /// writer falls behind may evict others: see the module docs).
    pub g3_evicted_at_restart: u64,
    /// Blocks the write-back queue dropped (over its bound).
    pub writeback_dropped: u64,
    /// Blocks the admission filter kept out of G3.
    pub admission_rejected: u64,
}
