//! Model loads: the benchmark, one load, the models they load.
//!
//! * [`model_bench`]: `kvtier model bench`, cold loads by every contender
//!   against the device's read limit.
//! * [`model_load`]: `kvtier model load`, one load with the kvtier loader.
//! * [`model_synth`]: `kvtier model synth`, synthetic sharded safetensors
//!   models to load.

pub mod model_bench;
pub mod model_load;
pub mod model_synth;
