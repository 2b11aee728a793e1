"""The connector's worker side: opens the store's namespaces over vLLM's KV
tensors (one per KV cache group and KV head this rank holds, :mod:`.groups`),
runs each step's loads and saves, and reports what finished and what
failed.

**Memory.** The CPU backend's per-layer tensors ``[num_blocks,
num_kv_heads, block_size, 2 * head_size]`` are read and written in place
(``Layout.vllm_cpu``, one head's run of each page per object; MLA's
``[num_blocks, 1, block_size, latent]`` pages whole). KV caches on an accelerator (or strided ones) are
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
wrong KV is never served. With more than one KV cache group vLLM takes no
block-level errors: a failed (async) load fails the request's restore
(``failed_recving``), and vLLM recomputes the request whole. A step in which vLLM did not wait for every layer
reports all its layer-wise blocks failed, since a layer may have been read
while it was written. Async loads (the default) are waited for between
steps, whole: no step reads their pages before then.

**Saves** copy pages on kvtier's threads, off vLLM's step, and the
:class:`~kvtier.vllm.flusher.Flusher` writes each on to G3 as soon as its
copy is done. Before a step's forward pass, ``handle_preemptions`` waits
for every save still copying from a block the step hands out anew (the
scheduler's fence, :mod:`.scheduler`).

**Start-up.** The first burst after a restart is when every prefix comes
from kvtier, so nothing a restore needs may still be starting then. The
worker waits in ``register_kv_caches`` until the store's read buffers are
warm: a restore that faults fresh memory in as it reads is slower than one
into resident memory, and a warming thread still running would compete with
the restores for the CPU. ``vllm:kvtier_fresh_buffers_total`` counts block
buffers taken from fresh memory after the start: it stays 0 while G2's
warmed budget lasts.

**Tensor parallelism.** Each rank opens the namespaces of the KV heads it
holds and answers the scheduler's lookups for them (:mod:`.lookup`); a
rank that lacks a block all the same reports it as a load error, so vLLM
recomputes it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..staging import KV_PER_BLOCK, LATENT, VLLM_BACKENDS, PageStaging
from ..store import Namespace, Transfer
from .config import ConnectorConfig
from .flusher import Flusher
from .groups import LATENT as LATENT_GROUP
from .groups import KvGroup, kv_groups
from .lookup import LookupServer, lookup_address
from .metadata import Job, KvtierConnectorMetadata
from .metrics import KvtierConnectorStats
from .namespace import KV_DTYPES, model_heads, open_head_namespace, store_for
from .threads import all_cpus

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM's logger of this name (vLLM's init_logger gives the same one).
logger = logging.getLogger("vllm.kvtier")


def page_arrangement(vllm_config: VllmConfig, layer: str, t: torch.Tensor, latent: bool = False) -> tuple[str, str]:
    """How the attention backend of ``layer`` arranges K and V in a page
    (:mod:`kvtier.staging`), from the backend vLLM chose for it, and that
    backend's name. A backend kvtier does not know is refused: guessing
    could serve wrong KV. Where vLLM does not say (no attention layer
    registered under that name), a CPU tensor is taken to be the CPU
    backend's (its MLA backend's for a ``latent`` group), the only one
    vLLM runs on the CPU."""
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    backend = getattr(ctx.get(layer), "attn_backend", None)
    if backend is None:
        if t.device.type == "cpu":
            return (LATENT if latent else KV_PER_BLOCK), "unnamed, on the CPU"
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
class GroupPages:
    """One KV cache group on this rank: its layer tensors, the namespace of
    each KV head it holds (in the order of the tensors' head axis) and,
    where pages cannot be copied in place, their staging."""

    group: KvGroup
    layers: list[torch.Tensor]
    spaces: list[Namespace]
    staging: PageStaging | None = None


@dataclass
class Running:
    """A job's transfers in flight on the worker side: one per KV head of
    each group it touches."""

    job: Job
    started: float
    #: (group position, head position, transfer, vLLM block ids).
    parts: list[tuple[int, int, Transfer, list[int]]] = field(default_factory=list)
    #: Host pages of a staged group, by group position.
    hosts: dict[int, torch.Tensor] = field(default_factory=dict)
    #: A load handing each layer over as it lands (a sync load's).
    layerwise: bool = False
    #: Every vLLM block id it reads or writes.
    block_ids: set[int] = field(default_factory=set)

    def done(self) -> bool:
        """Whether every transfer has finished."""
        return all(t.done() for _, _, t, _ in self.parts)

    def wait(self) -> list[tuple[int, list[Any]]]:
        """Waits for every transfer; per transfer its group position and
        results."""
        return [(g, t.wait() or []) for g, _, t, _ in self.parts]


class KvtierWorker:
    """The worker side of :class:`~kvtier.vllm.KvtierConnector`; ``rank``:
    this worker's tensor-parallel rank (default: vLLM's)."""

    def __init__(
        self, vllm_config: VllmConfig, config: ConnectorConfig, kv_cache_config: Any, rank: int | None = None
    ) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._kv_cache_config = kv_cache_config
        self._rank = rank
        self._layerwise = config.layerwise
        self._groups: list[GroupPages] = []
        #: Layer name -> (group position, layer position in the group).
        self._layer_at: dict[str, tuple[int, int]] = {}
        self._server: LookupServer | None = None
        #: This step's layer-wise loads, and the layers vLLM waited for.
        self._stepping: list[Running] = []
        self._waited: set[tuple[int, int]] = set()
        self._loads: dict[str, Running] = {}
        self._saves: list[Running] = []
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        self._stats = KvtierConnectorStats()
        #: The store's count of fresh block buffers when last reported.
        self._fresh_seen = 0
        self._flusher: Flusher | None = None

    @property
    def namespaces(self) -> list[Namespace]:
        """Every namespace this worker opened."""
        return [ns for g in self._groups for ns in g.spaces]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Takes the per-layer KV tensors, opens the namespaces of this
        rank's heads of every group (checking the tensors against their
        layouts) and answers the scheduler's lookups for them. The threads
        this starts (the store's, the flusher, the lookup server) may run on
        every CPU the process was given (see
        :func:`~kvtier.vllm.threads.all_cpus`)."""
        with all_cpus():
            self._register(kv_caches)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        rank = self._rank
        if rank is None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            try:
                rank = get_tensor_model_parallel_rank()
            except (AssertionError, RuntimeError):
                rank = 0
        warm = True
        for gi, group in enumerate(kv_groups(self._kv_cache_config)):
            heads = model_heads(self._vllm_config, group, rank)
            layers = [self._layer(kv_caches, group, n) for n in group.layer_names]
            spaces = []
            for h in heads.heads:
                spaces.append(open_head_namespace(self._vllm_config, self._config, group, heads, h, warm))
                warm = False
            arrangement, backend = page_arrangement(
                self._vllm_config, group.layer_names[0], layers[0], latent=group.kind == LATENT_GROUP
            )
            if (arrangement == LATENT) != (group.kind == LATENT_GROUP):
                raise ValueError(f"kvtier: the {backend} attention backend does not match a {group.kind} KV group")
            in_place = arrangement in (KV_PER_BLOCK, LATENT) and all(
                t.device.type == "cpu" and t.is_contiguous() for t in layers
            )
            staging = None if in_place and not self._config.force_staging else PageStaging(layers, arrangement)
            self._groups.append(GroupPages(group, layers, spaces, staging))
            for li, name in enumerate(group.layer_names):
                self._layer_at[name] = (gi, li)
            logger.info(
                "kvtier: worker rank %d, KV group %d (%s, %d layers, heads %s of %d): namespaces %s (%s), "
                "%d pages, %s backend, %s",
                rank,
                group.index,
                group.kind + (f" window {group.window}" if group.window else ""),
                len(layers),
                list(heads.heads),
                heads.total,
                ", ".join(ns.name for ns in spaces),
                store_for(self._config).cache_dir,
                layers[0].shape[0],
                backend,
                "in place" if staging is None else f"staged from {layers[0].device} ({arrangement})",
            )
        self._wait_warm()
        self._flusher = Flusher()
        self._server = LookupServer(
            *lookup_address(self._vllm_config, rank), [(g.group, g.spaces) for g in self._groups]
        )

    @staticmethod
    def _layer(kv_caches: dict[str, torch.Tensor], group: KvGroup, name: str) -> torch.Tensor:
        """The KV tensor of layer ``name``, checked against ``group``."""
        t = kv_caches.get(name)
        if t is None:
            raise ValueError(f"kvtier: vLLM registered no KV cache for layer {name} of KV group {group.index}")
        if group.kind == LATENT_GROUP:
            shapes = [(1, group.block_size, group.head_size), (group.block_size, group.head_size)]
        else:
            shapes = [(group.heads_per_rank, group.block_size, 2 * group.head_size)]
        dtype = KV_DTYPES.get(group.dtype)
        if tuple(t.shape[1:]) not in shapes or KV_DTYPES.get(t.dtype) != dtype:
            want = " or ".join("[num_blocks, " + ", ".join(map(str, s)) + "]" for s in shapes)
            raise ValueError(
                f"kvtier: layer {name} has a {t.dtype} KV cache of shape {tuple(t.shape)}; kvtier takes {want} {dtype}"
            )
        return t

    def _wait_warm(self) -> None:
        """Waits until the store's read buffers are warm (see "Start-up"),
        and notes the store's fresh-buffer count from then on."""
        started = time.monotonic()
        first = self.namespaces[0]
        first.wait_warm()
        st = first.stats()
        self._fresh_seen = self._fresh_buffers()
        if st.get("read_buffers_warm_target"):
            logger.info(
                "kvtier: %d of %d read buffers (%.0f MiB) faulted in at start, in %.1f s",
                st["read_buffers_warmed"],
                st["read_buffers_warm_target"],
                st["read_buffers_warmed"] * first.layout.slot_bytes / 2**20,
                time.monotonic() - started,
            )

    def _fresh_buffers(self) -> int:
        # One count for the store: its namespaces share their buffers.
        return int(self.namespaces[0].stats().get("fresh_buffers", 0))

    def _start(self, job: Job, save: bool, layerwise: bool = False) -> Running:
        r = Running(job, time.monotonic(), layerwise=layerwise, block_ids=job.block_ids())
        if len(job.blocks) != len(self._groups):
            raise RuntimeError(f"kvtier: a job of {len(job.blocks)} KV groups for a {len(self._groups)}-group model")
        for gi, (g, pairs) in enumerate(zip(self._groups, job.blocks, strict=True)):
            if not pairs:
                continue
            index = [i for i, _ in pairs]
            ids = [b for _, b in pairs]
            layers: list[torch.Tensor] = g.layers
            pages: list[int] = ids
            if g.staging is not None:
                host = g.staging.gather(ids) if save else g.staging.buffer(len(ids))
                r.hosts[gi] = host
                layers = [host[li] for li in range(host.shape[0])]
                pages = list(range(len(ids)))
            for hi, ns in enumerate(g.spaces):
                chain = ns.token_keys(job.tokens, salt=job.salt)
                if index[-1] >= len(chain):
                    raise RuntimeError(f"kvtier: {len(chain)} keys for block {index[-1]} of {job.req_id}")
                keys = [chain[i] for i in index]
                part = (hi, len(g.spaces))
                if save:
                    t = ns.save_pages(keys, layers, pages, part=part)
                else:
                    t = ns.load_pages(keys, layers, pages, layerwise=layerwise, part=part)
                r.parts.append((gi, hi, t, ids))
        return r

    def handle_preemptions(self, meta: KvtierConnectorMetadata) -> None:
        """Before the step's forward pass: waits for the saves still
        copying from a block this step hands out anew (the fence)."""
        if not meta.fence:
            return
        for r in self._saves:
            if r.block_ids & meta.fence:
                r.wait()

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
        unwaited = sorted(set(self._layer_at.values()) - waited)
        if unwaited:
            logger.warning(
                "kvtier: vLLM did not wait for layer(s) %s (group, layer) in this step; its layer-wise "
                "restores are reported failed and recomputed",
                unwaited,
            )
        for r in runs:
            self._finish_load(r, trusted=not unwaited)

    def _finish_load(self, r: Running, trusted: bool = True) -> None:
        """Counts a finished load's blocks and notes those that failed (all
        of them unless ``trusted``) for vLLM to recompute: as block ids for
        a one-group model, as a failed request otherwise."""
        failed: set[int] = set()
        why: set[str] = set()
        for (_, _, _, ids), (_, results) in zip(r.parts, r.wait(), strict=True):
            for b, res in zip(ids, results, strict=True):
                if not (res.ok and trusted):
                    failed.add(b)
                    if not res.ok:
                        why.add(res.status + (f" ({res.reason})" if res.reason else ""))
        if not r.layerwise:
            for gi, host in r.hosts.items():
                staging = self._groups[gi].staging
                assert staging is not None
                staging.scatter(host, [b for _, b in r.job.blocks[gi]])
        blocks = len(r.block_ids)
        self._stats.loaded(blocks - len(failed), len(failed), time.monotonic() - r.started, r.layerwise)
        if not failed:
            return
        if len(self._groups) > 1:
            self._failed_loads.add(r.job.req_id)
        else:
            self._load_errors.update(failed)
        logger.warning(
            "kvtier: %d of %d blocks of request %s not restored (%s): vLLM recomputes %s",
            len(failed),
            blocks,
            r.job.req_id,
            "; ".join(sorted(why)) or "not waited for",
            "them" if len(self._groups) == 1 else "the request",
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Waits until this layer of every layer-wise load of the step is
        in vLLM's pages (staged: copied to the device too); returns at once
        without such loads (see "Layer pipelining")."""
        if not self._stepping:
            return
        at = self._layer_at.get(layer_name)
        if at is None:
            return
        gi, li = at
        for r in self._stepping:
            for g, _, t, _ in r.parts:
                if g == gi:
                    t.wait_layer(li)  # releases the GIL
            host = r.hosts.get(gi)
            staging = self._groups[gi].staging
            if host is not None and staging is not None:
                staging.scatter(host, [b for _, b in r.job.blocks[gi]], layer=li)
        self._waited.add(at)

    def wait_for_save(self, meta: KvtierConnectorMetadata) -> None:
        """Starts this step's saves on kvtier's threads and returns: a
        block handed out again waits for them in :meth:`handle_preemptions`."""
        for job in meta.saves:
            r = self._start(job, save=True)
            self._saves.append(r)
            if self._flusher is not None:
                for gi, hi, t, _ in r.parts:
                    self._flusher.add(self._groups[gi].spaces[hi], t)
        meta.saves = []

    def _reap_saves(self) -> None:
        """Counts the saves that are done, by vLLM block (stored when a
        head of it was written, failed when one was not), and lets them
        go."""
        running: list[Running] = []
        for r in self._saves:
            if not r.done():
                running.append(r)
                continue
            stored: set[int] = set()
            failed: dict[int, Any] = {}
            for (_, _, _, ids), (_, results) in zip(r.parts, r.wait(), strict=True):
                for b, res in zip(ids, results, strict=True):
                    if not res.ok:
                        failed.setdefault(b, res)
                    elif res.status == "stored":
                        stored.add(b)
            self._stats.saved(len(stored - set(failed)), len(failed), time.monotonic() - r.started)
            if failed:
                logger.warning(
                    "kvtier: %d blocks of request %s not saved: %s",
                    len(failed),
                    r.job.req_id,
                    next(iter(failed.values())),
                )
        self._saves = running

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose async loads are done (receiving), and those of
        them that failed (vLLM recomputes them whole)."""
        self._reap_saves()
        recving: set[str] = set()
        for req_id, r in list(self._loads.items()):
            if r.done():
                del self._loads[req_id]
                self._finish_load(r)
                recving.add(req_id)
        failed, self._failed_loads = self._failed_loads, set()
        return recving | failed, failed

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
        if self._groups:
            # Only loads and saves take buffers: brought up to date when one
            # has finished, the count loses none (a load still running is
            # counted in a later interval).
            fresh = self._fresh_buffers()
            self._stats.data["fresh_buffers"] += fresh - self._fresh_seen
            self._fresh_seen = fresh
        stats, self._stats = self._stats, KvtierConnectorStats()
        return stats

    def shutdown(self) -> None:
        """Waits for loads and saves in flight, then writes G2 to G3. vLLM
        calls it on a stop it lets finish (``--shutdown-timeout`` above 0);
        one that kills the worker first loses only the saves still being
        copied (see :mod:`~kvtier.vllm.flusher`)."""
        for r in list(self._loads.values()) + self._saves + self._stepping:
            r.wait()
        self._stepping.clear()
        self._loads.clear()
        self._saves.clear()
        if self._flusher is not None:
            self._flusher.stop()
        if self._server is not None:
            self._server.close()
        for ns in self.namespaces:
            ns.flush()
        if self._groups:
            logger.info(
                "kvtier: stopped; every saved block is in G3 (namespaces %s)",
                ", ".join(ns.name for ns in self.namespaces),
            )
