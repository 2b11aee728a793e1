"""kvtier under vLLM: :class:`KvtierConnector`, a KV connector
(``KVConnectorBase_V1``) that keeps every computed prefix block in kvtier's
tiered store (G2 host memory, G3 a directory, G4 a shared Redis/Valkey or S3
pool) and restores it instead of recomputing, across requests, restarts and
nodes. Every block is verified on the way back; a block that is missing or
corrupt is reported to vLLM, which recomputes it: wrong KV is never served.

Start vLLM with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cache_dir": "/var/cache/kvtier",
            "g2_bytes": 4294967296, "g3_bytes": 68719476736,
            "remote": "redis://pool:6379"}}'
    --disable-hybrid-kv-cache-manager

``kv_load_failure_policy: "recompute"`` makes vLLM recompute a block that
failed to load; vLLM's default (``"fail"``) fails the request instead, and
the connector warns about it at start.

``kv_connector_extra_config`` keys (all optional):

- ``cache_dir``: the store's directory (default ``$XDG_CACHE_HOME/kvtier/vllm``);
- ``g2_bytes`` (default 1 GiB), ``g3_bytes`` (default 8 GiB): G2 and G3 budgets;
- ``remote``: a G4 pool URL (``redis://``, ``rediss://``, ``redis+cluster://``,
  ``s3://``), shared by every node that names it;
- ``namespace``: the G3 directory's name under ``cache_dir`` (default:
  derived from the model and layout);
- ``fingerprint``: names the weights (default: the model's name, revision,
  its config.json and the sizes of its weight files; KV of another
  fingerprint is never served);
- ``kv_offload_codec`` (default ``"none"``): how the store keeps the KV,
  ``none``, ``bf16`` (from f32), ``fp8-e4m3`` or ``int8`` (a scale per
  token and head; docs/block-format.md); part of the keys, so coded and
  uncoded KV never mix;
- ``load_async`` (default true): restores run between scheduler steps while
  other requests keep decoding; false restores inside the step that needs
  them, layer by layer (see "Layer pipelining"): a lower TTFT when few
  requests run (measured: docs/benchmarks.md), but a slow read (a remote
  pool's) then holds up that step for every request in it, which the
  default never does;
- ``layerwise_load`` (default true): with ``load_async`` false, each layer's
  attention waits only for that layer (``wait_for_layer_load``); false waits
  for the whole restore before the step (for comparisons);
- ``warm_read_buffers`` (default true): at start, the worker faults in
  the buffers restores read into (as many blocks as ``g2_bytes`` holds)
  and waits for it before vLLM takes requests, so no restore faults fresh
  memory in while it reads (see "Start-up"); it commits the G2 budget's
  memory at start, as vLLM does its own KV cache;
- ``force_staging`` (default false): copy pages through host buffers
  (:mod:`kvtier.staging`) even where the KV cache could be read and written
  in place, so the path an accelerator's KV cache takes runs on a CPU too
  (the end-to-end checks use it).

Decisions (where vLLM leaves a choice):

- **Keys.** Blocks are named by kvtier's chained token keys
  (docs/keys.md), one vLLM block (128 tokens on CPU) = one kvtier block,
  salted by the request's ``cache_salt`` and its LoRA adapter, scoped by
  the model fingerprint and the layout. vLLM's own ``request.block_hashes``
  are not used: unless ``PYTHONHASHSEED`` is set, vLLM seeds them at random
  in every process, so they would never match after a restart or on another
  node. Requests with multi-modal inputs are neither restored nor saved
  (their KV depends on more than tokens).
- **What is saved.** The full blocks of a request's prompt, once the request
  finishes (its blocks are held until the save has copied them, through
  ``request_finished`` -> ``get_finished``). Saves copy pages on kvtier's
  threads, off vLLM's step; each save is written on to G3 as soon as its
  copy is done, so it survives a restart or a kill moments later. vLLM
  kills its engine at once on SIGTERM unless started with
  ``--shutdown-timeout N``; a save still being copied then is lost (and
  recomputed next time), never served torn.
- **Layer pipelining.** Sync loads (``load_async`` false) are read
  layer-major and written into vLLM's pages layer by layer as they land
  (``Namespace.load_pages(layerwise=True)``, the path kvtier's own engine
  restores by); ``wait_for_layer_load`` waits for that one layer of the
  step's loads (and, staged, copies it to the device), so layer 0's
  attention runs while the later layers are still read. A block is
  verified once all of it has landed, after the forward pass has used it:
  one that fails is reported in ``get_block_ids_with_load_errors``, and
  vLLM then drops that step's output for the request and recomputes from
  the block (``kv_load_failure_policy: "recompute"``; ``"fail"`` fails the
  request): wrong KV is never served. A step in which vLLM did not wait for
  every layer reports all its layer-wise blocks failed, since a layer may
  have been read while it was written. Async loads (the default) are
  waited for between steps, whole: no step reads their pages before then.
- **Memory.** The CPU backend's per-layer tensors ``[num_blocks,
  num_kv_heads, block_size, 2 * head_size]`` are read and written in place
  (``Layout.vllm_cpu``). KV caches on an accelerator (or strided ones) are
  staged through a pinned host buffer per transfer
  (:class:`kvtier.staging.PageStaging`), and pages of backends that put K
  and V side by side per token (FlashAttention, Triton, FlexAttention) are
  converted to the CPU backend's form on the device on the way: every
  backend stores the same bytes, so GPU and CPU workers of one model share
  KV. A backend whose page form kvtier does not know is refused at start.
- **Start-up.** The first burst after a restart is when every prefix comes
  from kvtier, so nothing it needs may still be starting then. The worker
  waits in ``register_kv_caches`` until the read buffers are warm (fresh
  memory faulted in on a restore's path made the first burst's restores
  several times slower, and the warming thread competed with them for the
  CPU; docs/architecture.md, "Decisions"), and the scheduler connects to
  the worker's lookup socket when it is built, not at the first request.
  ``vllm:kvtier_fresh_buffers_total`` counts block buffers taken from
  fresh memory after the start: it stays 0 while G2's warmed budget lasts.
- **Threads.** The store's threads, the flusher and the lookup server run
  on every CPU the process was given (its parent's), not on the cores
  vLLM's CPU worker pins its own thread to (they would inherit its
  pinning).
- **Tensor parallelism.** Each rank keeps its own shard (the layout carries
  rank and world); the scheduler looks up rank 0's shard, and a rank that
  lacks a block reports it as a load error, so vLLM recomputes it.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import queue
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from .staging import KV_PER_BLOCK, VLLM_BACKENDS, PageStaging
from .store import Layout, Namespace, Store, Transfer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "KvtierConnectorStats",
    "connector_namespace",
    "model_fingerprint",
    "request_salt",
]

# Under vLLM's logger, so that its handlers print kvtier's lines.
logger = init_logger("vllm.kvtier")

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass
class _Job:
    """One request's blocks to load or save: blocks ``first ..
    first + len(block_ids)`` of ``tokens`` (whole blocks, keyed with
    ``salt``), to or from the vLLM blocks ``block_ids`` in order. Keys are
    computed by the worker, which holds the namespace."""

    req_id: str
    tokens: list[int]
    salt: bytes
    first: int
    block_ids: list[int]


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side asks of the workers in one step."""

    loads: list[_Job] = field(default_factory=list)
    saves: list[_Job] = field(default_factory=list)
    #: Whether ``loads`` are asynchronous (finished between steps).
    load_async: bool = True


