"""kvtier: the storage path for LLM inference, from Python.

* :func:`load_safetensors`: a safetensors file or a sharded model directory
  through kvtier's parallel direct-I/O weight loader, as numpy arrays or
  torch tensors (views of the loaded bytes, no copy).
* :func:`save_checkpoint` / :func:`load_checkpoint`: crash-safe checkpoints
  (atomic commit, a crc32c per tensor, verified on load).
* :class:`Store`: the tiered KV store (G2 memory, G3 disk, G4 pool) for
  engines that keep their own KV pages: namespaces per model and
  :class:`Layout`, loads and saves in place with a :class:`Transfer` handle
  and a :class:`BlockResult` per block.
* :mod:`kvtier.errors`: the exceptions, all subclasses of
  :class:`KvtierError`, carrying the Rust error's message.
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
    StoreError,
    UnsupportedDtypeError,
)
from .loader import load_safetensors
from .store import BlockHash, BlockResult, Layout, Namespace, Store, Transfer

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
    "StoreError",
    "Store",
    "Namespace",
    "Layout",
    "Transfer",
    "BlockResult",
    "BlockHash",
]
