//! `kvtier bench`, the main job: the cold-recovery workload run twice,
//! recomputing (baseline) and restoring from the tiers (kvtier).
//!
//! * [`main_job`]: the job as `kvtier bench` runs it (in-process engine or
//!   endpoints, device-limit hooks, report files and plots).
//! * [`workload`]: the sessions: long prompts of a shared system prompt,
//!   each session's own history and a short question.
//! * [`runner`]: runs the workload against a target and builds the report.
//! * [`accuracy`]: what a restore (with a KV codec) does to the answers,
//!   against a recompute.
//! * [`overlap`]: how much of a restore the first token still waits for.
//! * [`bench_dir`]: the job's `--cache-dir`, cleared only when its own.

pub mod main_job;

pub mod workload;

pub mod runner;

pub mod accuracy;
pub mod overlap;

pub mod bench_dir;