@dataclass
class _Match:
    """The last lookup of a request (``get_num_new_matched_tokens``)."""

    local_tokens: int
    hit_blocks: int


def _extra(vllm_config: VllmConfig) -> dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {}
    known = {
        "cache_dir",
        "g2_bytes",
        "g3_bytes",
        "remote",
        "namespace",
        "fingerprint",
        "load_async",
        "layerwise_load",
        "kv_offload_codec",
        "force_staging",
        "warm_read_buffers",
    }
    unknown = set(extra) - known
    if unknown:
        raise ValueError(
            f"kvtier: unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(known)}"
        )
    return extra


def model_fingerprint(model: str, revision: str | None = None, quantization: str | None = None) -> str:
    """The fingerprint :class:`KvtierConnector` gives a model by default:
    its name, revision and quantization and, for a local directory, a hash
    of its config.json and the names and sizes of its weight files."""
    parts: dict[str, Any] = {"model": str(model), "revision": str(revision), "quantization": str(quantization)}
    root = Path(str(model))
    if root.is_dir():
        config = root / "config.json"
        if config.is_file():
            parts["config"] = hashlib.sha256(config.read_bytes()).hexdigest()
        parts["weights"] = sorted(
            (p.name, p.stat().st_size)
            for p in root.iterdir()
            if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file()
        )
    return "vllm:" + json.dumps(parts, sort_keys=True)


