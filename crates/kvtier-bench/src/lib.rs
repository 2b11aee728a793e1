//! kvtier-bench: workloads, runners, gates and reports, and every
//! benchmark and probe behind the `kvtier` commands.
//!
//! The `cold-recovery` workload replays long-context sessions whose KV was
//! computed once and then evicted, at several concurrencies, twice: with
//! prefix reuse off (recompute, the baseline) and on (restore from the
//! tiers). It reports TTFT percentiles, throughput, restore bandwidth, energy
//! and cost per token, kvtier/baseline ratios, and gate verdicts
//! ([`runner`], [`workload`], [`report`]), with a KV codec how far the
//! restored answers move from recomputed ones ([`accuracy`]), and how much
//! of a restore the first token still waits for ([`overlap`]); [`main_job`]
//! assembles it as
//! `kvtier bench` runs it (in-process engine, device-limit hooks, report
//! files and plots).
//!
//! Benchmarks against the device, each with its own options and report:
//!
//! * [`store_bench`]: G3 restore vs the device's read limit, and
//!   ([`store_bench::g4`]) G4 restore vs `redis-benchmark`.
//! * [`model_bench`]: cold model loads, kvtier against naive, mmap and the
//!   Python loaders; [`model_load`]: one kvtier load with progress;
//!   [`model_synth`]: the synthetic models they load.
//! * [`checkpoint_bench`]: durable checkpoint saves against the device's
//!   write limit.
//! * [`replay`]: a public trace replayed against live servers, the
//!   baseline beside kvtier, across a restart (`kvtier trace replay`).
//!
//! Shared pieces: [`device_limit`] (the raw O_DIRECT limits), [`host`] and
//! [`host_info`] (machine facts, page-cache drops), [`bench_dir`] (the
//! main job's cache dir, cleared only when its own), [`run_dirs`],
//! [`stats`], [`size`], [`fill`], [`progress`], and [`TextReport`], the
//! table every report prints.

pub mod accuracy;
pub mod bench_dir;
pub mod bench_error;
pub mod checkpoint_bench;
/// The raw O_DIRECT limits, from kvtier-io (the Python package measures
/// them too).
pub use kvtier_io::device_limit;
pub mod endpoint;
pub mod endpoint_pair;
pub mod fill;
pub mod gates;
pub mod host;
pub mod host_info;
pub mod inproc;
pub mod main_job;
pub mod model_bench;
pub mod model_load;
pub mod model_synth;
pub mod overlap;
pub mod plot;
pub mod progress;
pub mod replay;
pub mod report;
pub mod report_table;
pub mod run_dirs;
pub mod run_summary;
pub mod runner;
pub mod size;
pub mod stats;
pub mod store_bench;
pub mod target;
pub mod text_report;
pub mod workload;

pub use bench_error::BenchError;
pub use gates::Gates;
pub use report::{BenchReport, Mode, RunSummary};
pub use runner::{Hooks, RunOptions, run_cold_recovery};
pub use text_report::TextReport;
pub use workload::ColdRecoveryConfig;
