"""Helpers shared by the tests: writing models with the reference
``safetensors`` package, raw safetensors files, and byte-exact comparison."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import save_file as pt_save_file

import kvtier


def tensor_bytes(x: Any) -> bytes:
    """The raw little-endian bytes of a numpy array or torch tensor."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    flat = x.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def assert_same_tensors(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same names, dtypes, shapes and bytes (NaNs included)."""
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert type(g) is type(w), name
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert tuple(g.shape) == tuple(w.shape), (name, g.shape, w.shape)
        assert tensor_bytes(g) == tensor_bytes(w), name


def numpy_tensors(seed: int, count: int) -> dict[str, np.ndarray]:
    """``count`` tensors of every dtype numpy and safetensors share, odd
    shapes, scalars and empty ones included, NaN and inf in the floats."""
    rng = np.random.default_rng(seed)
    dtypes = [
        np.float32,
        np.float16,
        np.float64,
        np.int64,
        np.int32,
        np.int16,
        np.int8,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.bool_,
    ]
    shapes = [(7, 13), (3,), (), (2, 0, 5), (1, 1, 1, 9), (64, 33)]
    out = {}
    for i in range(count):
        dt = np.dtype(dtypes[i % len(dtypes)])
        shape = shapes[i % len(shapes)]
        if dt.kind == "f":
            a = rng.standard_normal(shape).astype(dt)
            if a.size >= 3:
                a.reshape(-1)[:3] = [np.nan, np.inf, -0.0]
        elif dt.kind == "b":
            a = rng.integers(0, 2, shape).astype(dt)
        else:
            info = np.iinfo(dt)
            a = rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
        out[f"model.layers.{i}.{dt.name}"] = a
    return out


def torch_tensors(seed: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` tensors of the torch dtypes safetensors stores, bf16 and
    float8 included."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.float64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    ]
    shapes = [(5, 11), (17,), (), (3, 0), (2, 3, 4), (128, 9)]
    out = {}
    for i in range(count):
        dt = dtypes[i % len(dtypes)]
        shape = shapes[i % len(shapes)]
        if dt.is_floating_point:
            t = torch.randn(shape, generator=g).to(dt)
        else:
            t = torch.randint(0, 250, shape, generator=g, dtype=torch.int64).to(dt)
        out[f"layers.{i}.{str(dt).removeprefix('torch.')}"] = t
    return out


def write_sharded(dir: Path, tensors: dict[str, Any], shards: int) -> list[Path]:
    """Writes ``tensors`` as ``shards`` files with the reference package
    (numpy or torch writer by value type) plus the Hugging Face index."""
    dir.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    files = []
    weight_map = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        first = next(iter(part.values()))
        if isinstance(first, np.ndarray):
            np_save_file(part, str(dir / file))
        else:
            pt_save_file(part, str(dir / file))
        files.append(dir / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return files


def raw_file(path: Path, header: bytes | str, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file from raw parts: the length prefix (``length``, or
    the header's own length), the header bytes, the data."""
    h = header.encode() if isinstance(header, str) else header
    n = len(h) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + h + data)
    return path


def entry(dtype: str, shape: list[int], start: int, end: int) -> dict[str, Any]:
    """One header entry."""
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def host_buffer_of(arr: np.ndarray) -> kvtier._kvtier.HostBuffer:
    """The HostBuffer at the end of an array's base chain (fails if the
    array does not view one)."""
    base: Any = arr
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, kvtier._kvtier.HostBuffer), type(base)
    return base


def buffer_range(buf: kvtier._kvtier.HostBuffer) -> tuple[int, int]:
    """[start, end) addresses of a HostBuffer's bytes."""
    addr = buf.__array_interface__["data"][0]
    return addr, addr + len(buf)
