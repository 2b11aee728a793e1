"""The tiered KV store from Python: :class:`Store`, its :class:`Namespace`\\ s
and the :class:`Transfer` handles of loads and saves.

A store keeps KV blocks in G2 (host memory, one budget for every namespace),
G3 (a directory per namespace under ``cache_dir``) and, with ``remote``, a G4
pool shared by nodes (Redis/Valkey or S3). A namespace is one model and
block layout (:class:`Layout`); its blocks are named by the engine's own
block hashes (``bytes``, or ``int``), scoped by the model fingerprint, the
layout and a salt (docs/keys.md).

Loads and saves copy between the store and memory the caller owns: numpy
arrays or torch CPU tensors, C-contiguous, used in place (no copy besides
the one into or out of the store's block buffer). They return at once with
a :class:`Transfer`; ``done()`` polls, ``wait()`` gives one
:class:`BlockResult` per block (``hit``, ``miss``, ``corrupt``, ``error``,
``stored``, ``present``, ``cancelled``), ``cancel()`` stops it. The arrays
are held until the transfer is finished; do not touch them before. A load
with ``layerwise=True`` writes each layer as it lands, and
``wait_layer(l)`` tells when layer ``l`` of every block may be read.

Example (vLLM's CPU cache: per layer a ``[num_blocks, kv_heads, 128,
2 * head_dim]`` tensor)::

    store = kvtier.Store("/var/cache/kvtier", g2_bytes=4 << 30, g3_bytes=64 << 30)
    ns = store.namespace(kvtier.Layout.vllm_cpu(layers, kv_heads, head_dim),
                         fingerprint="my-model-v1")
    n = ns.lookup(block_hashes)                    # cached leading blocks
    t = ns.load_pages(block_hashes[:n], kv_caches, block_ids[:n])
    results = t.wait()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _kvtier
from ._kvtier import BlockResult, Layout, Transfer

__all__ = ["Store", "Namespace", "Layout", "Transfer", "BlockResult", "BlockHash"]

#: An engine's block hash: ``bytes`` (vLLM's), or an ``int`` (taken as 16
#: bytes, little-endian, two's complement).
BlockHash = bytes | bytearray | memoryview | int

#: A piece of memory: ``(payload offset, address, length)``.
_Piece = tuple[int, int, int]

#: Memory the caller owns: a C-contiguous numpy array or CPU torch tensor,
#: told apart at run time (torch is optional, so it is not named here).
_Memory = Any


def _hash_bytes(h: BlockHash) -> bytes:
    if isinstance(h, bytes):
        return h
    if isinstance(h, (bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, int) and not isinstance(h, bool):
        try:
            return h.to_bytes(16, "little", signed=True)
        except OverflowError:
            raise ValueError(f"an int block hash must fit in 128 bits: {h}") from None
    raise TypeError(f"a block hash is bytes or int, not {type(h).__name__}")


def _hashes(keys: Sequence[BlockHash]) -> list[bytes]:
    return [_hash_bytes(k) for k in keys]


def _memory(a: _Memory, writable: bool) -> tuple[int, int]:
    """``(address, bytes)`` of a C-contiguous numpy array or CPU torch
    tensor; raises ``ValueError``/``TypeError`` for anything else."""
    mod = type(a).__module__
    if mod.startswith("torch"):
        if a.device.type != "cpu":
            raise ValueError(f"a {a.device.type} tensor: kvtier copies to and from CPU memory")
        if not a.is_contiguous():
            raise ValueError("a tensor that is not contiguous: pass .contiguous()")
        return int(a.data_ptr()), int(a.numel()) * int(a.element_size())
    iface = getattr(a, "__array_interface__", None)
    if iface is None:
        raise TypeError(f"memory must be a numpy array or a torch tensor, not {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError("an array that is not C-contiguous: pass numpy.ascontiguousarray(a)")
    addr, readonly = iface["data"]
    if writable and readonly:
        raise ValueError("a read-only array cannot be loaded into")
    return int(addr), int(a.nbytes)


class Namespace:
    """One model and layout in a :class:`Store` (made by
    :meth:`Store.namespace`)."""

    def __init__(self, native: _kvtier.Namespace) -> None:
        self._ns = native

    @property
    def name(self) -> str:
        """Its directory under the store's ``cache_dir``."""
        return self._ns.name

    @property
    def layout(self) -> Layout:
        """Its block layout."""
        return self._ns.layout

    def keys(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """The 16-byte store keys of ``hashes`` (docs/keys.md, raw keys)."""
        return self._ns.keys(_hashes(hashes))

    def token_keys(self, tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """The store keys of token ids, one per full block (docs/keys.md);
        ``salt`` is a request's own salt (vLLM's ``cache_salt``): two salts
        never share a key, the empty salt is the namespace's own chain."""
        return self._ns.token_keys(list(tokens), bytes(salt))

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``keys`` the store holds, in any tier."""
        return self._ns.lookup(_hashes(keys))

    def _pieces(self, blocks: Sequence[_Memory], writable: bool) -> list[list[_Piece]]:
        regions = self.layout.regions()
        payload = self.layout.payload_bytes
        out: list[list[_Piece]] = []
        for i, mem in enumerate(blocks):
            parts = list(mem) if isinstance(mem, (list, tuple)) else [mem]
            if len(parts) == 1:
                addr, n = _memory(parts[0], writable)
                if n != payload:
                    raise ValueError(f"block {i}: {n} bytes, the layout's payload is {payload}")
                out.append([(0, addr, n)])
                continue
            if len(parts) != len(regions):
                raise ValueError(
                    f"block {i}: {len(parts)} pieces; the layout has {len(regions)} regions "
                    "(or pass one array of the whole payload)"
                )
            block: list[_Piece] = []
            for (start, end), part in zip(regions, parts, strict=True):
                addr, n = _memory(part, writable)
                if n != end - start:
                    raise ValueError(f"block {i}: a piece of {n} bytes for a {end - start}-byte region")
                block.append((start, addr, n))
            out.append(block)
        return out

    def load(self, keys: Sequence[BlockHash], dests: Sequence[_Memory], layerwise: bool = False) -> Transfer:
        """Starts loading the blocks of ``keys`` into ``dests``: per key one
        array of the whole payload, or a list of arrays, one per region of
        :meth:`Layout.regions` in order. Returns at once.

        ``layerwise``: each block's layers are written as they land, and
        ``Transfer.wait_layer(l)`` returns once layer ``l`` of every block
        is in, while later layers are still read, so a forward pass can
        start. Blocks are verified once all of them is in: one whose result
        is not ``hit`` may have been written (with bytes that failed their
        check), and nothing computed from it may be kept."""
        keys = _hashes(keys)
        if len(keys) != len(dests):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        return self._ns._load(keys, self._pieces(dests, True), list(dests), layerwise)

    def save(self, keys: Sequence[BlockHash], srcs: Sequence[_Memory]) -> Transfer:
        """Starts saving ``srcs`` (as ``dests`` of :meth:`load`) as the
        blocks of ``keys``. Returns at once; the memory may be reused once
        the transfer is done."""
        keys = _hashes(keys)
        if len(keys) != len(srcs):
            raise ValueError(f"{len(keys)} keys but {len(srcs)} sources")
        return self._ns._save(keys, self._pieces(srcs, False), list(srcs))

    def _spans(
        self, keys: Sequence[BlockHash], owner: _Memory, spans: Sequence[Sequence[tuple[int, int]]], writable: bool
    ) -> list[list[_Piece]]:
        base, size = _memory(owner, writable)
        if len(keys) != len(spans):
            raise ValueError(f"{len(keys)} keys but {len(spans)} span lists")
        payload = self.layout.payload_bytes
        out: list[list[_Piece]] = []
        for i, block in enumerate(spans):
            pieces: list[_Piece] = []
            at = 0
            for offset, length in block:
                offset, length = int(offset), int(length)
                if offset < 0 or length <= 0 or offset + length > size:
                    raise ValueError(f"block {i}: span ({offset}, {length}) is outside the {size}-byte buffer")
                pieces.append((at, base + offset, length))
                at += length
            if at != payload:
                raise ValueError(f"block {i}: spans of {at} bytes, the layout's payload is {payload}")
            out.append(pieces)
        return out

    def load_spans(
        self,
        keys: Sequence[BlockHash],
        owner: _Memory,
        spans: Sequence[Sequence[tuple[int, int]]],
        layerwise: bool = False,
    ) -> Transfer:
        """Starts loading block ``keys[i]`` into the byte ranges
        ``spans[i]`` of ``owner`` (one C-contiguous array or CPU tensor,
        such as an engine's whole host KV pool): ``(byte offset, length)``
        pairs that, in order, hold the block's payload. Every range is
        checked to lie inside ``owner``. Returns at once; ``layerwise`` as
        for :meth:`load`."""
        keys = _hashes(keys)
        return self._ns._load(keys, self._spans(keys, owner, spans, True), owner, layerwise)

    def save_spans(
        self,
        keys: Sequence[BlockHash],
        owner: _Memory,
        spans: Sequence[Sequence[tuple[int, int]]],
    ) -> Transfer:
        """Starts saving the byte ranges ``spans[i]`` of ``owner`` as the
        block ``keys[i]`` (as :meth:`load_spans`). Returns at once."""
        keys = _hashes(keys)
        return self._ns._save(keys, self._spans(keys, owner, spans, False), owner)

    def _pages(
        self, layers: Sequence[_Memory], block_ids: Sequence[int], writable: bool, part: tuple[int, int]
    ) -> list[list[_Piece]]:
        layout = self.layout
        if layout.arrangement == "kv-major":
            raise ValueError("pages need a layout whose layers are contiguous (not kv-major)")
        if len(layers) != layout.layers:
            raise ValueError(f"{len(layers)} layer tensors for a {layout.layers}-layer layout")
        index, count = (int(x) for x in part)
        if not 0 <= index < count:
            raise ValueError(f"part {index} of {count}")
        # A block's layer is part ``index`` of ``count`` equal runs of the
        # tensor's page (one KV head of a page of ``count`` heads).
        piece = layout.layer_bytes
        page = piece * count
        bases: list[tuple[int, int]] = []
        for li, t in enumerate(layers):
            addr, n = _memory(t, writable)
            if n % page != 0:
                raise ValueError(f"layer {li}: {n} bytes is not a whole number of {page}-byte pages")
            bases.append((addr, n // page))
        out: list[list[_Piece]] = []
        for b in block_ids:
            b = int(b)
            block: list[_Piece] = []
            for li, (addr, pages) in enumerate(bases):
                if not 0 <= b < pages:
                    raise ValueError(f"block id {b} is outside layer {li}'s {pages} pages")
                block.append((li * piece, addr + b * page + index * piece, piece))
            out.append(block)
        return out

    def load_pages(
        self,
        keys: Sequence[BlockHash],
        layers: Sequence[_Memory],
        block_ids: Sequence[int],
        layerwise: bool = False,
        part: tuple[int, int] = (0, 1),
    ) -> Transfer:
        """Starts loading block ``keys[i]`` into page ``block_ids[i]`` of
        every layer tensor (``layers[l]``: C-contiguous, ``[num_pages,
        ...]``, each page one layer of one block: vLLM's KV cache tensors).
        Returns at once. ``layerwise`` as for :meth:`load`. ``part=(j, n)``:
        each page is ``n`` equal runs (a page of ``n`` KV heads, head-major)
        and the block is run ``j`` of every page, so one head of a page is
        its own block."""
        keys = _hashes(keys)
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        return self._ns._load(keys, self._pages(layers, block_ids, True, part), list(layers), layerwise)

    def save_pages(
        self,
        keys: Sequence[BlockHash],
        layers: Sequence[_Memory],
        block_ids: Sequence[int],
        part: tuple[int, int] = (0, 1),
    ) -> Transfer:
        """Starts saving page ``block_ids[i]`` of every layer tensor (run
        ``part[0]`` of ``part[1]`` of it) as the block ``keys[i]`` (as
        :meth:`load_pages`). Returns at once."""
        keys = _hashes(keys)
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        return self._ns._save(keys, self._pages(layers, block_ids, False, part), list(layers))

    def flush(self) -> None:
        """Writes every block not yet on disk and syncs."""
        self._ns.flush()

    def evict_memory(self) -> None:
        """Empties this namespace's G2 into G3 (next loads come from disk)."""
        self._ns.evict_memory()

    def locate(self, key: BlockHash) -> tuple[str, int] | None:
        """``(segment file, slot offset)`` of a block on disk, or ``None``."""
        return self._ns.locate(_hash_bytes(key))

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Waits until the read buffers asked for with
        ``warm_read_buffers`` are faulted in, at most ``timeout`` seconds
        (``None``: no limit); True once the warming has ended (at once when
        none was asked for), False on timeout. Restores that start before
        then read into fresh memory, which faults in slower than a disk
        reads on some machines; an engine that takes requests right after
        it starts waits here first."""
        return self._ns.wait_warm(timeout)

    def stats(self) -> dict[str, int]:
        """Hits, misses and corrupt blocks per tier, blocks on disk, read
        buffers warmed (``read_buffers_warmed`` of
        ``read_buffers_warm_target``) and block buffers served with fresh
        memory (``fresh_buffers``: each was faulted in on first use; one
        count for the whole store, whose namespaces share their block
        buffers, so the buffers one namespace warms serve them all)."""
        return self._ns.stats()

    def metrics_text(self) -> str:
        """This namespace's metrics in Prometheus text."""
        return self._ns.metrics_text()

    def __repr__(self) -> str:
        return repr(self._ns)


class Store:
    """A tiered KV store over ``cache_dir``: ``g2_bytes`` of host memory for
    all namespaces together, ``g3_bytes`` of disk per namespace, and the G4
    pool at ``remote`` (``redis://``, ``rediss://``, ``redis+cluster://``,
    ``s3://``) if given. Blocks that live only in host memory are written
    to disk within about ``g3_sync_ms`` (0: only when evicted, flushed or
    closed), so a killed process loses at most that much. ``eviction`` is
    the eviction policy of host memory and disk: ``"kvtier"`` (kvtier's own, the default),
    ``"lru"``, ``"fifo"``, ``"s3fifo"`` or ``"clock"`` (docs/store.md says why the
    default wins); an unknown name is a ``ValueError``."""

    def __init__(
        self,
        cache_dir: str,
        g2_bytes: int = 1 << 30,
        g3_bytes: int = 8 << 30,
        remote: str | None = None,
        g3_sync_ms: int = 1000,
        eviction: str = "kvtier",
    ) -> None:
        self._store = _kvtier.Store(str(cache_dir), g2_bytes, g3_bytes, remote, g3_sync_ms, eviction)

    def namespace(
        self,
        layout: Layout,
        fingerprint: bytes | str,
        salt: bytes = b"",
        name: str | None = None,
        warm_read_buffers: bool = False,
    ) -> Namespace:
        """The namespace of one model (``fingerprint``: bytes or str naming
        its weights and config) and ``layout``; ``salt`` separates tenants;
        ``name`` is its directory (default: from fingerprint and layout).
        Asking again gives the same namespace.

        ``warm_read_buffers``: a background thread faults in, right after
        the open, the buffers G3 and G4 reads take (as many as the G2
        budget holds in blocks), so restores read into resident memory
        rather than faulting fresh pages in as they read; each is usable
        as soon as it is warm, and :meth:`Namespace.wait_warm` waits for
        the end. It commits the G2 budget's memory at open; G2 is shared,
        so ask for it in one namespace."""
        return Namespace(self._store.namespace(layout, fingerprint, salt, name, warm_read_buffers))

    def remove_namespace(self, name: str) -> bool:
        """Removes the namespace ``name``'s directory under ``cache_dir``
        for good (an engine forgetting an old generation of its cache):
        ``True`` once removed or when there is none, ``False`` while a
        store, this one or one in another process, has it open. Only
        kvtier's own files are removed; a directory holding anything else
        stays, with it."""
        return self._store.remove_namespace(name)

    @property
    def cache_dir(self) -> str:
        """The cache directory."""
        return self._store.cache_dir

    def metrics(self) -> dict[str, Any]:
        """G2 bytes and blocks used (all namespaces) and each namespace's
        :meth:`Namespace.stats`."""
        return self._store.metrics()

    def flush(self) -> None:
        """Writes every namespace's blocks not yet on disk and syncs."""
        self._store.flush()
