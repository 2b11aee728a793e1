//! The checkpoint writer's and loader's typed errors.

use std::io;
use std::path::{Path, PathBuf};

use crate::buffer::AllocError;
use crate::loader::LoadError;
use crate::safetensors::SafetensorsError;

/// Why a checkpoint could not be saved or loaded.
///
/// Every variant names the file, directory or tensor it is about.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A tensor handed to `save` cannot be stored as given.
    #[error("invalid tensor {name:?}: {reason}")]
    InvalidTensor {
        /// The tensor.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A [`SaveOptions`](super::options::SaveOptions) value is out of range.
    #[error("invalid save options: {0}")]
    InvalidOptions(String),
    /// A file-system call failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done ("create", "write", "fsync", ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The device ran out of space (ENOSPC or EDQUOT) during a save. The
    /// save's partial files were removed; the previous checkpoint, if any,
    /// was not touched and stays the committed one.
    #[error(
        "disk full: {op} {} failed ({source}); generation {generation} ({needed} bytes) was abandoned and its partial files removed; {}",
        path.display(),
        previous_note(*previous)
    )]
    DiskFull {
        /// What was being done when space ran out.
        op: &'static str,
        /// The file being written.
        path: PathBuf,
        /// The generation that was being written.
        generation: u64,
        /// Bytes the new generation's shard files needed.
        needed: u64,
        /// The committed generation that stays in place, if any.
        previous: Option<u64>,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The directory holds no committed checkpoint (`manifest.json` is missing).
    #[error("no checkpoint in {}: {} does not exist", dir.display(), dir.join(super::options::MANIFEST_FILE).display())]
    NoCheckpoint {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// `manifest.json` is unreadable or inconsistent.
    #[error("bad checkpoint manifest {}: {reason}", path.display())]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A shard file does not match what the manifest says about it.
    #[error("checkpoint shard {}: {reason}", path.display())]
    Shard {
        /// The shard file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// A tensor's bytes do not match the crc32c recorded in the manifest.
    #[error(
        "checksum mismatch in tensor {name:?} (shard {}): manifest crc32c {expected:#010x}, data crc32c {actual:#010x}",
        path.display()
    )]
    Checksum {
        /// The tensor.
        name: String,
        /// The shard file holding it.
        path: PathBuf,
        /// The checksum recorded at save time.
        expected: u32,
        /// The checksum of the bytes loaded.
        actual: u32,
    },
    /// Encoding a shard's safetensors header failed.
    #[error("encoding the safetensors header of shard {shard}: {source}")]
    Header {
        /// Index of the shard (0-based).
        shard: usize,
        /// The encoder's error.
        #[source]
        source: SafetensorsError,
    },
    /// The shard loader failed.
    #[error("loading the shards of checkpoint generation {generation} in {}: {source}", dir.display())]
    Load {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The generation being loaded.
        generation: u64,
        /// The loader's error.
        #[source]
        source: LoadError,
    },
    /// A host buffer could not be allocated.
    #[error("checkpoint buffer: {0}")]
    Alloc(#[from] AllocError),
    /// The background thread of an asynchronous save panicked; nothing was
    /// committed by it.
    #[error("the background save thread for {} panicked", dir.display())]
    BackgroundPanic {
        /// The checkpoint directory.
        dir: PathBuf,
    },
}

fn previous_note(previous: Option<u64>) -> String {
    match previous {
        Some(g) => format!("the previous checkpoint (generation {g}) is still in place"),
        None => "there was no previous checkpoint".to_string(),
    }
}

impl CheckpointError {
    /// An [`CheckpointError::Io`] for `op` on `path`.
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        CheckpointError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }

    /// True for errors that mean the device is out of space.
    pub fn is_disk_full(&self) -> bool {
        match self {
            CheckpointError::DiskFull { .. } => true,
            CheckpointError::Io { source, .. } => is_enospc(source),
            _ => false,
        }
    }
}

/// ENOSPC or EDQUOT.
pub(crate) fn is_enospc(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}
