//! What a benchmark drives: the in-process engine, or an OpenAI-compatible
//! endpoint.

use crate::bench_error::BenchError;
use crate::cold_recovery::workload::Session;
use crate::reporting::report::{Mode, RequestRecord};

/// A system under test.
pub trait Target: Sync {
    /// One line naming it.
    fn describe(&self) -> String;
    /// Length of `text` in the target's tokens.
    fn count_tokens(&self, text: &str) -> usize;
    /// Prepares a run in `mode`: baseline turns prefix reuse off, kvtier
    /// turns it on; both drop G1 (and kvtier G2 too when `evict_g2`) so the
    /// run starts cold. Targets that cannot switch modes return an error.
    fn begin(&mut self, mode: Mode, evict_g2: bool) -> Result<(), BenchError>;
    /// Serves one request; called from many client threads at once.
    fn request(&self, session: &Session, max_tokens: usize) -> RequestRecord;
    /// Ends a run (and, after pass 1, makes sure every block was stored).
    fn end(&mut self) -> Result<(), BenchError>;
    /// The G3 I/O mode, for the report.
    fn io_mode(&self) -> String;
    /// How the target's store keeps KV: the codec's name and the engine's
    /// bytes per stored byte ("unknown" and 1 where the target cannot
    /// say).
    fn kv_form(&self) -> (String, f64) {
        ("unknown".into(), 1.0)
    }
    /// True when [`begin`](Self::begin) really drops what it says (an
    /// endpoint's server is run as it is): only then can a session be
    /// restored again on purpose.
    fn drops_prefixes(&self) -> bool {
        false
    }
}
