//! kvtier-bench: workloads, runners, gates and reports.
//!
//! The `cold-recovery` workload replays long-context sessions whose KV was
//! computed once and then evicted, at several concurrencies, twice: with
//! prefix reuse off (recompute, the baseline) and on (restore from the
//! tiers). It reports TTFT percentiles, throughput, restore bandwidth, energy
//! and cost per token, kvtier/baseline ratios, and gate verdicts.

pub mod endpoint;
pub mod error;
pub mod gates;
pub mod inproc;
pub mod plot;
pub mod report;
pub mod runner;
pub mod stats;
pub mod target;
pub mod workload;

pub use error::BenchError;
pub use gates::Gates;
pub use report::{BenchReport, Mode, RunSummary};
pub use runner::{Hooks, RunOptions, run_cold_recovery};
pub use workload::ColdRecoveryConfig;
