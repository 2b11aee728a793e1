//! Real traffic, simulated: public KV-cache traces read into one event
//! stream, their statistics, a tier simulator that drives kvtier-store's own
//! eviction policies beside the offline optimum, and a planner that turns
//! hit rates into tier sizes, TTFT, energy and cost.
//!
//! What lives where:
//!
//! * Reading traces
//!   * [`trace`]: the common event stream ([`Trace`], [`Request`]) and
//!     [`read`], which picks a reader by [`Format`].
//!   * [`format`](mod@format): one reader per trace format.
//!   * [`prefix`]: a trace's blocks as nodes of one prefix tree.
//!   * [`stats`]: what `kvtier trace stats` prints.
//! * Simulating tiers
//!   * [`sim`]: `kvtier trace sim`, the store's policies at each capacity.
//!   * [`belady`]: the offline optimum (Belady with bypass).
//!   * [`plot`]: hit rate against capacity, as SVG.
//! * Planning
//!   * [`model_kv`]: KV bytes per token of a model (config.json or preset).
//!   * [`plan`]: `kvtier plan`, tiers sized for a trace, model and machine.
//! * The live replay's inputs and its check
//!   * [`prompts`]: token-id prompts from block ids.
//!   * [`sample`]: a share of a trace's conversations, each kept whole.
//!   * [`server_sim`]: what `kvtier serve` itself caches, per request and
//!     tier, token-exact at concurrency 1 (what a live replay is checked
//!     against).
//! * Errors: `trace_error.rs` ([`TraceError`]).

// Reading traces.
pub mod trace;

pub mod format;
pub mod prefix;
pub mod stats;

// Simulating tiers.
pub mod sim;

pub mod belady;
pub mod plot;

// Planning.
pub mod model_kv;
pub mod plan;

// The live replay's inputs and its check.
pub mod prompts;
pub mod sample;
pub mod server_sim;

// Errors.
mod trace_error;

pub use server_sim::{ServerShape, ServerSim, TierTokens};
pub use trace::{Format, Request, Trace, read};
pub use trace_error::TraceError;
