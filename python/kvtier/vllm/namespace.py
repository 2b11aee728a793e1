"""The store and the namespace a worker of the connector opens.

One store per cache directory and process: vLLM builds the scheduler and
the worker side in one process on the CPU backend, and a store directory has
one owner, so two stores must never share one. A namespace is one rank's
block layout under the model's fingerprint: each tensor-parallel rank keeps
its own shard (the layout carries rank and world)."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import torch

from ..store import Layout, Namespace, Store
from .config import ConnectorConfig
from .keys import served_model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The KV cache dtypes kvtier stores, by torch dtype.
KV_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def vllm_layout(vllm_config: VllmConfig, rank: int, codec: str = "none") -> Layout:
    """The per-rank block layout vLLM's config implies (the workers check
    it against the tensors they are given)."""
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype

    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    torch_dtype = get_kv_cache_torch_dtype(vllm_config.cache_config.cache_dtype, mc.dtype)
    dtype = KV_DTYPES.get(torch_dtype)
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


def store_for(config: ConnectorConfig) -> Store:
    """This process's store of ``config.cache_dir``, opened on first use."""
    with _STORES_LOCK:
        store = _STORES.get(config.cache_dir)
        if store is None:
            os.makedirs(config.cache_dir, exist_ok=True)
            store = Store(config.cache_dir, g2_bytes=config.g2_bytes, g3_bytes=config.g3_bytes, remote=config.remote)
            _STORES[config.cache_dir] = store
        return store


def open_namespace(vllm_config: VllmConfig, config: ConnectorConfig, rank: int, warm: bool) -> Namespace:
    """The namespace of ``rank`` under ``config``; ``warm``: fault in its
    read buffers at open, unless ``warm_read_buffers`` is false."""
    return store_for(config).namespace(
        vllm_layout(vllm_config, rank, config.kv_offload_codec),
        fingerprint=config.fingerprint or served_model_fingerprint(vllm_config),
        name=config.namespace,
        warm_read_buffers=warm and config.warm_read_buffers,
    )


def connector_namespace(vllm_config: VllmConfig, rank: int = 0, warm: bool = False) -> Namespace:
    """The store namespace :class:`~kvtier.vllm.KvtierConnector` uses for
    ``rank`` (to inspect or prepare a cache from outside vLLM); ``warm``:
    fault in its read buffers at open (``Store.namespace(warm_read_buffers=True)``),
    as the worker does unless ``warm_read_buffers`` is false."""
    return open_namespace(vllm_config, ConnectorConfig.from_vllm(vllm_config), rank, warm)
