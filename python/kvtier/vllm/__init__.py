"""kvtier under vLLM: :class:`KvtierConnector`, a KV connector
(``KVConnectorBase_V1``) that keeps every computed prefix block in kvtier's
tiered store (G2 host memory, G3 a directory, G4 a shared Redis/Valkey or S3
pool) and restores it instead of recomputing, across requests, restarts and
nodes. Every block is verified on the way back; a block that is missing or
corrupt is reported to vLLM, which recomputes it: wrong KV is never served.

Start vLLM with ``--kv-transfer-config '{"kv_connector": "KvtierConnector",
"kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'``;
hybrid models keep vLLM's hybrid KV cache manager. docs/guides/vllm.md describes every
``kv_connector_extra_config`` key (:class:`~kvtier.vllm.config.ConnectorConfig`
holds them) and the decisions the connector makes.

The modules, one concept each:

- :mod:`.connector`: the class vLLM loads, handing each call to a side;
- :mod:`.config`: the ``kv_connector_extra_config`` keys and defaults;
- :mod:`.keys`: what names a block besides its tokens (model fingerprint,
  request salt);
- :mod:`.groups`: KV cache groups (full, sliding-window, MLA) and the KV
  heads a tensor-parallel rank holds;
- :mod:`.namespace`: the store of a cache directory and the namespace of
  each group and KV head;
- :mod:`.lookup`: the sockets the scheduler asks every rank's worker
  through;
- :mod:`.metadata`: the loads and saves handed to the workers each step;
- :mod:`.scheduler`: the scheduler side (lookups, what to load and save);
- :mod:`.worker`: the worker side (loads, layer by layer or between steps,
  saves, load errors);
- :mod:`.flusher`: saves written on to G3 as soon as they are copied;
- :mod:`.threads`: where the connector's threads run;
- :mod:`.metrics`: connector stats and the ``vllm:kvtier_*`` series.
"""

from __future__ import annotations

from .connector import KvtierConnector
from .keys import model_fingerprint, request_salt
from .metadata import KvtierConnectorMetadata
from .metrics import KvtierConnectorStats, KvtierPromMetrics
from .namespace import connector_namespaces

__all__ = [
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "KvtierConnectorStats",
    "KvtierPromMetrics",
    "connector_namespaces",
    "model_fingerprint",
    "request_salt",
]
