//! Errors of the weight loader.

use std::io;
use std::path::PathBuf;

use crate::buffer::AllocError;
use crate::safetensors::SafetensorsError;

/// Why a model or shard could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A shard's header is invalid (the error names the file and tensor).
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    /// Opening, reading or listing failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The index names a shard file that does not exist.
    #[error("{}: shard {shard:?} named in the index does not exist", index.display())]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The shard's name as written in the index.
        shard: String,
    },
    /// The index file is not valid.
    #[error("{}: invalid index: {msg}", path.display())]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// The index maps a tensor to a shard that does not hold it.
    #[error("{}: the index puts tensor {tensor:?} in {shard:?}, which does not hold it", index.display())]
    TensorNotInShard {
        /// The index file.
        index: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shard the index names.
        shard: String,
    },
    /// A directory holds no safetensors files.
    #[error("{}: no model.safetensors.index.json, model.safetensors or *.safetensors", dir.display())]
    NoShards {
        /// The directory.
        dir: PathBuf,
    },
    /// A shard changed while it was being loaded (its length or header
    /// bytes differ from what was validated).
    #[error("{}: file changed while loading: {msg}", path.display())]
    Changed {
        /// The shard.
        path: PathBuf,
        /// What differs.
        msg: String,
    },
    /// The shard buffer could not be allocated.
    #[error("cannot allocate a shard buffer: {0}")]
    Alloc(#[from] AllocError),
    /// The device a staged load copies into failed.
    #[error("{device}: {msg}")]
    Device {
        /// The device, e.g. "cuda:0".
        device: String,
        /// What failed.
        msg: String,
    },
    /// The [`LoaderConfig`](super::LoaderConfig) is unusable.
    #[error("invalid loader config: {0}")]
    BadConfig(String),
}
