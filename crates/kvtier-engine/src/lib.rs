//! kvtier-engine: a reference inference engine whose KV cache lives in a
//! paged pool (G1) backed by kvtier's tiered store.
//!
//! * [`model_config`]: `config.json` of Llama / Qwen2 / Mistral models.
//! * [`weights`]: loading through kvtier-io's parallel loader.
//! * [`model`], [`attention`], [`rope`]: the forward pass over paged KV;
//!   [`gemv`]: its decode-step projections, hand-written; [`softmax`]: the
//!   prefill chunks' causal softmax, hand-written.
//! * [`kv_pool`], [`prefix_cache`]: G1 pages and their prefix index.
//! * [`engine`]: sequences, the batched step (decode and prefill chunks),
//!   offload to the store; [`prefix_restore`]: restoring prefixes from the
//!   store without waiting on it; [`layer_restore`]: layer by layer, the
//!   forward pass waiting only for the layer it is at.
//! * [`tokenizer`], [`chat_template`], [`sampling`], [`preset`]: text as
//!   `transformers` tokenizes and templates it, token choice, and the
//!   embedded default models.

pub mod attention;
pub mod chat_template;
pub mod device;
pub mod engine;
pub mod engine_error;
pub mod gemv;
pub mod kv_pool;
pub mod layer_restore;
pub mod model;
pub mod model_config;
pub mod model_files;
pub mod parallel;
pub mod prefix_cache;
pub mod prefix_restore;
pub mod preset;
pub mod rope;
pub mod sampling;
pub mod scheduler;
pub mod softmax;
pub mod tokenizer;
pub mod weight_check;
pub mod weights;

#[cfg(feature = "cuda")]
pub use device::cuda_stream;
pub use device::{fix_cpu_threads, open_device, tune_host_allocator};
pub use engine::{
    CachedTokens, DEFAULT_RESTORE_YIELD, Engine, EngineOptions, Prefill, SeqId, Step, StoreOptions,
};
pub use engine_error::EngineError;
pub use model_config::ModelConfig;
pub use prefix_restore::Attached;
pub use preset::{Preset, write_preset};
