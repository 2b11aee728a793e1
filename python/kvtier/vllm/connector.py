"""The class vLLM loads: :class:`KvtierConnector`, a ``KVConnectorBase_V1``
that hands each call to its scheduler side (:mod:`.scheduler`) or its
worker side (:mod:`.worker`), whichever role vLLM built it for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .config import ConnectorConfig
from .groups import kv_groups
from .metadata import KvtierConnectorMetadata
from .metrics import KvtierConnectorStats, KvtierPromMetrics
from .scheduler import KvtierScheduler
from .worker import KvtierWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvtier's tiered store (docs/guides/vllm.md
    lists its configuration; :mod:`kvtier.vllm` its modules). It supports
    vLLM's hybrid KV cache manager (``SupportsHMA``): every KV cache group
    is kept under its own keys (:mod:`.groups`)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("kvtier: vLLM built the connector without its KV cache config (vLLM 0.32 or later)")
        config = ConnectorConfig.from_vllm(vllm_config)
        self._scheduler: KvtierScheduler | None = None
        self._worker: KvtierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvtierScheduler(vllm_config, config, kv_groups(kv_cache_config), self._table)
        else:
            self._worker = KvtierWorker(vllm_config, config, kv_cache_config)

    def _table(self, req_id: str) -> tuple[list[int], ...]:
        """A request's current block table, per KV cache group."""
        if self._kv_cache_manager is None:
            raise RuntimeError("kvtier: vLLM did not bind its KV cache manager to the connector")
        table: tuple[list[int], ...] = self._kv_cache_manager.get_block_ids(req_id)
        return table

    @property
    def scheduler_side(self) -> KvtierScheduler:
        """The scheduler side; a ``RuntimeError`` on a worker."""
        if self._scheduler is None:
            raise RuntimeError("kvtier: a scheduler call on the connector's worker side")
        return self._scheduler

    @property
    def worker_side(self) -> KvtierWorker:
        """The worker side; a ``RuntimeError`` on the scheduler."""
        if self._worker is None:
            raise RuntimeError("kvtier: a worker call on the connector's scheduler side")
        return self._worker

    def _metadata(self) -> KvtierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        return meta

    # ---------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose blocks kvtier holds."""
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queues the load of the blocks vLLM allocated for the external
        tokens."""
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Hands this step's loads, saves and fence to the workers."""
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Notes the async loads the workers finished."""
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request (its blocks were saved step by step); holds
        its blocks only while an async load still writes them."""
        return self.scheduler_side.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` under the hybrid KV cache manager."""
        return self.scheduler_side.request_finished(request)

    # ------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Opens this rank's namespaces over the per-layer KV tensors."""
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward pass: waits for saves still copying
        from blocks the step hands out anew."""
        assert isinstance(kv_connector_metadata, KvtierConnectorMetadata)
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Starts every load of this step at once."""
        self.worker_side.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Waits until this layer of the step's layer-wise loads is in
        vLLM's pages."""
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: saves copy whole blocks after the forward
        pass (see :meth:`wait_for_save`)."""
        return

    def wait_for_save(self) -> None:
        """Starts this step's saves on kvtier's threads and returns: a
        block handed out again waits for them (:meth:`handle_preemptions`)."""
        if not self.has_connector_metadata():
            return
        self.worker_side.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose async loads are done (receiving); kvtier holds no
        blocks for saves, so none is ever sending."""
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Async loads done, and those of them that failed (with more than
        one KV cache group, vLLM recomputes such a request whole)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        recving, failed = self._worker.get_finished()
        return KVConnectorTransferResults(finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM
        recomputes them)."""
        if self._worker is None:
            return set()
        return self._worker.get_block_ids_with_load_errors()

    # ----------------------------------------------------------- both sides

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Blocks and seconds of loads and saves since the last call (the
        worker's; vLLM asks the scheduler too, which has none)."""
        if self._worker is None:
            return None
        return self._worker.get_kv_connector_stats()

    def shutdown(self) -> None:
        """On a worker: waits for loads and saves in flight, then writes G2
        to G3."""
        if self._worker is not None:
            self._worker.shutdown()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads wait inside the attention layers, which a
        captured CUDA graph would skip: vLLM must run those in pieces."""
        return ConnectorConfig.from_extra(extra_config, check_keys=False).layerwise

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
