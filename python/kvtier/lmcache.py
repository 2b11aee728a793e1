"""kvtier's store as an LMCache L2 adapter (LMCache's ``native_plugin``
type, LMCache 0.5.6's multiprocess server).

LMCache's server builds :class:`KvtierL2Adapter` from its ``--l2-adapter``
JSON as ``KvtierL2Adapter(**adapter_params)``::

    lmcache server --l1-size-gb 1 --no-l1-use-lazy --eviction-policy LRU \\
        --chunk-size 16 --supported-transfer-mode auto --l2-adapter \\
        '{"type": "native_plugin", "module_path": "kvtier.lmcache",
          "class_name": "KvtierL2Adapter",
          "adapter_params": {"cache_dir": "/var/cache/kvtier-lmcache"}}'

LMCache hands the adapter its objects as opaque bytes, named
``"{model}@{kv_rank:08x}@{group:x}@{chunk_hash_hex}[@{cache_salt}]"``. Each
object becomes a block of kvtier's store: the key after the model (KV rank,
group, chunk hash, salt) is its raw key in a namespace per model and object
size (a block of one namespace has one size; a model's objects have one or
a few). So objects of two models, ranks or salts never share a block, and a
block found later is an object LMCache stored under that very key. (The
rank is in the raw key, not the namespace's name: ``lmcache bench l2`` gives
every key a rank of its own, and a namespace is a G3 directory and threads.)

Loads, saves and lookups run on the store's threads; a completion queue in
Rust (``kvtier._kvtier.Completions``) collects what they did and wakes
LMCache through its eventfd. Every block read is verified against its
checksums: a block that is missing, corrupt or unreadable is reported as not
loaded (LMCache then recomputes), never handed over.

``adapter_params`` (every key but ``cache_dir`` optional):

- ``cache_dir``: the store's directory (G3, a directory per namespace);
- ``g2_bytes``: host memory for kvtier's G2, all namespaces together
  (default 1 GiB);
- ``g3_bytes``: disk per namespace (default 8 GiB);
- ``remote``: a G4 pool shared by nodes (``redis://``, ``rediss://``,
  ``redis+cluster://`` or ``s3://`` URL; default none);
- ``codec``: how the lower tiers store the bytes: ``none`` (the default:
  LMCache's bytes as they are) or ``bf16``, ``fp8-e4m3``, ``int8``, which
  take the objects as ``kv_dtype`` elements and are lossy;
- ``kv_dtype``: the element type of LMCache's KV for a codec (``f16``,
  ``bf16``, ``f32``; default ``f16``);
- ``g3_sync_ms``: blocks only in host memory reach disk within about this
  many milliseconds (default 1000; 0: only when evicted or at close);
- ``eviction``: the eviction policy of G2 and G3 (``kvtier``, ``lru``,
  ``fifo``, ``s3fifo``, ``clock``);
- ``warm_read_buffers``: fault G2's read buffers in at start, on a
  background thread (default true; it commits ``g2_bytes`` of memory then),
  so restores after a restart do not read into fresh memory.

Namespaces found under ``cache_dir`` are opened when the adapter is built,
at the server's start.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _kvtier
from .store import Layout, Namespace, Store

__all__ = ["KvtierL2Adapter", "parse_key"]

_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_NAME = re.compile(r"^lmc-([0-9a-f]{32})-(\d+)$")


def parse_key(key: str) -> tuple[str, bytes]:
    """``(model, raw key)`` of an LMCache object key
    ``"{model}@{kv_rank:08x}@{group:x}@{chunk_hash_hex}[@{salt}]"``: the
    raw key is what follows the model (rank, group, chunk hash, salt)."""
    parts = key.split("@", 2)
    if len(parts) != 3 or not parts[2]:
        raise ValueError(f"not an LMCache object key: {key!r}")
    model, rank, tail = parts
    try:
        int(rank, 16)
    except ValueError:
        raise ValueError(f"not an LMCache object key (rank {rank!r}): {key!r}") from None
    return model, f"{rank}@{tail}".encode()


@functools.lru_cache(maxsize=256)
def _model_id(model: str) -> str:
    """128 bits of the model name's SHA-256, in hex: the namespace's name
    and fingerprint, so a restarted adapter opens the namespaces it finds
    on disk before it has seen a key (the name alone names the model)."""
    return hashlib.sha256(model.encode()).hexdigest()[:32]


def _span(buf: Any, writable: bool) -> tuple[int, int]:
    """``(address, bytes)`` of a C-contiguous buffer LMCache hands in.

    A writable buffer's address comes from ctypes, several times cheaper
    than numpy's array interface, which is kept for read-only ones; this
    runs once per object of every batch."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("a buffer that is not C-contiguous")
    size = mv.nbytes
    if size == 0:
        return 0, 0
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv)), size
    if writable:
        raise ValueError("a read-only buffer: a load needs writable memory")
    return int(np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0]), size


