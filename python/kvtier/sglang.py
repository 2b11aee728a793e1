"""kvtier as SGLang's HiCache storage backend (L3): :class:`KvtierHiCacheStorage`.

SGLang loads it as a ``dynamic`` backend (tested against sglang 0.5.23)::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "cache_dir": "/var/cache/kvtier"}'

With ``interface_v1`` SGLang calls the zero-copy ``batch_get_v1`` /
``batch_set_v1``: pages are read straight into, and written straight from,
the host pool's buffers (the pointers of ``get_page_buffer_meta``; MHA and
MLA, ``layer_first``, ``page_first`` and ``page_first_direct``). Every
block is verified on the way back: a missing or corrupt page is a miss
(``False``), and its host page is left as it was, never filled with bytes
that failed their check.

SGLang's page keys (a SHA-256 chain over the page's tokens and its prefix,
as hex) are kvtier raw keys, in a namespace per model (``model_name`` or the
``fingerprint`` key), pipeline/context-parallel rank, host page layout and,
for MHA, tensor-parallel rank (MLA's KV is the same on every TP rank, so
its keys leave the rank out). Each rank's process keeps its own G3
directory under ``cache_dir``; ranks share KV only through a G4 pool
(``remote``). docs/guides/sglang.md lists every key.

The generic ``get``/``set``/``batch_get``/``batch_set`` move SGLang's flat
data pages (``get_data_page(flat=True)``), whose byte order is not the
zero-copy one in every layout, so they live in a namespace of their own:
a page stored by one interface is a miss for the other, never misread.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from .store import Layout, Namespace, Store

__all__ = ["KvtierHiCacheStorage", "SglangConfig", "default_cache_dir"]

#: kvtier's keys of ``--hicache-storage-backend-extra-config``, with their
#: defaults (docs/guides/sglang.md describes each).
_DEFAULTS: dict[str, Any] = {
    "cache_dir": None,
    "g2_bytes": 1 << 30,
    "g3_bytes": 8 << 30,
    "remote": None,
    "g3_sync_ms": 1000,
    "eviction": "kvtier",
    "fingerprint": None,
    "namespace": None,
    "warm_read_buffers": True,
}

#: Keys SGLang itself reads from the same dict (the dynamic loader's, its
#: file backend's and its controller's); accepted and left to SGLang.
_SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "enable_metadata_cache",
        "metadata_ttl",
    }
)

#: Host pool dtypes kvtier stores, by the torch dtype's name.
_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "f8e4m3"}

#: Host pool layouts whose zero-copy pages kvtier knows (``get_page_buffer_meta``).
_MHA_LAYOUTS = {"layer_first": "layer-major", "page_first": "kv-major", "page_first_direct": "kv-major"}
_MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class _Held:
    """This process's store of one cache directory (a store directory has
    one owner: one store per directory and process), how many backends use
    it, and whether one of its namespaces warms G2's read buffers (G2 is
    shared, so one asks)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.users = 0
        self.warmed = False


_STORES: dict[str, _Held] = {}
_STORES_LOCK = threading.Lock()


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/kvtier/sglang`` (``~/.cache`` without it)."""
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvtier" / "sglang")


class SglangConfig:
    """kvtier's settings from SGLang's extra config; an unknown key is a
    ``ValueError`` naming the known ones (a misspelt key would otherwise be
    ignored without a word)."""

    def __init__(self, extra: Mapping[str, Any] | None) -> None:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_DEFAULTS) - _SGLANG_KEYS)
        if unknown:
            raise ValueError(
                f"kvtier.sglang: unknown extra_config key(s) {unknown}; kvtier's keys are {sorted(_DEFAULTS)}"
            )
        v = {k: extra.get(k, d) for k, d in _DEFAULTS.items()}
        self.cache_dir: str = os.path.realpath(str(v["cache_dir"] or default_cache_dir()))
        self.g2_bytes: int = int(v["g2_bytes"])
        self.g3_bytes: int = int(v["g3_bytes"])
        self.remote: str | None = None if v["remote"] in (None, "") else str(v["remote"])
        self.g3_sync_ms: int = int(v["g3_sync_ms"])
        self.eviction: str = str(v["eviction"])
        self.fingerprint: str | None = None if v["fingerprint"] in (None, "") else str(v["fingerprint"])
        self.namespace: str | None = None if v["namespace"] in (None, "") else str(v["namespace"])
        self.warm_read_buffers: bool = bool(v["warm_read_buffers"])
        self.interface_v1: bool = bool(int(extra.get("interface_v1", 0)))


def _store_for(config: SglangConfig) -> Store:
    """This process's store of ``config.cache_dir``, for one more backend
    (each gives it back with :func:`_release_store` when it closes)."""
    with _STORES_LOCK:
        held = _STORES.get(config.cache_dir)
        if held is None:
            os.makedirs(config.cache_dir, exist_ok=True)
            held = _Held(
                Store(
                    config.cache_dir,
                    g2_bytes=config.g2_bytes,
                    g3_bytes=config.g3_bytes,
                    remote=config.remote,
                    g3_sync_ms=config.g3_sync_ms,
                    eviction=config.eviction,
                )
            )
            _STORES[config.cache_dir] = held
        held.users += 1
        return held.store


def _release_store(cache_dir: str) -> None:
    """One backend of ``cache_dir`` is done with its store; the last one
    lets the store go (a store flushes when dropped), so the directory can
    be opened again, by a later backend of this process or by another
    process."""
    with _STORES_LOCK:
        held = _STORES.get(cache_dir)
        if held is not None:
            held.users -= 1
            if held.users == 0:
                del _STORES[cache_dir]


def _take_warming(cache_dir: str) -> bool:
    """Whether the caller's namespace is the first of the store of
    ``cache_dir`` to warm G2's read buffers (then the others do not)."""
    with _STORES_LOCK:
        held = _STORES.get(cache_dir)
        if held is None or held.warmed:
            return False
        held.warmed = True
        return True


