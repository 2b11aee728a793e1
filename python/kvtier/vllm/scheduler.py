"""The connector's scheduler side: which tokens of a request kvtier holds,
which blocks to load into and which to save.

A lookup asks every tensor-parallel rank's worker over its lookup socket
(:mod:`.lookup`), connected when the scheduler is built, so the first
request after a start does not wait for it. A hit is whole blocks that every
KV cache group holds (a sliding-window group only inside its window,
:func:`~.groups.hit_end`); the prompt's last token is always computed.
Loads are queued once vLLM has allocated the blocks.

What is saved: every full block of a request's prompt that kvtier did not
hold, in the step that computes it. A sliding-window group's blocks are
freed as the window moves on, so they cannot wait for the request to
finish. The worker copies a step's saves after its forward pass, off vLLM's
step, and vLLM may hand a block out again once its request no longer needs
it; so every step's metadata names the blocks handed out in it (the
*fence*), and the worker waits for any save still copying from one of
them before the step writes into it (``handle_preemptions``, before the
forward pass). Blocks are therefore never held for a save: a request's
blocks are freed when it finishes, unless an async load is still writing
them.

With more than one KV cache group, vLLM takes no block-level load errors,
only a failed request (``failed_recving``, recomputed whole), which only
async loads can report: ``load_async`` false is refused for such models."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import ConnectorConfig
from .groups import NULL_BLOCK, KvGroup, hit_end
from .keys import salt_of
from .lookup import LookupClient, lookup_address
from .metadata import Job, KvtierConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# vLLM's logger of this name (vLLM's init_logger gives the same one).
logger = logging.getLogger("vllm.kvtier")


@dataclass
class Tracked:
    """A request the connector may save blocks of."""

    tokens: list[int]
    salt: bytes
    #: Blocks ``[0, known)`` are in kvtier or being saved.
    known: int
    #: vLLM's computed tokens at the last lookup, and the hit's end in
    #: blocks (``update_state_after_alloc`` loads ``[local, hit)``).
    local_tokens: int = 0
    hit_blocks: int = 0


class KvtierScheduler:
    """The scheduler side of :class:`~kvtier.vllm.KvtierConnector`.

    ``block_ids`` gives a request's current block table per group (vLLM's
    ``KVCacheManager.get_block_ids``, bound after the connector is
    built)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: ConnectorConfig,
        groups: list[KvGroup],
        block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> None:
        self._groups = groups
        self._block_size = groups[0].block_size
        self._load_async = config.load_async
        self._block_ids = block_ids
        if len(groups) > 1 and not config.load_async:
            raise ValueError(
                f"kvtier: this model has {len(groups)} KV cache groups, and vLLM recomputes a failed restore "
                'of such a model only when it is asynchronous: leave "load_async" true'
            )
        ktc = vllm_config.kv_transfer_config
        if getattr(ktc, "kv_load_failure_policy", "") != "recompute":
            logger.warning(
                "kvtier: kv_load_failure_policy is %r: a block that fails its checksum fails its "
                'request; set "kv_load_failure_policy": "recompute" to recompute it instead',
                getattr(ktc, "kv_load_failure_policy", None),
            )
        world = int(vllm_config.parallel_config.tensor_parallel_size)
        self._lookups = [LookupClient(*lookup_address(vllm_config, r)) for r in range(world)]
        for client in self._lookups:
            client.connect_now()
        self._tracked: dict[str, Tracked] = {}
        self._loading: set[str] = set()
        self._pending_loads: list[Job] = []

    def _present(self, tokens: list[int], salt: bytes) -> list[bytes] | None:
        """Per group, which whole blocks of ``tokens`` every rank holds;
        None when a rank did not answer (a miss)."""
        n = len(tokens) // self._block_size
        merged = [bytearray(b"\1" * n) for _ in self._groups]
        for client in self._lookups:
            answer = client.lookup(tokens, salt)
            if len(answer) != n * len(self._groups):
                return None
            for g, flags in enumerate(merged):
                for i in range(n):
                    flags[i] &= answer[g * n + i]
        return [bytes(f) for f in merged]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose blocks kvtier holds
        (whole blocks; the prompt's last token is always computed)."""
        if getattr(request, "mm_features", None):
            return 0, False
        bs = self._block_size
        tokens = list(request.prompt_token_ids or [])
        salt = salt_of(request)
        t = self._tracked.get(request.request_id)
        if t is None:
            t = self._tracked[request.request_id] = Tracked(tokens, salt, known=0)
        first = num_computed_tokens // bs
        cacheable = (len(tokens) - 1) // bs
        hit, held = first, 0
        if cacheable > first:
            present = self._present(tokens[: cacheable * bs], salt)
            if present is not None:
                hit = hit_end(self._groups, [p[first:] for p in present], first, cacheable)
                # The blocks every group holds from the start: where vLLM's
                # own cache had blocks kvtier lacks, they are saved again.
                held = min((p + b"\0").index(0) for p in present)
        # A pure memo of the last answer (vLLM may ask again): used by
        # update_state_after_alloc; what kvtier holds need not be saved.
        t.local_tokens, t.hit_blocks = num_computed_tokens, hit
        t.known = max(t.known, hit if held >= first else held)
        external = hit * bs - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, self._load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queues the load of the blocks vLLM allocated for the external
        tokens: per group, those it needs (not the null blocks a sliding
        window left out)."""
        if num_external_tokens <= 0:
            return
        bs = self._block_size
        t = self._tracked.get(request.request_id)
        if t is None or num_external_tokens % bs or t.local_tokens % bs:
            raise RuntimeError(
                f"kvtier: {num_external_tokens} external tokens for request {request.request_id} "
                "do not match its lookup"
            )
        first = t.local_tokens // bs
        end = first + num_external_tokens // bs
        tables = blocks.get_block_ids()
        if end > t.hit_blocks or len(tables) != len(self._groups) or any(len(ids) < end for ids in tables):
            raise RuntimeError(f"kvtier: request {request.request_id} has too few blocks for its load")
        pairs = [[(i, ids[i]) for i in range(first, end) if ids[i] != NULL_BLOCK] for ids in tables]
        self._pending_loads.append(Job(request.request_id, t.tokens[: end * bs], t.salt, pairs))
        if self._load_async:
            self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        """Hands this step's loads, the saves of the blocks this step
        computes and the fence to the workers."""
        bs = self._block_size
        fence: set[int] = set()
        scheduled: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append((new.req_id, new.num_computed_tokens))
            fence.update(b for ids in new.block_ids for b in ids)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            scheduled.append((req_id, cached.num_computed_tokens[i]))
            if cached.new_block_ids[i] is not None:
                fence.update(b for ids in cached.new_block_ids[i] for b in ids)
        saves: list[Job] = []
        for req_id, computed in scheduled:
            t = self._tracked.get(req_id)
            if t is None:
                continue
            # vLLM computes again from ``computed`` (after a preemption or a
            # failed restore): those blocks are saved again as they come.
            start = min(t.known, computed // bs)
            done = min(computed + scheduler_output.num_scheduled_tokens.get(req_id, 0), len(t.tokens)) // bs
            if done <= start:
                continue
            tables = self._block_ids(req_id)
            pairs = [[(i, ids[i]) for i in range(start, min(done, len(ids))) if ids[i] != NULL_BLOCK] for ids in tables]
            if any(pairs):
                saves.append(Job(req_id, t.tokens[: done * bs], t.salt, pairs))
            t.known = done
        loads, self._pending_loads = self._pending_loads, []
        for job in loads:
            fence |= job.block_ids()
        fence.discard(NULL_BLOCK)
        return KvtierConnectorMetadata(loads, saves, self._load_async, fence)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Notes the async loads the workers finished."""
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request; holds its blocks only while an async load
        is still writing them (freed when the load finishes). Its saves
        were handed out step by step, and the fence keeps them safe."""
        self._tracked.pop(request.request_id, None)
        return request.request_id in self._loading, None
