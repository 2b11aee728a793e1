"""kvtier.load_safetensors against the reference safetensors package."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

import kvtier
from helpers import (
    assert_same_tensors,
    buffer_range,
    entry,
    host_buffer_of,
    raw_file,
    tensor_bytes,
)


def reference(dir: Path, load) -> dict:
    """Every tensor of every shard named by the index, read by safetensors."""
    index = json.loads((dir / "model.safetensors.index.json").read_text())
    out: dict = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load(str(dir / file)))
    return out


def test_numpy_sharded_model_equals_safetensors(numpy_model):
    dir, tensors = numpy_model
    got = kvtier.load_safetensors(dir, framework="numpy")
    want = reference(dir, safetensors.numpy.load_file)
    assert_same_tensors(got, want)
    # And both equal what was written.
    assert_same_tensors(got, tensors)


def test_torch_sharded_model_equals_safetensors(torch_model):
    dir, tensors = torch_model
    got = kvtier.load_safetensors(dir, framework="pt")
    want = reference(dir, safetensors.torch.load_file)
    assert {t.dtype for t in got.values()} >= {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.float8_e4m3fn,
    }
    assert_same_tensors(got, want)
    assert_same_tensors(got, tensors)


def test_torch_alias_and_numpy_alias(torch_model, numpy_model):
    assert_same_tensors(kvtier.load_safetensors(torch_model[0], framework="torch"), torch_model[1])
    assert_same_tensors(kvtier.load_safetensors(numpy_model[0], framework="np"), numpy_model[1])


@pytest.mark.parametrize("framework", ["numpy", "pt"])
def test_single_file_equals_safetensors(numpy_model, framework):
    dir, _ = numpy_model
    file = sorted(dir.glob("*.safetensors"))[1]
    load = safetensors.numpy.load_file if framework == "numpy" else safetensors.torch.load_file
    got = kvtier.load_safetensors(str(file), framework=framework)
    assert_same_tensors(got, load(str(file)))
    # File order, as safetensors gives it.
    assert list(got) == list(load(str(file)))


def test_directory_without_index_loads_every_shard(numpy_model):
    dir, tensors = numpy_model
    (dir / "model.safetensors.index.json").unlink()
    assert_same_tensors(kvtier.load_safetensors(dir), tensors)


def test_directory_with_model_safetensors(tmp_path):
    t = {"a": np.arange(10, dtype=np.float32), "b": np.ones((2, 2), np.int64)}
    safetensors.numpy.save_file(t, str(tmp_path / "model.safetensors"))
    # A stray file next to it is not read: model.safetensors wins.
    (tmp_path / "other.safetensors").write_bytes(b"garbage")
    assert_same_tensors(kvtier.load_safetensors(tmp_path), t)


def test_bfloat16_with_numpy_is_a_type_error_like_safetensors(torch_model):
    dir, _ = torch_model
    file = next(
        f
        for f in sorted(dir.glob("*.safetensors"))
        if any(t.dtype == torch.bfloat16 for t in safetensors.torch.load_file(str(f)).values())
    )
    with pytest.raises(TypeError):
        safetensors.numpy.load_file(str(file))
    with pytest.raises(kvtier.UnsupportedDtypeError) as e:
        kvtier.load_safetensors(file, framework="numpy")
    assert isinstance(e.value, TypeError)
    assert e.value.path == str(file)
    assert e.value.tensor is not None
    assert e.value.tensor in str(e.value)
    assert "BF16" in str(e.value) or "F8" in str(e.value)


def test_unknown_framework_is_a_value_error(numpy_model):
    with pytest.raises(ValueError, match="framework"):
        kvtier.load_safetensors(numpy_model[0], framework="tf")  # type: ignore[arg-type]


def test_arrays_view_one_buffer_per_shard_without_copy(numpy_model):
    dir, _ = numpy_model
    file = sorted(dir.glob("*.safetensors"))[0]
    got = kvtier.load_safetensors(file)
    buffers = {id(host_buffer_of(a)) for a in got.values()}
    assert len(buffers) == 1
    buf = host_buffer_of(next(iter(got.values())))
    assert len(buf) == file.stat().st_size
    lo, hi = buffer_range(buf)
    for name, a in got.items():
        addr = a.__array_interface__["data"][0]
        assert lo <= addr, name
        assert addr + a.nbytes <= hi, name
        assert a.flags.writeable, name
        assert a.flags.aligned, name


def test_torch_tensors_share_the_loaded_buffer(torch_model):
    dir, _ = torch_model
    got = kvtier.load_safetensors(dir, framework="pt")
    # In memory, a shard's tensors lie exactly as far apart as in the file:
    # they are views of one buffer holding the file, not copies.
    for file in sorted(dir.glob("*.safetensors")):
        with safetensors.safe_open(str(file), framework="pt") as f:
            names = [n for n in f.keys() if got[n].numel() > 0]  # noqa: SIM118 - safe_open is no dict
        offsets = dict(header_offsets(file))
        first = names[0]
        for n in names:
            assert got[n].data_ptr() - got[first].data_ptr() == offsets[n] - offsets[first], n
    big = got["lm_head.weight"]
    assert big.is_contiguous()
    assert big.numel() == 1300 * 4099


def header_offsets(file: Path) -> list[tuple[str, int]]:
    """Each tensor's start offset in the data section, from the header."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return [(k, v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"]


def test_views_keep_the_buffer_alive(numpy_model):
    dir, tensors = numpy_model
    got = kvtier.load_safetensors(dir)
    name = next(n for n, a in got.items() if a.size > 100)
    keep = got[name]
    del got
    gc.collect()
    # Allocate and touch memory that would reuse a freed buffer.
    junk = [np.full(1 << 20, 0xAB, np.uint8) for _ in range(8)]
    assert tensor_bytes(keep) == tensor_bytes(tensors[name])
    del junk


def test_writing_a_loaded_array_changes_only_that_array(numpy_model):
    dir, tensors = numpy_model
    got = kvtier.load_safetensors(dir)
    name = next(n for n, a in got.items() if a.dtype == np.float32 and a.size > 4)
    got[name][...] = 7
    assert (got[name] == 7).all()
    others = {n: a for n, a in got.items() if n != name}
    assert_same_tensors(others, {n: tensors[n] for n in others})
    # The file is untouched.
    assert_same_tensors(kvtier.load_safetensors(dir), tensors)


def test_unaligned_tensor_is_copied_into_an_aligned_array(tmp_path):
    # Valid safetensors, but the F32 tensor starts at data byte 1.
    values = np.array([1.5, -2.25, 3.0], np.float32)
    header = json.dumps({"flag": entry("U8", [1], 0, 1), "w": entry("F32", [3], 1, 13)})
    header += " " * (-len(header) % 8)
    path = raw_file(tmp_path / "unaligned.safetensors", header, b"\x09" + values.tobytes())
    for fw in ("numpy", "pt"):
        got = kvtier.load_safetensors(path, framework=fw)
        w = got["w"] if fw == "numpy" else got["w"].numpy()
        assert w.flags.aligned
        assert w.tolist() == values.tolist()
        assert tensor_bytes(got["flag"]) == b"\x09"
    assert_same_tensors(kvtier.load_safetensors(path), safetensors.numpy.load_file(str(path)))


def test_empty_file_of_no_tensors(tmp_path):
    path = raw_file(tmp_path / "empty.safetensors", "{}      ")
    assert kvtier.load_safetensors(path) == {}
    assert safetensors.numpy.load_file(str(path)) == {}
