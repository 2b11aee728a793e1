"""Type stubs of the native module ``kvtier._kvtier`` (internal: use the
functions of the ``kvtier`` package)."""

from collections.abc import Sequence
from typing import Any

import numpy as np

__version__: str

# (name, safetensors dtype, shape, buffer index, start, end)
_Span = tuple[str, str, list[int], int, int, int]

class HostBuffer:
    """One loaded file's bytes, viewed by arrays through numpy's array
    interface; freed when the last view is gone."""

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """numpy's array interface: a writable uint8 array over the bytes."""

    @property
    def path(self) -> str:
        """The file these bytes were read from."""

    def __len__(self) -> int:
        """Bytes held: the file's length."""

def load_safetensors(path: str) -> tuple[list[HostBuffer], list[_Span]]:
    """Load a safetensors file or model directory; see
    ``kvtier.load_safetensors``."""

def save_checkpoint(
    dir: str,
    tensors: Sequence[tuple[str, str, np.ndarray[Any, Any]]],
    metadata: dict[str, str],
    shard_bytes: int | None = None,
    direct: bool = True,
) -> dict[str, Any]:
    """Save C-contiguous little-endian arrays as a checkpoint generation;
    see ``kvtier.save_checkpoint``."""

def load_checkpoint(
    dir: str, verify: bool = True
) -> tuple[list[HostBuffer], list[_Span], int, dict[str, str]]:
    """Load a committed checkpoint; see ``kvtier.load_checkpoint``."""
