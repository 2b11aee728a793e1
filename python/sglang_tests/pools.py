"""Real SGLang host pools on the CPU and kvtier's backend built through
SGLang's own StorageBackendFactory, for the checks and the benchmark.

The host pools are SGLang's own (MHATokenToKVPoolHost, MLATokenToKVPoolHost)
with ``pin_memory=False``: pinning needs a GPU driver. Their device buffers
are CPU tensors of the shapes SGLang's device pools have; the backend only
touches the host pool's buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@dataclass(frozen=True)
class PoolSpec:
    """One host pool: MHA or MLA, its layout and geometry."""

    kind: str  # "mha" or "mla"
    layout: str  # "layer_first", "page_first", ...
    layers: int = 4
    heads: int = 2  # MHA: KV heads
    head_dim: int = 64  # MHA: head width; MLA: kv_lora_rank
    rope_dim: int = 16  # MLA: qk_rope_head_dim
    page_size: int = 16
    tokens: int = 512  # device capacity; the host pool holds twice as many
    dtype: str = "f32"

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.layout}-{self.dtype}"


def _ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def make_pool(spec: PoolSpec) -> Any:
    """SGLang's host pool of ``spec`` on the CPU (twice the device capacity)."""
    dtype = DTYPES[spec.dtype]
    cpu = torch.device("cpu")
    if spec.kind == "mha":
        k = tuple(torch.zeros(spec.tokens, spec.heads, spec.head_dim, dtype=dtype) for _ in range(spec.layers))
        v = tuple(torch.zeros(spec.tokens, spec.heads, spec.head_dim, dtype=dtype) for _ in range(spec.layers))
        info = MHABufferInfo(
            buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
            page_size=spec.page_size,
            head_num=spec.heads,
            head_dim=spec.head_dim,
            v_head_dim=spec.head_dim,
            dtype=dtype,
            device=cpu,
        )
        return MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            spec.page_size,
            spec.layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=spec.tokens,
            start_layer=0,
            end_layer=spec.layers,
        )
    if spec.kind == "mla":
        width = spec.head_dim + spec.rope_dim
        bufs = tuple(torch.zeros(spec.tokens, 1, width, dtype=dtype) for _ in range(spec.layers))
        mla = MLABufferInfo(
            buffers=bufs,
            data_ptrs=_ptrs(bufs),
            layer_indices=tuple(range(spec.layers)),
            device_layer_num=spec.layers,
            page_size=spec.page_size,
            kv_lora_rank=spec.head_dim,
            qk_rope_head_dim=spec.rope_dim,
            kv_cache_dim=width,
            dtype=dtype,
            device=cpu,
        )
        return MLATokenToKVPoolHost(
            mla,
            2.0,
            0,
            spec.page_size,
            spec.layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=spec.tokens,
            start_layer=0,
            end_layer=spec.layers,
            target_layer_num=spec.layers,
        )
    raise ValueError(spec.kind)


def storage_config(spec: PoolSpec, extra: dict[str, Any], model: str = "test-org/test-model") -> Any:
    """The HiCacheStorageConfig SGLang's cache controller would build (TP 1)."""
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=spec.kind == "mla",
        enable_storage_metrics=True,
        is_page_first_layout=spec.layout != "layer_first",
        model_name=model,
        extra_config=dict(extra),
    )


def kvtier_extra(cache_dir: str, **more: Any) -> dict[str, Any]:
    """The extra_config that loads kvtier as a dynamic backend."""
    return {
        "backend_name": "kvtier",
        "module_path": "kvtier.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "cache_dir": cache_dir,
        **more,
    }


def make_backend(spec: PoolSpec, pool: Any, extra: dict[str, Any], backend: str = "dynamic") -> Any:
    """A backend made as SGLang's cache controller makes it: the factory,
    then register_mem_pool_host."""
    b = StorageBackendFactory.create_backend(backend, storage_config(spec, extra), pool)
    b.register_mem_pool_host(pool)
    return b


def fill(pool: Any, seed: int) -> None:
    """Fills the whole host pool with values fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    vals = torch.randn(buf.shape, generator=g, dtype=torch.float32)
    buf.copy_(vals.to(buf.dtype))


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """Token indices of host pages ``pages`` (``page_size`` per page)."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64) for p in pages])


def page_bytes(pool: Any, page: int) -> bytes:
    """The bytes of host page ``page`` in every layer (flat copy)."""
    return bytes(pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8).numpy())


def page_keys(n: int, page_size: int, seed: int = 0) -> list[str]:
    """SGLang's own storage keys (its SHA-256 chain, as the cache
    controller computes them) of ``n`` pages of token ids fixed by ``seed``."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    g = torch.Generator().manual_seed(10_000 + seed)
    tokens = torch.randint(0, 32_000, (n * page_size,), generator=g).tolist()
    keys = get_storage_hash_str(tokens, None, page_size=page_size)
    assert isinstance(keys, list)
    assert len(keys) == n
    return keys


#: The pools of the restart check (one writer process, one reader process).
SPECS_RESTART = [
    PoolSpec("mha", "layer_first"),
    PoolSpec("mha", "page_first"),
    PoolSpec("mha", "page_first_direct", dtype="bf16"),
    PoolSpec("mla", "layer_first", dtype="bf16"),
    PoolSpec("mla", "page_first"),
]
#: Host pages written from, and (in a fresh pool) read into.
WRITE_PAGES = [3, 7, 1, 12, 5, 9]
READ_PAGES = [20, 2, 31, 8, 17, 4]
