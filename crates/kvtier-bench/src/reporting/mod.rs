//! A run's results, their renderings, and the checks against them.
//!
//! * [`report`]: a cold-recovery run's results: JSON (the contract other
//!   tools read), Markdown and a terminal table.
//! * [`run_summary`]: one run (baseline or kvtier), its requests and the
//!   kvtier / baseline ratios.
//! * [`gates`]: pass/fail criteria checked before a run is reported.
//! * [`plot`]: a report's SVG plots.
//! * [`report_table`]: one table, rendered as aligned text or Markdown.
//! * [`text_report`]: the human-readable form every benchmark report has.
//! * [`stats`]: percentiles, medians and paired fractions of samples.

pub mod report;
pub mod run_summary;

pub mod gates;
pub mod plot;
pub mod report_table;
pub mod text_report;

pub mod stats;
