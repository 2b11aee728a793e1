"""What SGLang 0.5.23 needs to serve a model on a CPU-only machine with
HiCache (``--device cpu --attention-backend torch_native
--disable-cuda-graph --enable-hierarchical-cache --hicache-io-backend
direct --hicache-mem-layout layer_first``), for kvtier's end-to-end check
(test_server.py). SGLang's CPU engine proper (``SGLANG_USE_CPU_ENGINE=1``)
needs sgl-kernel's CPU build, which the CUDA wheels in the venv lack; with
the CUDA wheels on a machine without a GPU, three places fail (the server
does not start, or fails at the first backup to its host pool) and a
fourth turns the error of a failed transfer into an ``AttributeError``.
Each patch below names what SGLang does there, why it fails here and what
the stand-in does.

:func:`install` registers the patches to run right after SGLang imports
the module each one changes (nothing of SGLang is imported early, and no
file of the venv is edited). sitecustomize.py in this directory calls it,
so the patches also hold in the scheduler and detokenizer processes SGLang
spawns: they inherit ``PYTHONPATH``, which the test sets for the server
process only.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

#: Module name -> the patch to apply once SGLang has imported it.
_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {}


def rotary_embedding(positions: Any, query: Any, key: Any, head_size: int, cos_sin_cache: Any, is_neox: bool) -> None:
    """``vllm._custom_ops.rotary_embedding`` in plain torch: rotates the
    first ``rotary_dim`` (``cos_sin_cache``'s width) channels of every head
    of ``query`` and ``key`` (``[tokens, heads * head_size]`` or
    ``[tokens, heads, head_size]``) in place, by the angles of
    ``positions``; NeoX style (halves) or GPT-J style (interleaved pairs)."""
    import torch

    pos = positions.flatten()
    rot = int(cos_sin_cache.shape[-1])
    cos, sin = cos_sin_cache.index_select(0, pos).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [tokens, 1, rot / 2]
    for x in (query, key):
        heads = x.view(pos.shape[0], -1, head_size)
        r = heads[..., :rot].float()
        if is_neox:
            x1, x2 = r.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        heads[..., :rot] = out.to(heads.dtype)


def transfer_kv_direct(
    src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` in plain torch: for every
    pair of layer buffers, the token rows ``src_indices`` of the source are
    copied to the rows ``dst_indices`` of the destination (the kernel copies
    whole pages of ``page_size`` rows; row by row is the same copy)."""
    import torch

    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers, {len(dst_layers)} destination layers")
    src_i = src_indices.to(device="cpu", dtype=torch.int64)
    dst_i = dst_indices.to(device="cpu", dtype=torch.int64)
    if src_i.numel() != dst_i.numel() or src_i.numel() % page_size:
        raise ValueError(f"{src_i.numel()} source and {dst_i.numel()} destination rows, pages of {page_size}")
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_i] = src[src_i]


def _vllm_ops_module() -> tuple[types.ModuleType, types.ModuleType]:
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # a package with nothing else in it
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    return vllm, ops


def _patch_rotary_embedding(mod: types.ModuleType) -> None:
    """sglang.srt.layers.rotary_embedding.base: ``RotaryEmbedding.__init__``
    takes vLLM's ``rotary_embedding`` op (``from vllm._custom_ops import
    rotary_embedding``) on any platform that is not CUDA, ROCm, SGLang's CPU
    engine, XPU, NPU, MUSA or MPS, i.e. here; the venv has no vLLM, so
    building the model's first layer fails with ``No module named 'vllm'``.
    The stand-in: while a ``RotaryEmbedding`` is built (and only then), a
    ``vllm._custom_ops`` module holding :func:`rotary_embedding` answers that
    import. (SGLang's op dispatch then runs ``forward_native`` on a machine
    without a GPU, so the op is kept but not called; it is exact anyway,
    checked against SGLang's own rotation by test_server.py.)"""
    if importlib.util.find_spec("vllm") is not None:
        return  # a real vLLM is there: leave SGLang as it is
    cls = mod.RotaryEmbedding
    init = cls.__init__
    vllm, ops = _vllm_ops_module()

    def init_with_vllm_ops(self: Any, *args: Any, **kwargs: Any) -> None:
        if "vllm" in sys.modules:
            init(self, *args, **kwargs)
            return
        sys.modules["vllm"], sys.modules["vllm._custom_ops"] = vllm, ops
        try:
            init(self, *args, **kwargs)
        finally:
            sys.modules.pop("vllm", None)
            sys.modules.pop("vllm._custom_ops", None)

    cls.__init__ = init_with_vllm_ops


def _patch_host_register(mod: types.ModuleType) -> None:
    """sglang.srt.mem_cache.pool_host.common: the HiCache host pool is
    allocated with ``pin_memory`` and then registered with CUDA
    (``_cuda_host_register``: ``torch.cuda.cudart().cudaHostRegister``) so
    that GPU copies from it are asynchronous; without a CUDA driver the
    call raises. The stand-in does nothing: the "device" KV pool is host
    memory too, and copies between host buffers need no registration."""

    def _cuda_host_register(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
        return None

    mod._cuda_host_register = _cuda_host_register  # type: ignore[attr-defined]


def _patch_transfer_kv_direct(mod: types.ModuleType) -> None:
    """sglang.srt.mem_cache.pool_host.mha: the MHA host pool moves pages
    between the device KV pool and itself with sgl-kernel's
    ``transfer_kv_direct`` for ``--hicache-io-backend direct`` and the
    ``layer_first`` layout, a name it imports only on CUDA, ROCm or XPU; here
    the name is unbound and the first backup to the host pool fails with a
    ``NameError``. The stand-in is :func:`transfer_kv_direct`: the same rows
    copied with torch indexing."""
    mod.transfer_kv_direct = transfer_kv_direct  # type: ignore[attr-defined]


def _patch_stream_synchronize(mod: types.ModuleType) -> None:
    """sglang.srt.mem_cache.l2_transfer: device<->host transfers run in a
    ``torch.cpu.Stream`` here (SGLang's device module is ``torch.cpu``); when
    a transfer raises, SGLang calls ``stream.synchronize()`` before
    re-raising, and ``torch.cpu.Stream`` has no ``synchronize`` (torch
    2.14), so the transfer's own error is replaced by an ``AttributeError``.
    The stand-in is a ``synchronize`` that returns at once: work "on" a CPU
    stream has already run on the calling thread, there is nothing to wait
    for."""
    import torch

    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Applies ``_PATCHES[name]`` right after module ``name`` has run (the
    other finders find the module; its loader's ``exec_module`` is wrapped)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            _PATCHES.pop(name, None)
            patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Registers every patch (once per process)."""
    if any(isinstance(f, _AfterImport) for f in sys.meta_path):
        return
    _PATCHES.update(
        {
            "sglang.srt.layers.rotary_embedding.base": _patch_rotary_embedding,
            "sglang.srt.mem_cache.pool_host.common": _patch_host_register,
            "sglang.srt.mem_cache.pool_host.mha": _patch_transfer_kv_direct,
            "sglang.srt.mem_cache.l2_transfer": _patch_stream_synchronize,
        }
    )
    sys.meta_path.insert(0, _AfterImport())