def _fingerprint(vllm_config: VllmConfig) -> str:
    mc = vllm_config.model_config
    return model_fingerprint(mc.model, getattr(mc, "revision", None), getattr(mc, "quantization", None))


def _layout(vllm_config: VllmConfig, rank: int, codec: str = "none") -> Layout:
    """The per-rank block layout vLLM's config implies (the workers check
    it against the tensors they are given)."""
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype

    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    torch_dtype = get_kv_cache_torch_dtype(vllm_config.cache_config.cache_dtype, mc.dtype)
    dtype = _DTYPES.get(torch_dtype)
    if dtype is None:
        raise ValueError(f"kvtier: KV cache dtype {torch_dtype} is not supported (f32, f16, bf16)")
    return Layout.vllm_cpu(
        mc.get_num_layers(pc),
        mc.get_num_kv_heads(pc),
        mc.get_head_size(),
        block_tokens=vllm_config.cache_config.block_size,
        dtype=dtype,
        tp_rank=rank,
        tp_world=pc.tensor_parallel_size,
        codec=codec,
    )


_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def _store(extra: dict[str, Any]) -> Store:
    """One store per cache directory and process: vLLM builds the scheduler
    and the worker side in one process on the CPU backend, and two stores
    must never share one directory."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvtier" / "vllm"
    cache_dir = os.path.realpath(str(extra.get("cache_dir", default)))
    with _STORES_LOCK:
        store = _STORES.get(cache_dir)
        if store is None:
            os.makedirs(cache_dir, exist_ok=True)
            store = Store(
                cache_dir,
                g2_bytes=int(extra.get("g2_bytes", 1 << 30)),
                g3_bytes=int(extra.get("g3_bytes", 8 << 30)),
                remote=extra.get("remote"),
            )
            _STORES[cache_dir] = store
        return store


def connector_namespace(vllm_config: VllmConfig, rank: int = 0, warm: bool = False) -> Namespace:
    """The store namespace :class:`KvtierConnector` uses for ``rank`` (to
    inspect or prepare a cache from outside vLLM); ``warm``: fault in its
    read buffers at open (``Store.namespace(warm_read_buffers=True)``), as
    the worker does unless ``warm_read_buffers`` is false."""
    extra = _extra(vllm_config)
    layout = _layout(vllm_config, rank, str(extra.get("kv_offload_codec", "none")))
    fingerprint = str(extra.get("fingerprint") or _fingerprint(vllm_config))
    return _store(extra).namespace(
        layout,
        fingerprint=fingerprint,
        name=extra.get("namespace"),
        warm_read_buffers=warm and bool(extra.get("warm_read_buffers", True)),
    )


def _page_arrangement(vllm_config: VllmConfig, layer: str, t: torch.Tensor) -> tuple[str, str]:
    """How the attention backend of ``layer`` arranges K and V in a page
    (:mod:`kvtier.staging`), from the backend vLLM chose for it, and that
    backend's name. A backend kvtier does not know is refused: guessing
    could serve wrong KV. Where vLLM does not say (no attention layer
    registered under that name), a CPU tensor is taken to be the CPU
    backend's, the only one vLLM runs on the CPU."""
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    backend = getattr(ctx.get(layer), "attn_backend", None)
    if backend is None:
        if t.device.type == "cpu":
            return KV_PER_BLOCK, "unnamed, on the CPU"
        raise ValueError(f"kvtier: cannot tell which attention backend layer {layer} on {t.device} uses")
    name = str(backend.get_name())
    arrangement = VLLM_BACKENDS.get(name)
    if arrangement is None:
        raise ValueError(
            f"kvtier: vLLM's {name} attention backend keeps KV in a page form kvtier does not know; "
            f"choose one of {', '.join(sorted(VLLM_BACKENDS))} (--attention-backend)"
        )
    return arrangement, name


def request_salt(cache_salt: str | None, lora_name: str | None) -> bytes:
    """The key salt of a request: its ``cache_salt`` and LoRA adapter
    (empty for neither, so such requests share keys)."""
    if not cache_salt and not lora_name:
        return b""
    return json.dumps([cache_salt or "", lora_name or ""]).encode()


def _salt(request: Request) -> bytes:
    lora = getattr(request, "lora_request", None)
    return request_salt(getattr(request, "cache_salt", None), lora.lora_name if lora else None)


