//! kvtier-bench: workloads, runners, gates and reports, and every
//! benchmark and probe behind the `kvtier` commands.
//!
//! What lives where:
//!
//! * [`cold_recovery`]: `kvtier bench`, the main job. Long-context sessions
//!   whose KV was computed once and then evicted come back at several
//!   concurrencies, twice: with prefix reuse off (recompute, the baseline)
//!   and on (restore from the tiers). The workload, the runner, how far a
//!   KV codec moves the answers, how much of a restore the first token
//!   still waits for, and the job's own cache directory.
//! * [`targets`]: what a benchmark drives: kvtier's engine in this
//!   process, or OpenAI-compatible endpoints (one, or a baseline and a
//!   kvtier server in one run).
//! * [`reporting`]: a run's results and their renderings (JSON, Markdown,
//!   terminal tables, SVG plots), the gates checked against them, and the
//!   sample statistics every report uses.
//! * [`store_bench`]: G3 restore against the device's read limit, and G4
//!   restore against `redis-benchmark` (`kvtier store bench`).
//! * [`models`]: cold model loads, kvtier against naive, mmap and the
//!   Python loaders (`kvtier model bench`), one kvtier load with progress
//!   (`kvtier model load`), and the synthetic models they load
//!   (`kvtier model synth`).
//! * [`checkpoint_bench`]: durable checkpoint saves against the device's
//!   write limit (`kvtier checkpoint bench`).
//! * [`replay`]: a public trace replayed against live servers, the
//!   baseline beside kvtier, across a restart (`kvtier trace replay`).
//! * [`machine`]: the machine under test: host facts and page-cache drops,
//!   `kvtier info`, the raw O_DIRECT limits, the benchmarks' scratch
//!   directories.
//! * [`common`]: what every benchmark uses: data nothing can compress,
//!   progress bars, human byte sizes.
//! * [`bench_error`]: the one error type, [`BenchError`].

pub mod cold_recovery;

pub mod targets;

pub mod reporting;

pub mod store_bench;

pub mod models;

pub mod checkpoint_bench;
pub mod replay;

pub mod machine;

pub mod common;

pub mod bench_error;

pub use bench_error::BenchError;
pub use cold_recovery::runner::{Hooks, RunOptions, run_cold_recovery};
pub use cold_recovery::workload::ColdRecoveryConfig;
pub use reporting::gates::Gates;
pub use reporting::report::{BenchReport, Mode, RunSummary};
pub use reporting::text_report::TextReport;