def _raw_key(key: str) -> bytes:
    """SGLang's page key as kvtier raw-key bytes (hex digests as their bytes)."""
    try:
        return bytes.fromhex(key)
    except ValueError:
        return key.encode()


def pool_layout(pool: Any, is_mla: bool, tp_rank: int, tp_size: int) -> Layout:
    """The kvtier layout of one page of SGLang's host pool ``pool``; its
    payload is the bytes of the page's zero-copy buffers, in their order."""
    dtype = _DTYPES.get(str(pool.dtype).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"kvtier.sglang: host pool dtype {pool.dtype} is not supported ({sorted(_DTYPES)})")
    layout_name = str(pool.layout)
    if is_mla:
        if layout_name not in _MLA_LAYOUTS:
            raise ValueError(f"kvtier.sglang: MLA host layout {layout_name!r} is not supported ({_MLA_LAYOUTS})")
        return Layout(int(pool.layer_num), 1, int(pool.kv_cache_dim), int(pool.page_size), dtype, "latent")
    arrangement = _MHA_LAYOUTS.get(layout_name)
    if arrangement is None:
        raise ValueError(f"kvtier.sglang: MHA host layout {layout_name!r} is not supported ({sorted(_MHA_LAYOUTS)})")
    if int(pool.head_dim) != int(getattr(pool, "v_head_dim", pool.head_dim)):
        raise ValueError("kvtier.sglang: MHA pools whose K and V widths differ are not supported")
    return Layout(
        int(pool.layer_num),
        int(pool.head_num),
        int(pool.head_dim),
        int(pool.page_size),
        dtype,
        arrangement,
        tp_rank=tp_rank,
        tp_world=tp_size,
    )


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang's base class is Any to mypy (not installed where the package is checked)
    """SGLang HiCache storage over a kvtier store (see the module's doc).

    Built by SGLang as ``cls(storage_config, kwargs)``; the host pool arrives
    with ``register_mem_pool_host``, which opens the namespace."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.config = SglangConfig(storage_config.extra_config)
        self.store: Store | None = _store_for(self.config)
        self.is_mla = bool(storage_config.is_mla_model)
        self.tp_rank = int(storage_config.tp_rank)
        self.tp_size = int(storage_config.tp_size)
        # With attention data parallelism tp_rank is local to its group:
        # two groups' ranks of one number share keys but not a directory.
        self.dp_rank = int(getattr(storage_config, "dp_rank", 0) or 0)
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError(
                "kvtier.sglang: split-head pages (TP sizes that differ between writers and readers) are not supported"
            )
        self.mem_pool_host: Any = None
        self.layout: Layout | None = None
        self._ns: Namespace | None = None
        self._flat_ns: Namespace | None = None
        self._page_size = 1
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []

    # -- naming ---------------------------------------------------------------

    def _fingerprint(self, flat: bool) -> str:
        c = self.storage_config
        model = self.config.fingerprint or str(c.model_name or "")
        pool_layout_name = str(getattr(self.mem_pool_host, "layout", ""))
        parts = [
            "sglang",
            model,
            f"layout={pool_layout_name}",
            f"mla={int(self.is_mla)}",
            f"pp={int(getattr(c, 'pp_rank', 0))}/{int(getattr(c, 'pp_size', 1))}",
            f"cp={int(getattr(c, 'attn_cp_rank', 0))}/{int(getattr(c, 'attn_cp_size', 1))}",
            f"dcp={int(getattr(c, 'dcp_rank', 0))}/{int(getattr(c, 'dcp_size', 1))}",
            "flat" if flat else "v1",
        ]
        return "|".join(parts)

    def _generation_file(self, base: str) -> Path:
        return Path(self.config.cache_dir) / f"{base}.generation"

    def _generation(self, base: str) -> int:
        try:
            return int(self._generation_file(base).read_text().strip() or 0)
        except FileNotFoundError:
            return 0

    def _base_name(self, flat: bool) -> str:
        if self.config.namespace is not None:
            base = self.config.namespace + ("-flat" if flat else "")
        else:
            digest = hashlib.sha256(self._fingerprint(flat).encode()).hexdigest()[:16]
            base = f"sglang-{digest}"
        return f"{base}-dp{self.dp_rank}-tp{self.tp_rank}of{self.tp_size}"

    def _open(self, flat: bool) -> Namespace:
        if self.layout is None:
            raise RuntimeError("kvtier.sglang: no host pool registered (register_mem_pool_host)")
        base = self._base_name(flat)
        gen = self._generation(base)
        name = f"{base}-g{gen}"
        warm = not flat and self.config.warm_read_buffers and _take_warming(self.config.cache_dir)
        return self._live_store().namespace(
            self.layout,
            fingerprint=self._fingerprint(flat),
            salt=f"generation={gen}".encode(),
            name=name,
            warm_read_buffers=warm,
        )

    # -- SGLang's interface ----------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the host pool and opens the namespace of its page layout;
        checks the layout's payload against the pool's zero-copy pages."""
        import torch

        self.mem_pool_host = mem_pool_host
        self._page_size = int(getattr(mem_pool_host, "logical_page_size", mem_pool_host.page_size))
        tp_rank, tp_size = (0, 1) if self.is_mla else (self.tp_rank, self.tp_size)
        self.layout = pool_layout(mem_pool_host, self.is_mla, tp_rank, tp_size)
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(self._page_size, dtype=torch.int64))
        self._remove_old_generations()
        page_bytes = sum(int(s) for s in sizes)
        if page_bytes != self.layout.payload_bytes:
            raise ValueError(
                f"kvtier.sglang: a host page has {page_bytes} bytes of zero-copy buffers, "
                f"the layout {self.layout!r} {self.layout.payload_bytes}"
            )
        with self._lock:
            self._ns = self._open(False)
            self._flat_ns = None

    def _remove_old_generations(self) -> None:
        """Removes the G3 directories of generations before the current one
        (left by ``clear``) that no store, in this or another process, has
        open (``Store.remove_namespace``: kvtier's own files only)."""
        for flat in (False, True):
            base = self._base_name(flat)
            for old in range(self._generation(base)):
                self._live_store().remove_namespace(f"{base}-g{old}")

    def _live_store(self) -> Store:
        if self.store is None:
            raise RuntimeError("kvtier.sglang: the backend is closed")
        return self.store

    def _namespace(self) -> Namespace:
        with self._lock:
            self._live_store()
            if self._ns is None:
                raise RuntimeError("kvtier.sglang: no host pool registered (register_mem_pool_host)")
            return self._ns

    def _flat_namespace(self) -> Namespace:
        with self._lock:
            if self._flat_ns is None:
                self._flat_ns = self._open(True)
            return self._flat_ns

    def _spans(self, keys: Sequence[str], host_indices: Any) -> list[list[tuple[int, int]]]:
        """Per key, its page's buffers in the host pool as ``(byte offset
        into kv_buffer, length)``, in the order of the page's payload."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        n = len(keys)
        if n == 0:
            return []
        if len(ptrs) % n != 0 or len(ptrs) != len(sizes):
            raise ValueError(f"kvtier.sglang: {len(ptrs)} page buffers for {n} keys")
        base = int(self.mem_pool_host.kv_buffer.data_ptr())
        per = len(ptrs) // n
        return [[(int(ptrs[j]) - base, int(sizes[j])) for j in range(i * per, (i + 1) * per)] for i in range(n)]

    def _check_indices(self, keys: Sequence[str], host_indices: Any) -> None:
        if int(host_indices.numel()) != len(keys) * self._page_size:
            raise ValueError(
                f"kvtier.sglang: {host_indices.numel()} host indices for {len(keys)} pages of {self._page_size} tokens"
            )

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Reads the pages of ``keys`` into the host pool at
        ``host_indices`` (``page_size`` token indices per key); ``True`` per
        page read and verified. A missing or corrupt page is ``False`` and
        its host page is not written."""
        return self._pages_v1(keys, host_indices, load=True)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Writes the host pool's pages at ``host_indices`` as ``keys``;
        ``True`` per page stored (or already held)."""
        return self._pages_v1(keys, host_indices, load=False)

    def _pages_v1(self, keys: list[str], host_indices: Any, *, load: bool) -> list[bool]:
        """The zero-copy transfer of both v1 calls: the host pool's page
        buffers at ``host_indices`` loaded from (``load``) or saved as
        ``keys``, counted in the matching stats."""
        if not keys:
            return []
        self._check_indices(keys, host_indices)
        ns = self._namespace()
        start = time.perf_counter()
        spans = self._spans(keys, host_indices)
        raw = [_raw_key(k) for k in keys]
        buffer = self.mem_pool_host.kv_buffer
        t = ns.load_spans(raw, buffer, spans) if load else ns.save_spans(raw, buffer, spans)
        ok = [bool(r.ok) for r in t.wait() or []]
        seconds = time.perf_counter() - start
        if load:
            # SGLang uses the pages before the first one not read: those
            # are what the prefetch metrics count.
            used = next((i for i, v in enumerate(ok) if not v), len(ok))
            self._note(self._prefetch_pgs, self._prefetch_bw, used, seconds)
        else:
            self._note(self._backup_pgs, self._backup_bw, sum(ok), seconds)
        return ok

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` the store holds (any tier)."""
        if not keys:
            return 0
        return self._namespace().lookup([_raw_key(k) for k in keys])

    def exists(self, key: str) -> bool:
        """Whether the store holds the page ``key`` (as written by the
        zero-copy interface, or else by ``set``)."""
        raw = [_raw_key(key)]
        if self._namespace().lookup(raw) == 1:
            return True
        return self._flat_ns is not None and self._flat_ns.lookup(raw) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Reads the flat page ``key`` into ``target_location`` (a
        contiguous CPU tensor of one page, as ``get_dummy_flat_data_page``);
        returns it, or ``None`` for a missing or corrupt page."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """``get`` of every key: per key its tensor, or ``None``."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("kvtier.sglang: batch_get needs one target tensor per key")
        results = self._flat_namespace().load([_raw_key(k) for k in keys], list(target_locations)).wait()
        return [t if r.ok else None for t, r in zip(target_locations, results or [], strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores the flat page ``value`` (``get_data_page(flat=True)``) as ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """``set`` of every key; ``True`` when all of them were stored."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError("kvtier.sglang: batch_set needs one value per key")
        srcs = [v if v.is_contiguous() else v.contiguous() for v in values]
        results = self._flat_namespace().save([_raw_key(k) for k in keys], srcs).wait()
        return all(r.ok for r in results or [])

    def clear(self) -> None:
        """Forgets every page of this backend's namespaces: a new generation
        (kept in ``<cache_dir>/<namespace>.generation``, so it holds across
        restarts) names new namespaces; the old blocks are never served
        again and are removed from disk at the next start."""
        with self._lock:
            for flat in (False, True):
                base = self._base_name(flat)
                gen = self._generation(base) + 1
                path = self._generation_file(base)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(f"{gen}\n")
                os.replace(tmp, path)
            if self._ns is not None:
                self._ns = self._open(False)
            self._flat_ns = None

    def _note(self, pgs: list[int], bws: list[float], pages: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics:
            return
        page_bytes = self.layout.payload_bytes if self.layout is not None else 0
        with self._stats_lock:
            pgs.append(pages)
            bws.append(pages * page_bytes / seconds / 1e9 if seconds > 0 else 0.0)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s
        per zero-copy read and write), or ``None`` without
        ``--enable-cache-report``-style storage metrics. kvtier's own
        counters: :meth:`kvtier_stats`."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._stats_lock:
            m.prefetch_pgs, self._prefetch_pgs = self._prefetch_pgs, []
            m.backup_pgs, self._backup_pgs = self._backup_pgs, []
            m.prefetch_bandwidth, self._prefetch_bw = self._prefetch_bw, []
            m.backup_bandwidth, self._backup_bw = self._backup_bw, []
        return m

    def kvtier_stats(self) -> dict[str, int]:
        """The zero-copy namespace's counters (``Namespace.stats``: hits per
        tier, misses, corrupt blocks, blocks on disk)."""
        return self._namespace().stats()

    @property
    def namespace(self) -> Namespace:
        """The zero-copy pages' namespace (to inspect or locate blocks)."""
        return self._namespace()

    def close(self) -> None:
        """Writes every block not yet on disk and lets the store go: the
        last backend of a directory in this process closes its store, so
        another may open the directory (SGLang calls it on detach). The
        backend is not used after."""
        with self._lock:
            opened = [n for n in (self._ns, self._flat_ns) if n is not None]
            self._ns, self._flat_ns = None, None
            store, self.store = self.store, None
        for ns in opened:
            ns.flush()
        if store is not None:
            _release_store(self.config.cache_dir)
