"""The exceptions kvtier raises.

Every error from kvtier's Rust code is an instance of :class:`KvtierError`
whose message is the Rust error's message. ``path`` names the file or
directory it is about and ``tensor`` the tensor, where the error knows them
(``None`` otherwise). Classes also derive from the built-in exception a
Python caller would expect (``OSError``, ``ValueError``, ``TypeError``,
``FileNotFoundError``), so ``except OSError`` catches a failed read.

::

    KvtierError
    +-- SafetensorsFormatError (ValueError)   malformed safetensors file
    +-- ModelDirError (ValueError)            unusable model directory or index
    +-- FileChangedError                      a file changed while being read
    +-- KvtierOSError (OSError)               the OS failed a file operation
    |   +-- DiskFullError                     ENOSPC / EDQUOT during a save
    +-- CheckpointError                       manifest and shards disagree
    |   +-- NoCheckpointError (FileNotFoundError)
    |   +-- ChecksumError                     a tensor fails its crc32c
    +-- InvalidTensorError (ValueError)       a tensor that cannot be saved
    +-- UnsupportedDtypeError (TypeError)     a dtype the framework lacks
    +-- StoreError                            the KV store refused an operation

A buffer that cannot be allocated raises the built-in ``MemoryError``.
"""

from __future__ import annotations

__all__ = [
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
]


class KvtierError(Exception):
    """Base class of every kvtier error.

    Attributes:
        path: The file or directory the error is about, when known.
        tensor: The tensor the error is about, when known.
    """

    path: str | None = None
    tensor: str | None = None


class SafetensorsFormatError(KvtierError, ValueError):
    """A safetensors file is malformed: a bad length prefix or header JSON,
    offsets that overlap, leave gaps or run past the end (a truncated file),
    an unknown dtype. ``path`` names the file, ``tensor`` the tensor."""


class ModelDirError(KvtierError, ValueError):
    """A model directory cannot be loaded: its index is not valid JSON,
    names a shard that does not exist or one that lacks a tensor, points
    outside the directory, or the directory holds no safetensors file."""


class FileChangedError(KvtierError):
    """A file changed (length or header bytes) while it was being read."""


class KvtierOSError(KvtierError, OSError):
    """The operating system failed a file operation (open, read, write,
    fsync), or the path is not a regular file (a FIFO, a device).
    ``errno`` is set when the OS gave one."""


class DiskFullError(KvtierOSError):
    """The device ran out of space during a save. The save's partial files
    were removed; the previous checkpoint, if any, stays committed."""


class CheckpointError(KvtierError):
    """A checkpoint's manifest or shard files are invalid or disagree."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """The directory holds no committed checkpoint (no ``manifest.json``)."""


class ChecksumError(CheckpointError):
    """A tensor's bytes differ from the crc32c recorded when it was saved.
    ``tensor`` names it and ``path`` the shard file holding it."""


class InvalidTensorError(KvtierError, ValueError):
    """A tensor handed to :func:`kvtier.save_checkpoint` cannot be stored:
    not an array, a dtype with no safetensors name, a non-CPU tensor, a
    reserved or repeated name."""


class UnsupportedDtypeError(KvtierError, TypeError):
    """The framework asked for has no type for a tensor's dtype: numpy has
    no bfloat16 or float8 (``safetensors.numpy`` raises ``TypeError`` for
    them too); load such tensors with ``framework="pt"``."""


class StoreError(KvtierError):
    """The KV store refused an operation: its cache directory or G3 could
    not be opened, a G4 URL cannot work, memory handed to a load or save
    does not fit the blocks. (A block that is missing, corrupt or could not
    be read is not an exception: it is that block's result.)"""
