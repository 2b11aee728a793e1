//! Real traffic, simulated: public KV-cache traces read into one event
//! stream, their statistics, a tier simulator that drives kvtier-store's own
//! eviction policies beside the offline optimum, and a planner that turns
//! hit rates into tier sizes, TTFT, energy and cost.
//!
//! * [`trace`]: the common event stream ([`Trace`], [`Request`]) and
//!   [`read`], which picks a reader by [`Format`].
//! * [`format`]: one reader per trace format.
//! * [`stats`]: what `kvtier trace stats` prints.
//! * [`prefix`]: a trace's blocks as nodes of one prefix tree.
//! * [`model_kv`]: KV bytes per token of a model (config.json or preset).
//! * [`sim`]: `kvtier trace sim`.
//! * [`belady`]: the offline optimum (Belady with bypass).
//! * [`plot`]: hit rate against capacity, as SVG.
//! * [`plan`]: `kvtier plan`, tiers sized for a trace, model and machine.
//! * [`prompts`]: token-id prompts from block ids, for a live replay.
//! * [`server_sim`]: what `kvtier serve` itself caches, per request and
//!   tier, token-exact at concurrency 1 (what a live replay is checked
//!   against).
//! * [`sample`]: a share of a trace's conversations, each kept whole.

pub mod belady;
pub mod format;
pub mod model_kv;
pub mod plan;
pub mod plot;
pub mod prefix;
pub mod prompts;
pub mod sample;
pub mod server_sim;
pub mod sim;
pub mod stats;
pub mod trace;
mod trace_error;

pub use server_sim::{ServerShape, ServerSim, TierHits};
pub use trace::{Format, Request, Trace, read};
pub use trace_error::TraceError;
