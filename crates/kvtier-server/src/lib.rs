//! kvtier-server: the OpenAI-compatible HTTP server (axum on tokio) in
//! front of the reference engine's scheduler, its KV cache in G1 pages over
//! the tiered store (G2 memory, G3 disk, G4 a shared pool).
//!
//! Entry points:
//!
//! * [`start`]: serve [`ServeOptions`] in the background; the
//!   [`RunningServer`] it returns has the bound address (port 0 picks a
//!   free one) and shuts down on [`RunningServer::shutdown`] or drop.
//! * [`run`]: what `kvtier serve` calls: [`start`], print `listening on
//!   http://ADDR` first on stdout, serve until SIGINT/SIGTERM.
//! * [`prefill()`]: compute a prompt's KV and leave it in G4 for a decode
//!   node (`kvtier prefill`).
//!
//! Inside:
//!
//! * [`routes`]: the endpoints and the router.
//! * [`openai`]: request and response bodies; [`logprobs`]: their log
//!   probabilities.
//! * [`validate`]: request checks, 4xx for every bad field; chat templates
//!   and tokenizing; [`tokenize`]: `/tokenize` and `/detokenize`.
//! * [`generate`]: one generation from async code; [`text_stream`]:
//!   incremental decoding and stop strings; [`sse_stream`]: streaming.
//! * [`api_error`]: OpenAI-style error bodies, also for extractor
//!   rejections.
//! * [`server_metrics`]: server series in the store's registry.
//! * [`app_state`]: what the handlers share.
//! * [`launch`]: model checks, engine and store assembly, binding,
//!   graceful shutdown and flush.
//!
//! ```no_run
//! let mut opts = kvtier_server::ServeOptions::new("./models/tiny");
//! opts.port = 0;
//! let server = kvtier_server::start(opts)?;
//! println!("serving on http://{}", server.addr());
//! server.shutdown()?;
//! # Ok::<(), kvtier_server::ServeError>(())
//! ```

pub mod api_error;
pub mod app_state;
pub mod auth;
pub mod conn_limits;
pub mod generate;
pub mod launch;
pub mod logprobs;
pub mod openai;
pub mod prefill;
pub mod routes;
pub mod serve_error;
pub mod serve_options;
pub mod server_metrics;
pub mod sse_stream;
pub mod text_stream;
pub mod tokenize;
pub mod validate;

pub use launch::{RunningServer, ServerSummary, ShutdownTrigger, run, start};
pub use prefill::{PrefillOptions, PrefillReport, prefill};
pub use serve_error::ServeError;
pub use serve_options::{DEFAULT_POOL_BYTES, ServeOptions, default_pool_pages};
