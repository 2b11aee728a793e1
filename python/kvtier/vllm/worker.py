"""The connector's worker side: opens the store's namespace over vLLM's KV
tensors, runs each step's loads and saves, and reports what finished and
what failed.

**Memory.** The CPU backend's per-layer tensors ``[num_blocks,
num_kv_heads, block_size, 2 * head_size]`` are read and written in place
(``Layout.vllm_cpu``). KV caches on an accelerator (or strided ones) are
staged through a pinned host buffer per transfer
(:class:`kvtier.staging.PageStaging`), and pages of backends that put K and
V side by side per token (FlashAttention, Triton, FlexAttention) are
converted to the CPU backend's form on the device on the way: every backend
stores the same bytes, so GPU and CPU workers of one model share KV. A
backend whose page form kvtier does not know is refused at start.

**Layer pipelining.** Sync loads (``load_async`` false) are read
layer-major and written into vLLM's pages layer by layer as they land
(``Namespace.load_pages(layerwise=True)``, the path kvtier's own engine
restores by); ``wait_for_layer_load`` waits for that one layer of the
step's loads (and, staged, copies it to the device), so layer 0's attention
runs while the later layers are still read. A block is verified once all of
it has landed, after the forward pass has used it: one that fails is
reported in ``get_block_ids_with_load_errors``, and vLLM then drops that
step's output for the request and recomputes from the block
(``kv_load_failure_policy: "recompute"``; ``"fail"`` fails the request):
wrong KV is never served. A step in which vLLM did not wait for every layer
reports all its layer-wise blocks failed, since a layer may have been read
while it was written. Async loads (the default) are waited for between
steps, whole: no step reads their pages before then.

**Saves** copy pages on kvtier's threads, off vLLM's step, and the
:class:`~kvtier.vllm.flusher.Flusher` writes each on to G3 as soon as its
copy is done.

**Start-up.** The first burst after a restart is when every prefix comes
from kvtier, so nothing a restore needs may still be starting then. The
worker waits in ``register_kv_caches`` until the store's read buffers are
warm: a restore that faults fresh memory in as it reads is slower than one
into resident memory, and a warming thread still running would compete with
the restores for the CPU. ``vllm:kvtier_fresh_buffers_total`` counts block
buffers taken from fresh memory after the start: it stays 0 while G2's
warmed budget lasts.

**Tensor parallelism.** Each rank opens its own shard's namespace; only
rank 0 answers the scheduler's lookups (:mod:`.lookup`), and a rank that
lacks a block reports it as a load error, so vLLM recomputes it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..staging import KV_PER_BLOCK, VLLM_BACKENDS, PageStaging
from ..store import Namespace, Transfer
from .config import ConnectorConfig
from .flusher import Flusher
from .lookup import LookupServer, lookup_address
from .metadata import Job, KvtierConnectorMetadata
from .metrics import KvtierConnectorStats
from .namespace import KV_DTYPES, open_namespace, store_for
from .threads import all_cpus

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM's logger of this name (vLLM's init_logger gives the same one).
logger = logging.getLogger("vllm.kvtier")


def page_arrangement(vllm_config: VllmConfig, layer: str, t: torch.Tensor) -> tuple[str, str]:
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


@dataclass
class Running:
    """A transfer in flight on the worker side."""

    job: Job
    transfer: Transfer
    started: float
    #: Host pages of a staged transfer.
    host: torch.Tensor | None = None
    #: A load handing each layer over as it lands (a sync load's).
    layerwise: bool = False


class KvtierWorker:
    """The worker side of :class:`~kvtier.vllm.KvtierConnector`."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._layerwise = config.layerwise
        self._ns: Namespace | None = None
        self._server: LookupServer | None = None
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._staging: PageStaging | None = None
        #: This step's layer-wise loads, and the layers vLLM waited for.
        self._stepping: list[Running] = []
        self._waited: set[int] = set()
        self._loads: dict[str, Running] = {}
        self._saves: dict[str, Running] = {}
        self._finished_seen: set[str] = set()
        self._load_errors: set[int] = set()
        self._stats = KvtierConnectorStats()
        #: The store's count of fresh block buffers when last reported.
        self._fresh_seen = 0
        self._flusher: Flusher | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes the per-layer KV tensors (ordered by layer index), opens
        this rank's namespace (checking the tensors against its layout) and,
        on rank 0, answers the scheduler's lookups. The threads this starts
        (the store's, the flusher, the lookup server) may run on every CPU
        the process was given (see :func:`~kvtier.vllm.threads.all_cpus`)."""
        with all_cpus():
            self._register(kv_caches)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        try:
            rank = get_tensor_model_parallel_rank()
        except (AssertionError, RuntimeError):
            rank = 0
        self._ns = open_namespace(self._vllm_config, self._config, rank, warm=True)
        self._wait_warm()
        layout = self._ns.layout
        names = sorted(kv_caches, key=extract_layer_index)
        layers = [kv_caches[n] for n in names]
        if len(layers) != layout.layers:
            raise ValueError(f"kvtier: {len(layers)} KV cache tensors for a {layout.layers}-layer model")
        shape = (layout.kv_heads, layout.block_tokens, 2 * layout.head_dim)
        for n, t in zip(names, layers, strict=True):
            if tuple(t.shape[1:]) != shape or KV_DTYPES.get(t.dtype) != layout.dtype:
                raise ValueError(
                    f"kvtier: layer {n} has a {t.dtype} KV cache of shape {tuple(t.shape)}; kvtier takes "
                    f"[num_blocks, {shape[0]}, {shape[1]}, {shape[2]}] {layout.dtype}"
                )
        arrangement, backend = page_arrangement(self._vllm_config, names[0], layers[0])
        self._layers = layers
        self._layer_index = {n: i for i, n in enumerate(names)}
        in_place = arrangement == KV_PER_BLOCK and all(t.device.type == "cpu" and t.is_contiguous() for t in layers)
        if not in_place or self._config.force_staging:
            self._staging = PageStaging(layers, arrangement)
        self._flusher = Flusher(self._ns)
        if rank == 0:
            self._server = LookupServer(*lookup_address(self._vllm_config), self._ns)
        logger.info(
            "kvtier: worker rank %d on namespace %s (%s), %d layers of %d pages, %s backend, %s",
            rank,
            self._ns.name,
            store_for(self._config).cache_dir,
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

    def _start(self, job: Job, save: bool, layerwise: bool = False) -> Running:
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
            return Running(job, t, now, layerwise=layerwise)
        host = self._staging.gather(job.block_ids) if save else self._staging.buffer(len(job.block_ids))
        pieces = PageStaging.pieces(host)
        t = self._ns.save(keys, pieces) if save else self._ns.load(keys, pieces, layerwise=layerwise)
        return Running(job, t, now, host, layerwise)

    def start_load_kv(self, meta: KvtierConnectorMetadata) -> None:
        """Starts every load of this step at once. Async loads finish
        between steps; sync loads are either layer-wise (each layer waited
        for in :meth:`wait_for_layer_load`) or waited for whole here."""
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

    def _finish_load(self, r: Running, trusted: bool = True) -> None:
        """Counts a finished load's blocks and notes those that failed (all
        of them unless ``trusted``) for vLLM to recompute."""
        results = r.transfer.wait()
        assert results is not None
        if r.host is not None and self._staging is not None and not r.layerwise:
            self._staging.scatter(r.host, r.job.block_ids)
        failed = [b for b, res in zip(r.job.block_ids, results, strict=True) if not (res.ok and trusted)]
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
        without such loads (see "Layer pipelining")."""
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

    def wait_for_save(self, meta: KvtierConnectorMetadata) -> None:
        """Starts this step's saves on kvtier's threads and returns: the
        blocks stay held until :meth:`get_finished` reports them."""
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
                    logger.warning("kvtier: %d blocks of request %s not saved: %s", len(failed), req_id, failed[0])
                sending.add(req_id)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (missing,
        corrupt or unreadable: vLLM recomputes them); called after the
        step's forward pass, so this step's layer-wise loads end here."""
        self._finish_stepping()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
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

    def shutdown(self) -> None:
        """Waits for loads and saves in flight, then writes G2 to G3. vLLM
        calls it on a stop it lets finish (``--shutdown-timeout`` above 0);
        one that kills the worker first loses only the saves still being
        copied (see :mod:`~kvtier.vllm.flusher`)."""
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
