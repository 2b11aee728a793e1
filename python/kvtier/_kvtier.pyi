"""Type stubs of the native module ``kvtier._kvtier`` (internal: use the
functions of the ``kvtier`` package)."""

from collections.abc import Sequence
from typing import Any, final

import numpy as np
from typing_extensions import Self

__all__ = [
    "__version__",
    "HostBuffer",
    "load_safetensors",
    "save_checkpoint",
    "load_checkpoint",
    "device_read_gbps",
    "Store",
    "Namespace",
    "Layout",
    "Transfer",
    "BlockResult",
    "Completions",
]

__version__: str

# (name, safetensors dtype, shape, buffer index, start, end)
_Span = tuple[str, str, list[int], int, int, int]

@final
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

def load_checkpoint(dir: str, verify: bool = True) -> tuple[list[HostBuffer], list[_Span], int, dict[str, str]]:
    """Load a committed checkpoint; see ``kvtier.load_checkpoint``."""

# The KV store (see kvtier.store for the public wrappers).

@final
class Layout:
    """The shape of one KV block (see ``kvtier.store``)."""

    def __new__(
        cls,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_tokens: int,
        dtype: str = "f32",
        arrangement: str = "kv-major",
        tp_rank: int = 0,
        tp_world: int = 1,
        codec: str = "none",
    ) -> Self: ...
    @staticmethod
    def vllm_cpu(
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_tokens: int = 128,
        dtype: str = "f32",
        tp_rank: int = 0,
        tp_world: int = 1,
        codec: str = "none",
    ) -> Layout:
        """vLLM's CPU page layout: per layer ``[num_blocks, kv_heads,
        block_tokens, 2 * head_dim]``."""
    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def codec(self) -> str:
        """How the lower tiers store the payload: none, bf16, fp8-e4m3, int8."""
    @property
    def arrangement(self) -> str: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_world(self) -> int: ...
    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's payload."""
    @property
    def stored_payload_bytes(self) -> int:
        """Bytes of one block's payload as the store keeps it (coded)."""
    @property
    def region_bytes(self) -> int:
        """Bytes of one region (a layer's K or V, or its latent)."""
    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one block."""
    @property
    def slot_bytes(self) -> int:
        """Bytes one block takes on disk."""
    def layer_range(self, layer: int) -> tuple[int, int] | None: ...
    def part_range(self, layer: int, part: str) -> tuple[int, int] | None: ...
    def regions(self) -> list[tuple[int, int]]:
        """Payload ranges of a block's regions, in payload order."""

@final
class BlockResult:
    """What a load or save did with one block; equal to its status string."""

    @property
    def status(self) -> str:
        """``hit``, ``miss``, ``corrupt``, ``error``, ``stored``,
        ``present`` or ``cancelled``."""
    @property
    def tier(self) -> str | None:
        """For a hit: ``g2``, ``g3`` or ``g4``."""
    @property
    def reason(self) -> str | None:
        """For ``corrupt`` and ``error``: why (a message naming the tier)."""
    @property
    def cause(self) -> str | None:
        """For ``corrupt``: what the block's check found
        (``payload_checksum``, ``header_checksum``, ``key_mismatch``,
        ``wrong_rows``, ...); for ``error``: ``disk``, ``pool`` or
        ``block``."""
    @property
    def ok(self) -> bool:
        """True for ``hit``, ``stored`` and ``present``."""

@final
class Transfer:
    """A load or save in progress; holds its arrays until finished."""

    def done(self) -> bool: ...
    def finished(self) -> int:
        """Blocks with a result so far."""
    def __len__(self) -> int: ...
    def wait(self, timeout: float | None = None) -> list[BlockResult] | None:
        """One result per key once done (the GIL released meanwhile);
        ``None`` if ``timeout`` seconds passed first."""
    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """True once layer ``layer`` of every block is in memory or will
        not come (a layer-wise load: as each layer lands; any other
        transfer: once done); False if ``timeout`` seconds passed first."""
    def cancel(self) -> None:
        """Blocks not yet copied report ``cancelled``; their memory is not
        touched."""

@final
class Namespace:
    """One model and layout of a store (internal; see ``kvtier.Namespace``)."""

    @property
    def name(self) -> str: ...
    @property
    def layout(self) -> Layout: ...
    def keys(self, hashes: list[bytes]) -> list[bytes]: ...
    def token_keys(self, tokens: list[int], salt: bytes = ...) -> list[bytes]: ...
    def lookup(self, hashes: list[bytes]) -> int: ...
    def _load(
        self,
        hashes: list[bytes],
        pieces: list[list[tuple[int, int, int]]],
        keep: Any,
        layerwise: bool = False,
    ) -> Transfer: ...
    def _save(self, hashes: list[bytes], pieces: list[list[tuple[int, int, int]]], keep: Any) -> Transfer: ...
    def flush(self) -> None: ...
    def evict_memory(self) -> None: ...
    def locate(self, hash: bytes) -> tuple[str, int] | None: ...
    def wait_warm(self, timeout: float | None = None) -> bool: ...
    def metrics_text(self) -> str: ...
    def stats(self) -> dict[str, int]: ...

@final
class Store:
    """The native store (internal; see ``kvtier.Store``)."""

    def __new__(
        cls,
        cache_dir: str,
        g2_bytes: int = ...,
        g3_bytes: int = ...,
        remote: str | None = None,
        g3_sync_ms: int = ...,
        eviction: str = ...,
    ) -> Self: ...
    def namespace(
        self,
        layout: Layout,
        fingerprint: bytes | str,
        salt: bytes = ...,
        name: str | None = None,
        warm_read_buffers: bool = False,
    ) -> Namespace: ...
    def remove_namespace(self, name: str) -> bool: ...
    @property
    def cache_dir(self) -> str: ...
    def metrics(self) -> dict[str, Any]: ...
    def flush(self) -> None: ...

# A group of a batch: namespace, batch indices, hashes, per key (address, length).
_Group = tuple[Namespace, list[int], list[bytes], list[tuple[int, int]]]

@final
class Completions:
    """A completion queue with an eventfd over loads, saves and lookups
    (internal; see ``kvtier.lmcache``)."""

    def __new__(cls) -> Self: ...
    def event_fd(self) -> int: ...
    def submit_load(self, future_id: int, keys: int, groups: list[_Group]) -> None: ...
    def submit_save(self, future_id: int, keys: int, groups: list[_Group]) -> None: ...
    def submit_exists(
        self, future_id: int, keys: int, groups: list[tuple[Namespace, list[int], list[bytes]]]
    ) -> None: ...
    def push(self, future_id: int, ok: bool, err: str | None = None, per_key: list[bool] | None = None) -> None: ...
    def drain(self) -> list[tuple[int, bool, str | None, list[bool] | None]]: ...
    def __len__(self) -> int: ...

def device_read_gbps(paths: list[str], bytes: int = ...) -> tuple[float, bool]:
    """The device's O_DIRECT read limit on ``paths``: ``(GB/s, direct)``."""
