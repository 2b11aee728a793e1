"""The connector's scheduler side: which tokens of a request kvtier holds,
which blocks to load into and which to save.

A lookup asks rank 0's worker over the lookup socket (:mod:`.lookup`),
connected when the scheduler is built, so the first request after a start
does not wait for it. A hit is whole blocks; the prompt's last token is
always computed. Loads are queued once vLLM has allocated the blocks.

What is saved: the full blocks of a request's prompt that kvtier did not
hold, once the request finishes. Its blocks stay held (``request_finished``
returns true) until the worker reports the save done in ``get_finished``,
so the pages are not reused while they are copied; a request whose async
load is still writing its pages is held until the load is done."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import ConnectorConfig
from .keys import salt_of
from .lookup import LookupClient, lookup_address
from .metadata import Job, KvtierConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# vLLM's logger of this name (vLLM's init_logger gives the same one).
logger = logging.getLogger("vllm.kvtier")


@dataclass
class Match:
    """The last lookup of a request (``get_num_new_matched_tokens``)."""

    local_tokens: int
    hit_blocks: int


class KvtierScheduler:
    """The scheduler side of :class:`~kvtier.vllm.KvtierConnector`."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        self._block_size: int = vllm_config.cache_config.block_size
        self._load_async = config.load_async
        ktc = vllm_config.kv_transfer_config
        if getattr(ktc, "kv_load_failure_policy", "") != "recompute":
            logger.warning(
                "kvtier: kv_load_failure_policy is %r: a block that fails its checksum fails its "
                'request; set "kv_load_failure_policy": "recompute" to recompute it instead',
                getattr(ktc, "kv_load_failure_policy", None),
            )
        self._lookup = LookupClient(*lookup_address(vllm_config))
        self._lookup.connect_now()
        self._matches: dict[str, Match] = {}
        self._loading: set[str] = set()
        self._pending_loads: list[Job] = []
        self._pending_saves: list[Job] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose blocks kvtier holds
        (whole blocks; the prompt's last token is always computed)."""
        if getattr(request, "mm_features", None):
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        cacheable = (len(tokens) - 1) // self._block_size
        if cacheable <= num_computed_tokens // self._block_size:
            return 0, False
        hit = self._lookup.lookup(tokens[: cacheable * self._block_size], salt_of(request))
        external = hit * self._block_size - num_computed_tokens
        # A pure memo of the last answer (vLLM may ask again): used by
        # update_state_after_alloc and request_finished.
        self._matches[request.request_id] = Match(num_computed_tokens, hit)
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
            Job(request.request_id, tokens, salt_of(request), first, block_ids[first : first + count])
        )
        if self._load_async:
            self._loading.add(request.request_id)

    def build_connector_meta(self) -> KvtierConnectorMetadata:
        """Hands this step's loads and saves to the workers."""
        meta = KvtierConnectorMetadata(self._pending_loads, self._pending_saves, self._load_async)
        self._pending_loads = []
        self._pending_saves = []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
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
            Job(
                request.request_id,
                tokens[: full * self._block_size],
                salt_of(request),
                known,
                list(block_ids[known:full]),
            )
        )
        return True, None
