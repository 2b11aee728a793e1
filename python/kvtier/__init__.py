"""kvtier: the storage path for LLM inference, from Python.

* :func:`load_safetensors`: a safetensors file or a sharded model directory
  through kvtier's parallel direct-I/O weight loader, as numpy arrays or
  torch tensors (views of the loaded bytes, no copy).
* :func:`save_checkpoint` / :func:`load_checkpoint`: crash-safe checkpoints
  (atomic commit, a crc32c per tensor, verified on load).
* :mod:`kvtier.errors`: the exceptions, all subclasses of
  :class:`KvtierError`, carrying the Rust error's message.

The KV store binding (``kvtier.Store``) is not part of this release yet.
"""

from __future__ import annotations

from . import errors
from ._kvtier import __version__
from .checkpoint import CheckpointInfo, load_checkpoint, save_checkpoint
from .errors import (
    CheckpointError,
    ChecksumError,
    DiskFullError,
    FileChangedError,
    InvalidTensorError,
    KvtierError,
    KvtierOSError,
    ModelDirError,
    NoCheckpointError,
    SafetensorsFormatError,
    UnsupportedDtypeError,
)
from .loader import load_safetensors

# kvtier.Store (the KV store binding) is added here by its own module.

__all__ = [
    "__version__",
    "errors",
    "load_safetensors",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointInfo",
    "KvtierError",
    "SafetensorsFormatError",
    "ModelDirError",
    "FileChangedError",
    "KvtierOSError",
    "DiskFullError",
    "CheckpointError",
    "NoCheckpointError",
    "ChecksumError",
    "InvalidTensorError",
    "UnsupportedDtypeError",
]
