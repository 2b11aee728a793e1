"""Crash-safe checkpoints: saving tensors durably and loading them verified."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from . import _arrays, _kvtier
from ._arrays import Framework

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CheckpointInfo:
    """What a committed :func:`save_checkpoint` did."""

    #: The generation committed: 1 for a directory's first save, then +1.
    generation: int
    #: Bytes made durable: the shard files' total length.
    bytes: int
    #: Bytes of tensor data.
    tensor_bytes: int
    #: The shard files written, in order.
    files: tuple[str, ...]
    #: Seconds from the call to the commit.
    seconds: float
    #: True when the files were written with ``O_DIRECT``.
    direct: bool
    #: Why the writes were buffered, when they were.
    direct_reason: str | None
    #: Bytes written straight from the caller's arrays, with no copy.
    borrowed_bytes: int


def save_checkpoint(
    # numpy arrays or torch tensors (torch is optional: not named here).
    tensors: Mapping[str, Any],
    dir: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
    shard_bytes: int | None = None,
    direct: bool = True,
) -> CheckpointInfo:
    """Save ``tensors`` as a new checkpoint generation in ``dir``, durably.

    Returns once the new generation is committed and on disk. The commit is
    atomic: the tensors go into new safetensors shard files, which are
    fsynced; then ``manifest.json`` (every tensor's shard, dtype, shape,
    offsets and crc32c) is written to a temporary name, fsynced and renamed
    over the old one, and the directory fsynced. Only then are the previous
    generation's files deleted. A crash or ``SIGKILL`` at any moment leaves
    the old checkpoint or the new one loadable, never a mix; an error
    (a full disk included) leaves the previous checkpoint committed. Two
    saves to one directory never interleave (a lock file).

    The tensors are written from their own memory with the GIL released; do
    not change them from another thread while the save runs. Contiguous
    inputs are not copied; a non-contiguous array or tensor is first copied
    into a contiguous one (the files hold row-major bytes), as is a
    big-endian numpy array (into little endian).

    Args:
        tensors: Name -> ``numpy.ndarray`` or CPU ``torch.Tensor`` (any
            dtype with a safetensors name: bool, (u)int8-64, float16/32/64,
            and for torch also bfloat16 and float8 e4m3fn/e5m2).
        dir: The checkpoint directory (created if missing).
        metadata: Strings stored in the manifest and in every shard's
            ``__metadata__``.
        shard_bytes: Target bytes of tensor data per shard file (default
            2 GiB); a tensor is never split across files.
        direct: Use ``O_DIRECT`` where the directory accepts it.

    Returns:
        What the save did.

    Raises:
        InvalidTensorError: A value is not a numpy array or a CPU tensor,
            its dtype has no safetensors name, or its name is reserved
            (``__metadata__``, ``__kvtier_pad_*``).
        DiskFullError: The device ran out of space.
        KvtierOSError: Another file-system call failed.
    """
    arrays = _arrays.to_arrays(tensors)
    meta = dict(metadata or {})
    info = _kvtier.save_checkpoint(os.fspath(dir), arrays, meta, shard_bytes, direct)
    return CheckpointInfo(
        generation=info["generation"],
        bytes=info["bytes"],
        tensor_bytes=info["tensor_bytes"],
        files=tuple(str(f) for f in info["files"]),
        seconds=info["seconds"],
        direct=info["direct"],
        direct_reason=info["direct_reason"],
        borrowed_bytes=info["borrowed_bytes"],
    )


@overload
def load_checkpoint(
    dir: str | os.PathLike[str], framework: Literal["numpy", "np"] = "numpy", *, verify: bool = True
) -> dict[str, np.ndarray[Any, Any]]: ...
@overload
def load_checkpoint(
    dir: str | os.PathLike[str], framework: Literal["pt", "torch"], *, verify: bool = True
) -> dict[str, torch.Tensor]: ...
def load_checkpoint(
    dir: str | os.PathLike[str],
    framework: Framework = "numpy",
    *,
    verify: bool = True,
) -> dict[str, np.ndarray[Any, Any]] | dict[str, torch.Tensor]:
    """Load the committed checkpoint in ``dir``, every tensor verified.

    Reads ``manifest.json``, checks each shard file's length and header
    against it, reads the shards with kvtier's parallel loader (GIL
    released) and compares every tensor's crc32c with the manifest. Files
    of an uncommitted generation (a save that crashed) are ignored. The
    arrays are views of the loaded shard buffers, as with
    :func:`kvtier.load_safetensors`.

    Args:
        dir: The checkpoint directory.
        framework: ``"numpy"``/``"np"`` or ``"pt"``/``"torch"``.
        verify: Check every tensor's crc32c (default True).

    Returns:
        Tensor name -> array or tensor, in the order they were saved.

    Raises:
        NoCheckpointError: ``dir`` holds no committed checkpoint.
        ChecksumError: A tensor's bytes differ from their recorded crc32c;
            the error names the tensor and the shard file.
        CheckpointError: The manifest or a shard is invalid or disagrees
            with the other.
        SafetensorsFormatError: A shard file is malformed.
        UnsupportedDtypeError: With ``framework="numpy"``, a tensor is
            bfloat16 or float8.
        KvtierOSError: A file cannot be read.
    """
    fw = _arrays.framework_name(framework)
    buffers, spans, _generation, _metadata = _kvtier.load_checkpoint(os.fspath(dir), verify)
    return _arrays.build(buffers, spans, fw)
