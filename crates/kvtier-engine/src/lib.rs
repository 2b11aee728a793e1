//! kvtier-engine: a reference inference engine whose KV cache lives in a
//! paged pool (G1) backed by kvtier's tiered store.
//!
//! What lives where, in the order a request meets it:
//!
//! * [`model_dir`]: a model directory and what is read from it: the
//!   config ([`model_dir::model_config`]), its bounded small files
//!   ([`model_dir::model_files`]), the weights loaded through kvtier-io
//!   ([`model_dir::weights`]) and checked ([`model_dir::weight_check`]),
//!   and the embedded default models ([`model_dir::preset`]).
//! * [`text`]: text as `transformers` tokenizes and templates it
//!   ([`text::tokenizer`], [`text::chat_template`]).
//! * [`serving`]: the engine (sequences, the batched step, offload to the
//!   store: [`serving::engine`]), the scheduler that serves many requests
//!   from one thread ([`serving::scheduler`]) and token choice
//!   ([`serving::sampling`]).
//! * [`kv`]: G1 and the store below it: the page pool ([`kv::kv_pool`]),
//!   its prefix index ([`kv::prefix_cache`]), prefixes restored from the
//!   store without waiting on it ([`kv::prefix_restore`]) and layer by
//!   layer ([`kv::layer_restore`]).
//! * [`forward`]: the forward pass over paged KV ([`forward::model`], its
//!   hand-written decode step in `forward/model/decode.rs`), prefill
//!   attention ([`forward::attention`]) and rotary embeddings
//!   ([`forward::rope`]).
//! * [`compute`]: where and how the arithmetic runs: the device and the
//!   host's threads and allocator ([`compute::device`]), the decode step's
//!   thread pool ([`compute::parallel`]), and the hand-written kernels
//!   ([`compute::gemv`], [`compute::softmax`]).
//! * [`engine_error`]: the one error type, [`EngineError`].

pub mod model_dir;
pub mod text;

pub mod serving;

pub mod kv;

pub mod forward;

pub mod compute;
pub mod engine_error;

#[cfg(feature = "cuda")]
pub use compute::device::cuda_stream;
pub use compute::device::{fix_cpu_threads, open_device, tune_host_allocator};
pub use engine_error::EngineError;
pub use kv::prefix_restore::Attached;
pub use kvtier_store::TierTokens;
pub use model_dir::model_config::ModelConfig;
pub use model_dir::preset::{Preset, write_preset};
pub use serving::engine::{
    DEFAULT_RESTORE_YIELD, Engine, EngineOptions, Prefill, SeqId, Step, StoreOptions,
};