class KvtierL2Adapter:
    """LMCache's ``native_plugin`` client over a kvtier :class:`Store` (see
    the module's description for ``adapter_params``)."""

    def __init__(
        self,
        cache_dir: str,
        g2_bytes: int = 1 << 30,
        g3_bytes: int = 8 << 30,
        remote: str | None = None,
        codec: str = "none",
        kv_dtype: str = "f16",
        g3_sync_ms: int = 1000,
        eviction: str = "kvtier",
        warm_read_buffers: bool = True,
    ) -> None:
        if codec != "none" and kv_dtype not in _ELEMENT_BYTES:
            raise ValueError(f"kv_dtype must be one of {sorted(_ELEMENT_BYTES)}, not {kv_dtype!r}")
        self._cache_dir = str(cache_dir)
        self._codec = codec
        self._kv_dtype = kv_dtype
        self._store: Store | None = Store(
            self._cache_dir, int(g2_bytes), int(g3_bytes), remote, int(g3_sync_ms), eviction
        )
        self._completions = _kvtier.Completions()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        # Per future id, the buffers its batch reads or writes: held until
        # its completion is drained.
        self._held: dict[int, Sequence[Any]] = {}
        # model id -> object size -> namespace.
        self._open: dict[str, dict[int, Namespace]] = {}
        self._closed = False
        # The first namespace opened faults G2's read buffers in (G2 is
        # shared by all of them), so restores after a restart do not read
        # into fresh memory.
        self._warm = bool(warm_read_buffers)
        # Every namespace on disk is opened now, at the server's start:
        # lookups after a restart find what the last run stored.
        if os.path.isdir(self._cache_dir):
            for entry in sorted(os.listdir(self._cache_dir)):
                m = _NAME.match(entry)
                if m:
                    self._open_namespace(m[1], int(m[2]))

    # -- namespaces --------------------------------------------------------

    def _layout(self, size: int) -> Layout | None:
        if self._codec == "none":
            return Layout(1, 1, size, 1, dtype="f8e4m3", arrangement="latent")
        elem = _ELEMENT_BYTES[self._kv_dtype]
        if size % elem:
            return None
        return Layout(1, 1, size // elem, 1, dtype=self._kv_dtype, arrangement="latent", codec=self._codec)

    def _open_namespace(self, mid: str, size: int) -> Namespace | None:
        layout = self._layout(size)
        if layout is None:
            return None
        if self._store is None:
            raise RuntimeError("the kvtier L2 adapter is closed")
        ns = self._store.namespace(
            layout, fingerprint=f"lmcache\0{mid}", name=f"lmc-{mid}-{size}", warm_read_buffers=self._warm
        )
        self._warm = False
        self._open.setdefault(mid, {})[size] = ns
        return ns

    def _namespace(self, model: str, size: int, create: bool) -> Namespace | None:
        """The namespace of ``model``'s objects of ``size`` bytes; one not
        open yet is made only if ``create`` (a store), else ``None`` (no
        such object was ever stored: a miss)."""
        mid = _model_id(model)
        ns = self._open.get(mid, {}).get(size)
        if ns is not None or not create:
            return ns
        return self._open_namespace(mid, size)

    def _groups(
        self, keys: Sequence[str], bufs: Sequence[Any], writable: bool
    ) -> list[tuple[_kvtier.Namespace, list[int], list[bytes], list[tuple[int, int]]]]:
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        by_ns: dict[tuple[str, int], tuple[_kvtier.Namespace, list[int], list[bytes], list[tuple[int, int]]] | None]
        by_ns = {}
        for i, (key, buf) in enumerate(zip(keys, bufs, strict=True)):
            model, raw = parse_key(key)
            try:
                addr, size = _span(buf, writable)
            except ValueError as e:
                raise ValueError(f"buffer {i}: {e}") from None
            if size == 0:
                continue
            if (model, size) not in by_ns:
                ns = self._namespace(model, size, create=not writable)
                # None: no block of this size was ever stored, a miss.
                by_ns[(model, size)] = None if ns is None else (ns._ns, [], [], [])
            group = by_ns[(model, size)]
            if group is None:
                continue
            group[1].append(i)
            group[2].append(raw)
            group[3].append((addr, size))
        return [g for g in by_ns.values() if g is not None]

    # -- LMCache's native_plugin interface -----------------------------------

    def event_fd(self) -> int:
        """The eventfd LMCache polls: readable once a batch is done."""
        return self._completions.event_fd()

    def _next(self) -> int:
        if self._closed:
            raise RuntimeError("the kvtier L2 adapter is closed")
        return next(self._ids)

    def submit_batch_set(self, keys: list[str], bufs: list[Any]) -> int:
        """Starts storing ``bufs`` as the objects ``keys``; returns the
        batch's future id (its completion is ok once every one is stored)."""
        with self._lock:
            fid = self._next()
            groups = self._groups(keys, bufs, writable=False)
            self._held[fid] = bufs
            self._completions.submit_save(fid, len(keys), groups)
        return fid

    def submit_batch_get(self, keys: list[str], bufs: list[Any]) -> int:
        """Starts loading the objects ``keys`` into ``bufs``; the
        completion's per-key list says which were loaded and verified."""
        with self._lock:
            fid = self._next()
            groups = self._groups(keys, bufs, writable=True)
            self._held[fid] = bufs
            self._completions.submit_load(fid, len(keys), groups)
        return fid

    def submit_batch_exists(self, keys: list[str]) -> int:
        """Looks up the objects ``keys`` (any tier); the completion's
        per-key list says which are held."""
        with self._lock:
            fid = self._next()
            groups: dict[int, tuple[_kvtier.Namespace, list[int], list[bytes]]] = {}
            for i, key in enumerate(keys):
                model, raw = parse_key(key)
                for ns in self._open.get(_model_id(model), {}).values():
                    g = groups.setdefault(id(ns._ns), (ns._ns, [], []))
                    g[1].append(i)
                    g[2].append(raw)
            self._completions.submit_exists(fid, len(keys), list(groups.values()))
        return fid

    def drain_completions(self) -> list[tuple[int, bool, str | None, list[bool] | None]]:
        """Every finished batch since the last call: ``(future_id, ok,
        error, per-key results)``."""
        done = self._completions.drain()
        with self._lock:
            for fid, *_ in done:
                self._held.pop(fid, None)
        return done

    def close(self) -> None:
        """Waits (at most 30 s) for the batches in flight, writes every
        block not yet on disk, and lets the cache directory go (another
        adapter may open it then)."""
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with self._lock:
                if not self._held:
                    break
            if len(self._completions):
                self.drain_completions()
            else:
                time.sleep(0.01)
        if self._store is not None:
            self._store.flush()
        self._open.clear()
        self._store = None

    # -- for tools and tests ---------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """The store's figures (``kvtier.Store.metrics``); empty once closed."""
        return {} if self._store is None else self._store.metrics()
