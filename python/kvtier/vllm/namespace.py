"""The store and the namespaces a worker of the connector opens.

One store per cache directory and process: vLLM builds the scheduler and
the worker side in one process on the CPU backend, and a store directory has
one owner, so two stores must never share one. A namespace is one KV head of
one KV cache group (:mod:`.groups`): its layout is the group's layers with
one head, and its fingerprint names the model, the group and the object
scheme, so groups never mix and a head's objects are the same whichever
rank wrote them."""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any

import torch

from ..store import Layout, Namespace, Store
from .config import ConnectorConfig
from .groups import LATENT, KvGroup, RankHeads, kv_groups, rank_heads
from .keys import served_model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The KV cache dtypes kvtier stores, by torch dtype.
KV_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def group_layout(group: KvGroup, heads: RankHeads, head: int, codec: str = "none") -> Layout:
    """The layout of one object of ``group``: head ``head`` of
    ``heads.total`` in every layer of the group (MLA: the latent rows)."""
    dtype = KV_DTYPES.get(group.dtype)
    if dtype is None:
        raise ValueError(f"kvtier: KV cache dtype {group.dtype} is not supported (f32, f16, bf16)")
    layers = len(group.layer_names)
    if group.kind == LATENT:
        return Layout(layers, 1, group.head_size, group.block_size, dtype, arrangement="latent", codec=codec)
    return Layout.vllm_cpu(
        layers,
        1,
        group.head_size,
        block_tokens=group.block_size,
        dtype=dtype,
        tp_rank=head,
        tp_world=heads.total,
        codec=codec,
    )


def model_heads(vllm_config: VllmConfig, group: KvGroup, rank: int) -> RankHeads:
    """The heads of ``group`` that ``rank`` holds, checked against what
    vLLM gave the group per rank."""
    world = int(vllm_config.parallel_config.tensor_parallel_size)
    total = 1 if group.kind == LATENT else int(vllm_config.model_config.get_total_num_kv_heads())
    heads = rank_heads(total, rank, world)
    if len(heads.heads) != group.heads_per_rank:
        raise ValueError(
            f"kvtier: KV cache group {group.index} has {group.heads_per_rank} KV heads per rank; "
            f"{total} heads over {world} ranks give {len(heads.heads)}"
        )
    return heads


def store_for(config: ConnectorConfig) -> Store:
    """This process's store of ``config.cache_dir``, opened on first use."""
    with _STORES_LOCK:
        store = _STORES.get(config.cache_dir)
        if store is None:
            os.makedirs(config.cache_dir, exist_ok=True)
            store = Store(config.cache_dir, g2_bytes=config.g2_bytes, g3_bytes=config.g3_bytes, remote=config.remote)
            _STORES[config.cache_dir] = store
        return store


def open_head_namespace(
    vllm_config: VllmConfig,
    config: ConnectorConfig,
    group: KvGroup,
    heads: RankHeads,
    head: int,
    warm: bool,
    store: Store | None = None,
) -> Namespace:
    """The namespace of head ``head`` of ``group`` (this rank's copy of it
    when several ranks hold it) in ``store`` (default: this process's store
    of the cache directory); ``warm``: fault in its read buffers at open,
    unless ``warm_read_buffers`` is false."""
    base = config.fingerprint or served_model_fingerprint(vllm_config)
    scope: dict[str, Any] = {"group": group.descriptor()}
    if heads.replica:
        scope["replica"] = heads.replica
    name = config.namespace
    if name is not None:
        name = f"{name}-g{group.index}-h{head}of{heads.total}" + (f"-r{heads.replica}" if heads.replica else "")
    return (store or store_for(config)).namespace(
        group_layout(group, heads, head, config.kv_offload_codec),
        fingerprint=base + "\0" + json.dumps(scope, sort_keys=True),
        name=name,
        warm_read_buffers=warm and config.warm_read_buffers,
    )


def connector_namespaces(
    vllm_config: VllmConfig, kv_cache_config: Any, rank: int = 0, warm: bool = False, store: Store | None = None
) -> dict[int, list[Namespace]]:
    """The store namespaces :class:`~kvtier.vllm.KvtierConnector`'s worker
    of ``rank`` uses, per KV cache group (by index), one per KV head the
    rank holds in the order of its tensors' head axis (to inspect or prepare
    a cache from outside vLLM); ``warm``: fault in the read buffers at open
    (``Store.namespace(warm_read_buffers=True)``) in the first one, as the
    worker does unless ``warm_read_buffers`` is false (G2 is shared, so
    once is enough). ``store``: open them there (a store of
    ``cache_dir`` the caller closes, so a vLLM can open the directory after
    it) instead of in this process's own store of the directory."""
    config = ConnectorConfig.from_vllm(vllm_config)
    out: dict[int, list[Namespace]] = {}
    for group in kv_groups(kv_cache_config):
        heads = model_heads(vllm_config, group, rank)
        out[group.index] = [
            open_head_namespace(vllm_config, config, group, heads, h, warm and not out and i == 0, store)
            for i, h in enumerate(heads.heads)
        ]
    return out
