//! Two OpenAI-compatible servers compared in one run
//! (`kvtier bench --endpoint URL --baseline-endpoint URL2`): baseline runs
//! go to the baseline server (say vLLM alone), kvtier runs and the filling
//! pass to the kvtier server (say vLLM with kvtier's connector, or
//! `kvtier serve`). Same sessions, same client, same timing code
//! ([`Endpoint`]); neither server is switched or evicted from here.

use crate::bench_error::BenchError;
use crate::cold_recovery::workload::Session;
use crate::reporting::report::{Mode, RequestRecord};
use crate::targets::endpoint::Endpoint;
use crate::targets::target::Target;

/// A baseline server and a kvtier server behind one [`Target`].
pub struct EndpointPair {
    baseline: Endpoint,
    kvtier: Endpoint,
    active: Mode,
}

impl EndpointPair {
    /// Pairs two endpoints (each already checked reachable by
    /// [`Endpoint::new`]).
    pub fn new(baseline: Endpoint, kvtier: Endpoint) -> Self {
        EndpointPair {
            baseline,
            kvtier,
            active: Mode::Kvtier,
        }
    }

    fn active(&self) -> &Endpoint {
        match self.active {
            Mode::Baseline => &self.baseline,
            Mode::Kvtier => &self.kvtier,
        }
    }
}

impl Target for EndpointPair {
    fn describe(&self) -> String {
        format!(
            "two OpenAI-compatible endpoints: baseline {} (model {}), kvtier {} (model {}); served as-is",
            self.baseline.base_url(),
            self.baseline.model(),
            self.kvtier.base_url(),
            self.kvtier.model()
        )
    }

    fn count_tokens(&self, text: &str) -> usize {
        self.kvtier.count_tokens(text)
    }

    /// Chooses the server of `mode`; changes nothing on either.
    fn begin(&mut self, mode: Mode, evict_g2: bool) -> Result<(), BenchError> {
        self.active = mode;
        match mode {
            Mode::Baseline => self.baseline.begin(mode, evict_g2),
            Mode::Kvtier => self.kvtier.begin(mode, evict_g2),
        }
    }

    fn request(&self, session: &Session, max_tokens: usize) -> RequestRecord {
        self.active().request(session, max_tokens)
    }

    fn end(&mut self) -> Result<(), BenchError> {
        match self.active {
            Mode::Baseline => self.baseline.end(),
            Mode::Kvtier => self.kvtier.end(),
        }
    }

    fn io_mode(&self) -> String {
        self.kvtier.io_mode()
    }
}
