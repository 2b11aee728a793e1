//! Model weights: loaded by kvtier-io's parallel direct-I/O loader, turned
//! into candle tensors, and checked against the shapes the config implies.
//!
//! On CPU every weight becomes f32 (candle's bf16 CPU path is several times
//! slower); bf16 and f16 checkpoints are converted once at load.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use kvtier_io::loader::{LoadStats, LoaderConfig, load_model_dir};
use kvtier_io::safetensors::Dtype;
use kvtier_store::ModelFingerprint;

use crate::engine_error::EngineError;
use crate::model_dir::model_files::{CONFIG_MAX_BYTES, read_bounded};
use crate::model_dir::weight_check::check_tensor;

/// Named weights waiting to be taken by the model builder.
#[derive(Debug)]
pub struct Weights {
    tensors: HashMap<String, (Tensor, PathBuf)>,
    /// xxh3-128 of every shard's bytes, in shard order.
    digest: Vec<u8>,
    /// How the load went.
    pub stats: LoadStats,
}

fn candle_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::Bf16 => DType::BF16,
        Dtype::F64 => DType::F64,
        _ => return None,
    })
}

impl Weights {
    /// Loads every tensor of the model in `dir` onto `device` as `dtype`.
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<Self, EngineError> {
        let (shards, stats) = load_model_dir(dir, &LoaderConfig::default())
            .map_err(|e| EngineError::Weights(e.to_string()))?;
        let mut tensors = HashMap::new();
        let mut digest = Vec::with_capacity(16 * shards.len());
        for shard in &shards {
            digest
                .extend_from_slice(&xxhash_rust::xxh3::xxh3_128(shard.file_bytes()).to_le_bytes());
            for view in shard.tensors() {
                let Some(src) = candle_dtype(view.dtype) else {
                    return Err(EngineError::Weights(format!(
                        "{}: tensor {} has dtype {} (floating point expected)",
                        shard.path().display(),
                        view.name,
                        view.dtype.as_str()
                    )));
                };
                check_tensor(view.name, view.dtype, view.data).map_err(|msg| {
                    EngineError::Weights(format!("{}: {msg}", shard.path().display()))
                })?;
                let t =
                    Tensor::from_raw_buffer(view.data, src, view.shape, device)?.to_dtype(dtype)?;
                tensors.insert(view.name.to_string(), (t, shard.path().to_path_buf()));
            }
        }
        Ok(Self {
            tensors,
            digest,
            stats,
        })
    }

    /// The model's fingerprint: `dir/config.json` and every weight byte.
    pub fn fingerprint(&self, dir: &Path) -> Result<ModelFingerprint, EngineError> {
        let config = read_bounded(&dir.join("config.json"), CONFIG_MAX_BYTES)?;
        Ok(model_fingerprint(&config, &self.digest))
    }

    /// True when `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Removes and returns `name`, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor, EngineError> {
        let (t, path) = self.tensors.remove(name).ok_or_else(|| {
            EngineError::Weights(format!("tensor {name} is missing from the model files"))
        })?;
        if t.dims() != shape {
            return Err(EngineError::Weights(format!(
                "{}: tensor {name} has shape {:?}, the config implies {shape:?}",
                path.display(),
                t.dims()
            )));
        }
        Ok(t)
    }

    /// Names not taken by the model (reported, not an error).
    pub fn leftover(&self) -> Vec<&str> {
        self.tensors.keys().map(String::as_str).collect()
    }
}

/// The fingerprint of a model: its config and every weight byte, so KV of a
/// model with the same shapes but other weights never matches.
pub fn model_fingerprint(config_json: &[u8], weights_digest: &[u8]) -> ModelFingerprint {
    let mut bytes = Vec::with_capacity(config_json.len() + weights_digest.len());
    bytes.extend_from_slice(config_json);
    bytes.extend_from_slice(weights_digest);
    ModelFingerprint::of_bytes(&bytes)
}
