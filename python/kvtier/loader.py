"""Loading safetensors weights through kvtier's parallel direct-I/O loader."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from . import _arrays, _kvtier
from ._arrays import Framework

if TYPE_CHECKING:
    import torch


@overload
def load_safetensors(
    path: str | os.PathLike[str], framework: Literal["numpy", "np"] = "numpy"
) -> dict[str, np.ndarray[Any, Any]]: ...
@overload
def load_safetensors(path: str | os.PathLike[str], framework: Literal["pt", "torch"]) -> dict[str, torch.Tensor]: ...
def load_safetensors(
    path: str | os.PathLike[str], framework: Framework = "numpy"
) -> dict[str, np.ndarray[Any, Any]] | dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file or of a model directory.

    ``path`` is a ``.safetensors`` file, or a directory holding a sharded
    model (``model.safetensors.index.json`` names the shards; without one,
    ``model.safetensors``, else every ``*.safetensors`` file). The result
    holds the same tensors (names, dtypes, shapes, values) as
    ``safetensors.numpy.load_file`` / ``safetensors.torch.load_file`` (for a
    directory: as those of every shard together), keyed by name, in file
    order, shard by shard.

    Every header is validated before any data is read; the files are then
    read whole, in large reads kept in flight together, with ``O_DIRECT``
    where the file system takes it, straight into one buffer per file, with
    the GIL released. The arrays are views of those buffers (no copy); a
    file's memory is freed when its last tensor is. They are writable.

    Args:
        path: A safetensors file or a model directory.
        framework: ``"numpy"`` (or ``"np"``) for ``numpy.ndarray`` values,
            ``"pt"`` (or ``"torch"``) for CPU ``torch.Tensor`` values.

    Returns:
        Tensor name -> array or tensor.

    Raises:
        UnsupportedDtypeError: With ``framework="numpy"``, a tensor is
            bfloat16 or float8, which numpy has no dtype for (a
            ``TypeError``, as ``safetensors.numpy`` raises).
        SafetensorsFormatError: A file is malformed (truncated, bad header,
            bad offsets); the error names the file and the tensor.
        ModelDirError: The directory's index is invalid or names a missing
            shard, or the directory has no safetensors file.
        KvtierOSError: A file cannot be opened or read, or is not a regular
            file (a FIFO, a device).
        ValueError: ``framework`` is not one of the above.
    """
    fw = _arrays.framework_name(framework)
    buffers, spans = _kvtier.load_safetensors(os.fspath(path))
    return _arrays.build(buffers, spans, fw)
