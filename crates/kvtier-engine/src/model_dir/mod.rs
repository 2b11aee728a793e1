//! A model directory and what the engine reads from it.
//!
//! * [`model_config`]: `config.json` of Llama / Qwen2 / Mistral / Qwen3 /
//!   Phi-3 models, its ranges and the memory it implies.
//! * [`model_files`]: the directory's small files, read only when regular
//!   and bounded.
//! * [`weights`]: the weights, loaded through kvtier-io's parallel loader.
//! * [`weight_check`]: NaN, infinite and all-zero weights refused as they
//!   load.
//! * [`preset`]: the embedded default models, written as model directories.

pub mod model_config;
pub mod model_files;
pub mod weights;

pub mod weight_check;

pub mod preset;