@contextlib.contextmanager
def _all_cpus() -> Iterator[None]:
    """Lets the calling thread run on every CPU the process was given while
    threads are started from it, then pins it back. vLLM's CPU worker pins
    its thread to the cores it computes on (``VLLM_CPU_OMP_THREADS_BIND``)
    and a thread inherits its creator's CPUs, so the store's reader, writer
    and io_uring threads shared one core with the model: a restore inside
    vLLM ran at a third of the store's speed (docs/benchmarks.md). Unpinned,
    they run where the kernel finds time, as another process's would.

    "Given" is the parent's CPUs (vLLM's engine core, which vLLM does not
    pin) with this thread's own: a ``taskset`` or cpuset vLLM was started
    under still holds for kvtier's threads."""
    pinned = os.sched_getaffinity(0)
    given = set(pinned)
    try:
        given |= os.sched_getaffinity(os.getppid())
        os.sched_setaffinity(0, given)
    except OSError as e:
        logger.warning("kvtier: its threads stay on CPUs %s: %s", sorted(pinned), e)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


@dataclass
class _Running:
    """A transfer in flight on the worker side."""

    job: _Job
    transfer: Transfer
    started: float
    #: Host pages of a staged transfer.
    host: torch.Tensor | None = None
    #: A load handing each layer over as it lands (a sync load's).
    layerwise: bool = False


def _lookup_address(vllm_config: VllmConfig) -> tuple[str, bytes]:
    """The lookup socket of one vLLM engine (a Linux abstract socket: no
    file to clean up) and its auth key, both from the engine id the
    scheduler and the workers share."""
    ktc = vllm_config.kv_transfer_config
    engine = str(getattr(ktc, "engine_id", "") or "")
    digest = hashlib.sha256(f"kvtier.vllm.lookup:{engine}".encode()).hexdigest()
    return f"\0kvtier-vllm-{digest[:24]}", digest.encode()


def _encode_lookup(tokens: list[int], salt: bytes) -> bytes:
    return len(salt).to_bytes(4, "little") + salt + array.array("I", tokens).tobytes()


def _decode_lookup(msg: bytes) -> tuple[list[int], bytes]:
    n = int.from_bytes(msg[:4], "little")
    salt = msg[4 : 4 + n]
    tokens = array.array("I")
    tokens.frombytes(msg[4 + n :])
    return tokens.tolist(), salt


