"""What a vLLM served with kvtier's connector left in a cache directory,
seen from the test process while no vLLM runs on it: the namespaces of its
KV cache groups and heads (opened in a store the caller drops before the
next vLLM starts), and a block flipped on disk.

vLLM's KV cache config is rebuilt here from the test models' shapes, with
vLLM's own spec classes: what a server's worker registered."""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvtier import Store
from kvtier.vllm import connector_namespaces


def _layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def llama_kv(layers: int = 4, heads: int = 2, head: int = 64) -> KVCacheConfig:
    """A plain model's config: one full-attention group, block 128."""
    spec = FullAttentionSpec(block_size=128, num_kv_heads=heads, head_size=head, dtype=torch.float32)
    return KVCacheConfig(0, [], [KVCacheGroupSpec([_layer(i) for i in range(layers)], spec)])


def gemma2_kv(layers: int = 4, heads: int = 2, head: int = 64, window: int = 64) -> KVCacheConfig:
    """make_model's Gemma 2 under the hybrid manager: sliding-window layers
    0, 2, ... and full layers 1, 3, ... in two groups, block 128."""
    sw = SlidingWindowSpec(
        block_size=128, num_kv_heads=heads, head_size=head, dtype=torch.float32, sliding_window=window
    )
    full = FullAttentionSpec(block_size=128, num_kv_heads=heads, head_size=head, dtype=torch.float32)
    return KVCacheConfig(
        0,
        [],
        [
            KVCacheGroupSpec([_layer(i) for i in range(0, layers, 2)], sw),
            KVCacheGroupSpec([_layer(i) for i in range(1, layers, 2)], full),
        ],
    )


def mla_kv(layers: int = 4) -> KVCacheConfig:
    """make_model's DeepSeek-V2 on the CPU: one MLA group, block 16, a
    576-value latent row per token."""
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    return KVCacheConfig(0, [], [KVCacheGroupSpec([_layer(i) for i in range(layers)], spec)])


def _config(cache_dir: Path, model: str, total_heads: int, tp: int) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, get_total_num_kv_heads=lambda: total_heads),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"cache_dir": str(cache_dir)}),
    )


def corrupt(
    cache_dir: Path,
    model: str,
    kv: KVCacheConfig,
    tokens: list[int],
    block: int,
    group: int = 0,
    head: int = 0,
    total_heads: int = 2,
) -> tuple[str, int]:
    """Flips one payload byte of ``block`` of ``tokens`` (KV ``head`` of
    ``group``) in the G3 of ``cache_dir``, as a TP=1 worker names it.
    Returns (file, slot offset)."""
    store = Store(str(cache_dir))
    spaces = connector_namespaces(_config(cache_dir, model, total_heads, 1), kv, store=store)
    ns = spaces[group][head]
    where = ns.locate(ns.token_keys(tokens)[block])
    if where is None:
        raise AssertionError(f"block {block} of group {group}, head {head} is not on disk in {ns.name}")
    path, offset = where
    del ns, spaces, store
    gc.collect()
    flip(path, offset + 128 + 1000)
    return path, offset


def flip(path: str, at: int) -> None:
    """Flips every bit of the byte at ``at`` of the file ``path``."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
