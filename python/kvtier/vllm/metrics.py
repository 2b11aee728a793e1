"""The connector's figures: per-interval counts the workers report to vLLM
(:class:`KvtierConnectorStats`) and the series vLLM's ``/metrics`` shows
for them (:class:`KvtierPromMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The counts of :class:`KvtierConnectorStats`, each a series
#: ``vllm:kvtier_<key>_total`` but ``save_s``.
STAT_KEYS = (
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
        for k in STAT_KEYS:
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
        # Counts and seconds side by side.
        fresh: dict[str, int | float] = dict.fromkeys(STAT_KEYS, 0)
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in STAT_KEYS:
            self.data[k] += other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data[k] for k in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in STAT_KEYS)


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
        # vLLM's counter children (prometheus_client's, through vLLM's
        # wrapper class): untyped here, as vLLM is.
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
            self._counters[key] = {idx: c.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            v = transfer_stats_data.get(key, 0)
            if v and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