class _LookupServer:
    """Rank 0's worker answers the scheduler's lookups: vLLM runs the
    scheduler in another process than the workers, and only the workers
    open the store (a store directory has one owner). A request is whole
    blocks of tokens and a salt; the answer is how many leading blocks the
    store holds, in any tier."""

    def __init__(self, vllm_config: VllmConfig, ns: Namespace) -> None:
        self._ns = ns
        address, key = _lookup_address(vllm_config)
        self._listener = Listener(address, family="AF_UNIX", authkey=key)
        self._thread = threading.Thread(target=self._accept, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            except Exception as e:  # noqa: BLE001 - a client with a wrong key: refuse it, keep serving
                logger.warning("kvtier: lookup connection refused: %s", e)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    tokens, salt = _decode_lookup(msg)
                    hit = self._ns.lookup(self._ns.token_keys(tokens, salt=salt))
                except Exception as e:  # noqa: BLE001 - a failed lookup is a miss, logged
                    logger.warning("kvtier: lookup failed (counted as a miss): %s", e)
                    hit = 0
                conn.send_bytes(hit.to_bytes(8, "little"))

    def close(self) -> None:
        self._listener.close()


class _LookupClient:
    """The scheduler's side of :class:`_LookupServer`: connects on first
    use, waits for the worker for up to a minute, and counts every error as
    a miss (recompute, never a stall)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._address, self._key = _lookup_address(vllm_config)
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def connect_now(self) -> None:
        """Connects at once if the worker listens (the scheduler is built
        after the workers registered their caches), so that the first
        request does not pay for the connection; a worker not yet there is
        connected to at the first lookup instead."""
        with self._lock:
            if self._conn is None:
                try:
                    self._conn = Client(self._address, family="AF_UNIX", authkey=self._key)
                except (OSError, EOFError):
                    pass

    def lookup(self, tokens: list[int], salt: bytes) -> int:
        with self._lock:
            for attempt in range(2):
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                    self._conn.send_bytes(_encode_lookup(tokens, salt))
                    return int.from_bytes(self._conn.recv_bytes(), "little")
                except (OSError, EOFError) as e:
                    self._conn = None
                    if attempt == 1:
                        logger.warning("kvtier: lookup failed (a miss): %s", e)
            return 0

    def _connect(self) -> Connection:
        deadline = time.monotonic() + 60
        while True:
            try:
                return Client(self._address, family="AF_UNIX", authkey=self._key)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class KvtierConnector(KVConnectorBase_V1):
    """vLLM KV connector over kvtier's tiered store (see the module's
    documentation for the configuration and the decisions it makes)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = _extra(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        self._load_async = bool(extra.get("load_async", True))
        self._layerwise = not self._load_async and bool(extra.get("layerwise_load", True))
        ktc = vllm_config.kv_transfer_config
        if role == KVConnectorRole.SCHEDULER and getattr(ktc, "kv_load_failure_policy", "") != "recompute":
            logger.warning(
                "kvtier: kv_load_failure_policy is %r: a block that fails its checksum fails its "
                'request; set "kv_load_failure_policy": "recompute" to recompute it instead',
                getattr(ktc, "kv_load_failure_policy", None),
            )
        # Scheduler side.
        self._lookup = _LookupClient(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        if self._lookup is not None:
            self._lookup.connect_now()
        self._matches: dict[str, _Match] = {}
        self._loading: set[str] = set()
        self._pending_loads: list[_Job] = []
        self._pending_saves: list[_Job] = []
        # Worker side.
        self._ns: Namespace | None = None
        self._server: _LookupServer | None = None
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._staging: PageStaging | None = None
        #: This step's layer-wise loads, and the layers vLLM waited for.
        self._stepping: list[_Running] = []
        self._waited: set[int] = set()
        self._loads: dict[str, _Running] = {}
        self._saves: dict[str, _Running] = {}
        self._finished_seen: set[str] = set()
        self._load_errors: set[int] = set()
        self._stats = KvtierConnectorStats()
        #: The store's count of fresh block buffers when last reported.
        self._fresh_seen = 0
        self._flusher: _Flusher | None = None

    # ---------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose blocks kvtier holds
        (whole blocks; the prompt's last token is always computed)."""
        assert self._lookup is not None
        if getattr(request, "mm_features", None):
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        cacheable = (len(tokens) - 1) // self._block_size
        if cacheable <= num_computed_tokens // self._block_size:
            return 0, False
        hit = self._lookup.lookup(tokens[: cacheable * self._block_size], _salt(request))
        external = hit * self._block_size - num_computed_tokens
        # A pure memo of the last answer (vLLM may ask again): used by
        # update_state_after_alloc and request_finished.
        self._matches[request.request_id] = _Match(num_computed_tokens, hit)
        if external <= 0:
            return 0, False
        return external, self._load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queues the load of the blocks vLLM allocated for the external
        tokens."""
        if num_external_tokens <= 0:
            return
        m = self._matches.get(request.request_id)
        if m is None or num_external_tokens % self._block_size:
            raise RuntimeError(
                f"kvtier: {num_external_tokens} external tokens for request {request.request_id} "
                "do not match its lookup"
            )
        first = m.local_tokens // self._block_size
        count = num_external_tokens // self._block_size
        block_ids = list(blocks.get_block_ids()[0])
        if first + count > min(len(block_ids), m.hit_blocks):
            raise RuntimeError(f"kvtier: request {request.request_id} has too few blocks for its load")
        tokens = list(request.prompt_token_ids or [])[: (first + count) * self._block_size]
        self._pending_loads.append(
            _Job(request.request_id, tokens, _salt(request), first, block_ids[first : first + count])
        )
        if self._load_async:
            self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Hands this step's loads and saves to the workers."""
        meta = KvtierConnectorMetadata(self._pending_loads, self._pending_saves, self._load_async)
        self._pending_loads = []
        self._pending_saves = []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Notes the async loads the workers finished."""
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves the prompt's full blocks that kvtier did not hold; holds
        the blocks until the save (or a load still in flight) is done."""
        m = self._matches.pop(request.request_id, None)
        if request.request_id in self._loading:
            # Pages are still being written: freed when the load finishes.
            return True, None
        if getattr(request, "mm_features", None):
            return False, None
        tokens = list(request.prompt_token_ids or [])
        full = min(request.num_computed_tokens, len(tokens), len(block_ids) * self._block_size)
        full //= self._block_size
        known = m.hit_blocks if m is not None else 0
        if full <= known:
            return False, None
        self._pending_saves.append(
            _Job(
                request.request_id,
                tokens[: full * self._block_size],
                _salt(request),
                known,
                list(block_ids[known:full]),
            )
        )
        return True, None

    # ------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes the per-layer KV tensors (ordered by layer index), opens
        this rank's namespace (checking the tensors against its layout) and,
        on rank 0, answers the scheduler's lookups. The threads this starts
        (the store's, the flusher, the lookup server) may run on every CPU
        the process was given (see :func:`_all_cpus`)."""
        with _all_cpus():
            self._register(kv_caches)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        try:
            rank = get_tensor_model_parallel_rank()
        except (AssertionError, RuntimeError):
            rank = 0
        self._ns = connector_namespace(self._vllm_config, rank, warm=True)
        self._wait_warm()
        layout = self._ns.layout
        names = sorted(kv_caches, key=extract_layer_index)
        layers = [kv_caches[n] for n in names]
        if len(layers) != layout.layers:
            raise ValueError(f"kvtier: {len(layers)} KV cache tensors for a {layout.layers}-layer model")
        shape = (layout.kv_heads, layout.block_tokens, 2 * layout.head_dim)
        for n, t in zip(names, layers):
            if tuple(t.shape[1:]) != shape or _DTYPES.get(t.dtype) != layout.dtype:
                raise ValueError(
                    f"kvtier: layer {n} has a {t.dtype} KV cache of shape {tuple(t.shape)}; kvtier takes "
                    f"[num_blocks, {shape[0]}, {shape[1]}, {shape[2]}] {layout.dtype}"
                )
        arrangement, backend = _page_arrangement(self._vllm_config, names[0], layers[0])
        self._layers = layers
        self._layer_index = {n: i for i, n in enumerate(names)}
        in_place = arrangement == KV_PER_BLOCK and all(t.device.type == "cpu" and t.is_contiguous() for t in layers)
        extra = _extra(self._vllm_config)
        if not in_place or bool(extra.get("force_staging", False)):
            self._staging = PageStaging(layers, arrangement)
        self._flusher = _Flusher(self._ns)
        if rank == 0:
            self._server = _LookupServer(self._vllm_config, self._ns)
        logger.info(
            "kvtier: worker rank %d on namespace %s (%s), %d layers of %d pages, %s backend, %s",
            rank,
            self._ns.name,
            _store(extra).cache_dir,
            len(layers),
            layers[0].shape[0],
            backend,
            "in place" if self._staging is None else f"staged from {layers[0].device} ({arrangement})",
        )

    def _wait_warm(self) -> None:
        """Waits until the store's read buffers are warm (see "Start-up"),
        and notes the store's fresh-buffer count from then on."""
        assert self._ns is not None
        started = time.monotonic()
        self._ns.wait_warm()
        st = self._ns.stats()
        self._fresh_seen = int(st.get("fresh_buffers", 0))
        if st.get("read_buffers_warm_target"):
            logger.info(
                "kvtier: %d of %d read buffers (%.0f MiB) faulted in at start, in %.1f s",
                st["read_buffers_warmed"],
                st["read_buffers_warm_target"],
                st["read_buffers_warmed"] * self._ns.layout.slot_bytes / 2**20,
                time.monotonic() - started,
            )

    def _start(self, job: _Job, save: bool, layerwise: bool = False) -> _Running:
        assert self._ns is not None
        now = time.monotonic()
        keys = self._ns.token_keys(job.tokens, salt=job.salt)[job.first :]
        if len(keys) != len(job.block_ids):
            raise RuntimeError(f"kvtier: {len(keys)} keys for {len(job.block_ids)} blocks of {job.req_id}")
        if self._staging is None:
            if save:
                t = self._ns.save_pages(keys, self._layers, job.block_ids)
            else:
                t = self._ns.load_pages(keys, self._layers, job.block_ids, layerwise=layerwise)
            return _Running(job, t, now, layerwise=layerwise)
        host = self._staging.gather(job.block_ids) if save else self._staging.buffer(len(job.block_ids))
        pieces = PageStaging.pieces(host)
        t = self._ns.save(keys, pieces) if save else self._ns.load(keys, pieces, layerwise=layerwise)
        return _Running(job, t, now, host, layerwise)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Starts every load of this step at once. Async loads finish
        between steps; sync loads are either layer-wise (each layer waited
        for in :meth:`wait_for_layer_load`, see the module) or waited for
        whole here."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        layerwise = self._layerwise and not meta.load_async
        started = [self._start(job, save=False, layerwise=layerwise) for job in meta.loads]
        if meta.load_async:
            for r in started:
                self._loads[r.job.req_id] = r
            return
        if layerwise:
            self._stepping.extend(started)
            return
        for r in started:
            self._finish_load(r)

    def _finish_stepping(self) -> None:
        """Ends this step's layer-wise loads (the forward pass is over)."""
        runs, self._stepping = self._stepping, []
        waited, self._waited = self._waited, set()
        if not runs:
            return
        unwaited = sorted(set(range(len(self._layers))) - waited)
        if unwaited:
            logger.warning(
                "kvtier: vLLM did not wait for layer(s) %s in this step; its layer-wise restores are "
                "reported failed and recomputed",
                unwaited,
            )
        for r in runs:
            self._finish_load(r, trusted=not unwaited)

    def _finish_load(self, r: _Running, trusted: bool = True) -> None:
        """Counts a finished load's blocks and notes those that failed (all
        of them unless ``trusted``) for vLLM to recompute."""
        results = r.transfer.wait()
        assert results is not None
        if r.host is not None and self._staging is not None and not r.layerwise:
            self._staging.scatter(r.host, r.job.block_ids)
        failed = [b for b, res in zip(r.job.block_ids, results) if not (res.ok and trusted)]
        self._load_errors.update(failed)
        self._stats.loaded(len(results) - len(failed), len(failed), time.monotonic() - r.started, r.layerwise)
        if failed:
            why = {res.status + (f" ({res.reason})" if res.reason else "") for res in results if not res.ok}
            logger.warning(
                "kvtier: %d of %d blocks of request %s not restored (%s): vLLM recomputes them",
                len(failed),
                len(results),
                r.job.req_id,
                "; ".join(sorted(why)),
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Waits until this layer of every layer-wise load of the step is
        in vLLM's pages (staged: copied to the device too); returns at once
        without such loads (see the module's "Layer pipelining")."""
        if not self._stepping:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for r in self._stepping:
            r.transfer.wait_layer(layer)  # releases the GIL
            if r.host is not None and self._staging is not None:
                self._staging.scatter(r.host, r.job.block_ids, layer=layer)
        self._waited.add(layer)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: saves copy whole blocks of finished requests
        (see :meth:`wait_for_save`)."""
        return

    def wait_for_save(self) -> None:
        """Starts this step's saves on kvtier's threads and returns: the
        blocks stay held until :meth:`get_finished` reports them."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        for job in meta.saves:
            r = self._start(job, save=True)
            self._saves[job.req_id] = r
            if self._flusher is not None:
                self._flusher.add(r.transfer)
        meta.saves = []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose saves (sending) and async loads (receiving) are
        done."""
        self._finished_seen |= finished_req_ids
        recving: set[str] = set()
        for req_id, r in list(self._loads.items()):
            if r.transfer.done():
                del self._loads[req_id]
                self._finish_load(r)
                recving.add(req_id)
        sending: set[str] = set()
        for req_id, r in list(self._saves.items()):
            if req_id in self._finished_seen and r.transfer.done():
                del self._saves[req_id]
                self._finished_seen.discard(req_id)
                results = r.transfer.wait() or []
                stored = sum(1 for x in results if x.status == "stored")
                failed = [x for x in results if not x.ok]
                self._stats.saved(stored, len(failed), time.monotonic() - r.started)
                if failed:
                    logger.warning(
                        "kvtier: %d blocks of request %s not saved: %s", len(failed), req_id, failed[0]
                    )
                sending.add(req_id)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (missing,
        corrupt or unreadable: vLLM recomputes them); called after the
        step's forward pass, so this step's layer-wise loads end here."""
        self._finish_stepping()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Blocks and seconds of loads and saves since the last call."""
        if self._stats.is_empty():
            return None
        if self._ns is not None:
            # Only loads and saves take buffers: brought up to date when one
            # has finished, the count loses none (a load still running is
            # counted in a later interval).
            fresh = int(self._ns.stats().get("fresh_buffers", 0))
            self._stats.data["fresh_buffers"] += fresh - self._fresh_seen
            self._fresh_seen = fresh
        stats, self._stats = self._stats, KvtierConnectorStats()
        return stats

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads wait inside the attention layers, which a
        captured CUDA graph would skip: vLLM must run those in pieces."""
        return not bool(extra_config.get("load_async", True)) and bool(extra_config.get("layerwise_load", True))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=dict(data)) if data is not None else KvtierConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Waits for loads and saves in flight, then writes G2 to G3. vLLM
        calls it on a stop it lets finish (``--shutdown-timeout`` above 0);
        one that kills the worker first loses only the saves still being
        copied (see :class:`_Flusher`)."""
        for r in list(self._loads.values()) + list(self._saves.values()) + self._stepping:
            r.transfer.wait()
        self._stepping.clear()
        self._loads.clear()
        self._saves.clear()
        if self._flusher is not None:
            self._flusher.stop()
        if self._server is not None:
            self._server.close()
        if self._ns is not None:
            self._ns.flush()
            logger.info("kvtier: stopped; every saved block is in G3 (namespace %s)", self._ns.name)


class _Flusher:
    """Makes saves durable: a thread that waits for each save's copy into
    the store (G2, where a block stays until evicted or flushed) and then
    writes G2 to G3, so a saved block survives a restart moments after its
    copy is done. It does not wait for vLLM: vLLM runs no step once its last
    request is done (a save of that request is then never reported), and by
    default it kills its engine at once on SIGTERM (``--shutdown-timeout
    0``), before :meth:`KvtierConnector.shutdown` can flush. The store's own
    periodic sync (``g3_sync_ms``, 1 s) is the backstop; a stop within that
    second of a save lost it. One flush covers every save queued before
    it."""

    def __init__(self, ns: Namespace) -> None:
        self._ns = ns
        self._queue: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtier-flush", daemon=True)
        self._thread.start()

    def add(self, save: Transfer) -> None:
        """Flushes once ``save`` is done."""
        self._queue.put(save)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get())
            stop = any(t is None for t in batch)
            # wait() releases the GIL, and may be called again by get_finished.
            stored = sum(r.status == "stored" for t in batch if t is not None for r in t.wait() or [])
            if not stored:
                continue
            try:
                self._ns.flush()  # releases the GIL while it writes
            except Exception as e:  # noqa: BLE001 - a failed flush leaves blocks in G2, logged
                logger.warning("kvtier: flush to G3 failed: %s", e)

    def stop(self, timeout: float = 60) -> None:
        """Flushes every save queued so far, then ends the thread."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)


_STAT_KEYS = (
    "blocks_loaded",
    "blocks_loaded_layerwise",
    "blocks_load_failed",
    "blocks_saved",
    "blocks_save_failed",
    "load_s",
    "save_s",
    "fresh_buffers",
)


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Per-interval counts: blocks loaded (and of those, by layer-wise
    loads) and failed, saved and failed, the seconds loads and saves took,
    and block buffers the store took from fresh memory."""

    def __post_init__(self) -> None:
        for k in _STAT_KEYS:
            self.data.setdefault(k, 0)

    def loaded(self, ok: int, failed: int, seconds: float, layerwise: bool = False) -> None:
        self.data["blocks_loaded"] += ok
        if layerwise:
            self.data["blocks_loaded_layerwise"] += ok
        self.data["blocks_load_failed"] += failed
        self.data["load_s"] += seconds

    def saved(self, ok: int, failed: int, seconds: float) -> None:
        self.data["blocks_saved"] += ok
        self.data["blocks_save_failed"] += failed
        self.data["save_s"] += seconds

    def reset(self) -> None:
        # Counts and seconds (floats) side by side.
        fresh: dict[str, Any] = {k: 0 for k in _STAT_KEYS}
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _STAT_KEYS:
            self.data[k] += other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data[k] for k in _STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in _STAT_KEYS)


class KvtierPromMetrics(KVConnectorPromMetrics):
    """kvtier's series on vLLM's ``/metrics``:
    ``vllm:kvtier_blocks_loaded_total`` (``..._loaded_layerwise_total``
    of them layer by layer), ``..._load_failed_total``,
    ``..._blocks_saved_total``, ``..._save_failed_total``,
    ``vllm:kvtier_load_s_total`` and ``vllm:kvtier_fresh_buffers_total``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in (
            ("blocks_loaded", "KV blocks restored from kvtier"),
            ("blocks_loaded_layerwise", "KV blocks restored from kvtier layer by layer, inside the step"),
            ("blocks_load_failed", "KV blocks kvtier could not restore (missing or corrupt; recomputed)"),
            ("blocks_saved", "KV blocks saved to kvtier"),
            ("blocks_save_failed", "KV blocks kvtier failed to save"),
            ("load_s", "Seconds kvtier's loads took, summed over loads (they overlap)"),
            ("fresh_buffers", "Block buffers kvtier took from fresh memory after the start (faulted in on use)"),
        ):
            c = self._counter_cls(name=f"vllm:kvtier_{key}", documentation=doc, labelnames=labelnames)
            self._counters[key] = {
                idx: c.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            v = transfer_stats_data.get(key, 0)
            if v and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
