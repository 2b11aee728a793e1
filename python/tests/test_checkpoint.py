"""kvtier.save_checkpoint / kvtier.load_checkpoint: round trips, verified
loads, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

import kvtier
from helpers import (
    assert_same_tensors,
    buffer_range,
    host_buffer_of,
    numpy_tensors,
    tensor_bytes,
    torch_tensors,
)


def manifest(dir: Path) -> dict:
    return json.loads((dir / "manifest.json").read_text())


def test_numpy_round_trip(tmp_path):
    tensors = numpy_tensors(seed=5, count=40)
    info = kvtier.save_checkpoint(tensors, tmp_path / "ckpt")
    assert info.generation == 1
    assert info.tensor_bytes == sum(a.nbytes for a in tensors.values())
    got = kvtier.load_checkpoint(tmp_path / "ckpt")
    assert_same_tensors(got, tensors)
    assert list(got) == list(tensors)  # the order saved


def test_torch_round_trip(tmp_path):
    tensors = torch_tensors(seed=6, count=45)
    tensors["big"] = torch.randn(1024, 3000)
    kvtier.save_checkpoint(tensors, tmp_path / "ckpt")
    got = kvtier.load_checkpoint(tmp_path / "ckpt", framework="pt")
    assert {t.dtype for t in got.values()} >= {torch.bfloat16, torch.float16, torch.int64, torch.float8_e5m2}
    assert_same_tensors(got, tensors)
    assert list(got) == list(tensors)


def test_torch_checkpoint_loads_as_numpy_where_numpy_has_the_dtype(tmp_path):
    t = {"w": torch.randn(3, 4), "i": torch.arange(5), "h": torch.randn(2).half()}
    kvtier.save_checkpoint(t, tmp_path)
    got = kvtier.load_checkpoint(tmp_path, framework="numpy")
    assert_same_tensors(got, {k: v.numpy() for k, v in t.items()})
    kvtier.save_checkpoint({"b": torch.ones(2, dtype=torch.bfloat16)}, tmp_path)
    with pytest.raises(kvtier.UnsupportedDtypeError, match="'b'"):
        kvtier.load_checkpoint(tmp_path, framework="numpy")


def test_non_contiguous_and_big_endian_inputs_are_saved_as_their_values(tmp_path):
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "transposed": base.T,
        "strided": base[::2, 1::3],
        "big_endian": np.arange(7, dtype=">i4"),
        "scalar": np.float64(2.5),
        "torch_t": t.t(),
        "torch_slice": t[:, 2:5],
        "torch_bf16_t": t.to(torch.bfloat16).t(),
        "torch_grad": torch.ones(3, requires_grad=True),
    }
    kvtier.save_checkpoint(tensors, tmp_path)
    got = kvtier.load_checkpoint(tmp_path, framework="pt")
    assert got["transposed"].numpy().tolist() == base.T.tolist()
    assert got["strided"].numpy().tolist() == base[::2, 1::3].tolist()
    assert got["big_endian"].dtype == torch.int32
    assert got["big_endian"].tolist() == list(range(7))
    assert got["scalar"].shape == ()
    assert got["scalar"].item() == 2.5
    assert torch.equal(got["torch_t"], t.t())
    assert torch.equal(got["torch_slice"], t[:, 2:5])
    assert torch.equal(got["torch_bf16_t"], t.to(torch.bfloat16).t())
    assert torch.equal(got["torch_grad"], torch.ones(3))
    # The caller's arrays are untouched.
    assert base.tolist() == np.arange(60, dtype=np.float32).reshape(6, 10).tolist()


def test_a_second_save_commits_a_new_generation_and_retires_the_old(tmp_path):
    a = {"w": np.zeros(1000, np.float32)}
    b = {"w": np.ones(1000, np.float32), "extra": np.arange(3)}
    first = kvtier.save_checkpoint(a, tmp_path, metadata={"step": "1"})
    second = kvtier.save_checkpoint(b, tmp_path, metadata={"step": "2"})
    assert (first.generation, second.generation) == (1, 2)
    assert_same_tensors(kvtier.load_checkpoint(tmp_path), b)
    assert manifest(tmp_path)["metadata"] == {"step": "2"}
    for f in first.files:
        assert not Path(f).exists()
    for f in second.files:
        assert Path(f).exists()


def test_several_shards_and_every_shard_is_valid_safetensors(tmp_path):
    tensors = {f"t{i}": np.full((256, 256), i, np.float32) for i in range(6)}
    info = kvtier.save_checkpoint(tensors, tmp_path, shard_bytes=2 * 256 * 256 * 4)
    assert len(info.files) == 3
    assert_same_tensors(kvtier.load_checkpoint(tmp_path), tensors)
    # The reference reader loads each shard; apart from kvtier's padding
    # tensors it holds exactly the saved tensors.
    seen = {
        name: arr
        for f in info.files
        for name, arr in safetensors.numpy.load_file(f).items()
        if not name.startswith("__kvtier_pad_")
    }
    assert_same_tensors(seen, tensors)


def test_loaded_checkpoint_arrays_view_the_shard_buffers(tmp_path):
    tensors = {"a": np.arange(5000, dtype=np.float32), "b": np.arange(10, dtype=np.int64)}
    kvtier.save_checkpoint(tensors, tmp_path)
    got = kvtier.load_checkpoint(tmp_path)
    buf = host_buffer_of(got["a"])
    assert host_buffer_of(got["b"]) is buf
    lo, hi = buffer_range(buf)
    assert lo <= got["a"].__array_interface__["data"][0] < hi
    # kvtier aligns every tensor to 4 KiB in its shard files.
    assert got["a"].__array_interface__["data"][0] % 4096 == 0


def test_a_flipped_data_byte_is_a_checksum_error_naming_the_tensor(tmp_path):
    tensors = {"first": np.arange(1000, dtype=np.float32), "victim": np.arange(1000, dtype=np.int32)}
    kvtier.save_checkpoint(tensors, tmp_path)
    m = manifest(tmp_path)
    entry = next(t for t in m["tensors"] if t["name"] == "victim")
    shard = m["shards"][entry["shard"]]
    offset = shard["data_start"] + entry["data_offsets"][0] + 17
    path = tmp_path / shard["file"]
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))
    for fw in ("numpy", "pt"):
        with pytest.raises(kvtier.ChecksumError) as e:
            kvtier.load_checkpoint(tmp_path, framework=fw)
        assert e.value.tensor == "victim"
        assert e.value.path == str(path)
        assert '"victim"' in str(e.value)
        assert shard["file"] in str(e.value)
        assert isinstance(e.value, kvtier.CheckpointError)
    # Without verification the flipped byte is what comes back: the checksum
    # is what caught it.
    got = kvtier.load_checkpoint(tmp_path, verify=False)
    diff = np.flatnonzero(got["victim"].view(np.uint8) != tensors["victim"].view(np.uint8))
    assert diff.tolist() == [17]
    assert_same_tensors({"first": got["first"]}, {"first": tensors["first"]})


def test_a_flipped_header_byte_is_an_error_naming_the_shard(tmp_path):
    kvtier.save_checkpoint({"w": np.arange(100, dtype=np.float32)}, tmp_path)
    shard = tmp_path / manifest(tmp_path)["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    at = data.index(b'"F32"') + 1
    data[at] = ord("X")  # "X32": an unknown dtype
    shard.write_bytes(bytes(data))
    with pytest.raises(kvtier.KvtierError) as e:
        kvtier.load_checkpoint(tmp_path)
    assert shard.name in str(e.value)
    assert "X32" in str(e.value)


def test_a_shortened_shard_is_a_checkpoint_error(tmp_path):
    kvtier.save_checkpoint({"w": np.arange(100, dtype=np.float32)}, tmp_path)
    shard = tmp_path / manifest(tmp_path)["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(kvtier.CheckpointError) as e:
        kvtier.load_checkpoint(tmp_path)
    assert e.value.path == str(shard)
    assert "manifest says" in str(e.value)


def test_no_checkpoint_is_a_file_not_found_error(tmp_path):
    with pytest.raises(kvtier.NoCheckpointError) as e:
        kvtier.load_checkpoint(tmp_path)
    assert isinstance(e.value, FileNotFoundError)
    assert e.value.errno == 2
    assert "manifest.json" in str(e.value)


@pytest.mark.parametrize(
    ("tensors", "phrase"),
    [
        ({"c": np.ones(3, np.complex64)}, "complex64"),
        ({"o": np.array([object()])}, "object"),
        ({"s": np.array(["x"])}, "<U1"),
        ({"l": [1.0, 2.0]}, "expected a numpy.ndarray or a torch.Tensor, got list"),
        ({"m": torch.empty(2, device="meta")}, "meta"),
        ({"q": torch.ones(2, dtype=torch.complex64)}, "complex64"),
        ({"sp": torch.eye(3).to_sparse()}, "dense"),
        ({"__metadata__": np.ones(2)}, "__metadata__"),
        ({"__kvtier_pad_1": np.ones(2)}, "__kvtier_pad_"),
        ({"": np.ones(2)}, "empty"),
    ],
    ids=[
        "complex",
        "object",
        "str",
        "list",
        "meta-device",
        "torch-complex",
        "sparse",
        "reserved-metadata",
        "reserved-pad",
        "empty-name",
    ],
)
def test_invalid_tensors_are_rejected_and_the_old_checkpoint_stays(tmp_path, tensors, phrase):
    old = {"kept": np.arange(4, dtype=np.int16)}
    kvtier.save_checkpoint(old, tmp_path)
    with pytest.raises(kvtier.InvalidTensorError) as e:
        kvtier.save_checkpoint(tensors, tmp_path)
    assert isinstance(e.value, ValueError)
    assert phrase in str(e.value), str(e.value)
    assert e.value.tensor == next(iter(tensors))
    assert_same_tensors(kvtier.load_checkpoint(tmp_path), old)
    assert manifest(tmp_path)["generation"] == 1


def test_not_a_mapping_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="mapping"):
        kvtier.save_checkpoint([np.ones(2)], tmp_path)  # type: ignore[arg-type]
    with pytest.raises(kvtier.InvalidTensorError, match="names must be str"):
        kvtier.save_checkpoint({1: np.ones(2)}, tmp_path)  # type: ignore[dict-item]


def test_a_directory_that_is_a_file_is_an_os_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(kvtier.KvtierOSError) as e:
        kvtier.save_checkpoint({"a": np.ones(2)}, f)
    assert isinstance(e.value, OSError)
    assert str(f) in str(e.value)


def test_buffered_save_reports_why(tmp_path):
    info = kvtier.save_checkpoint({"a": np.ones(5000)}, tmp_path, direct=False)
    assert info.direct is False
    assert info.direct_reason is not None
    assert "direct" in info.direct_reason.lower()
    assert_same_tensors(kvtier.load_checkpoint(tmp_path), {"a": np.ones(5000)})


def test_loaded_tensors_outlive_the_dict(tmp_path):
    tensors = {"a": np.arange(100000, dtype=np.float32)}
    kvtier.save_checkpoint(tensors, tmp_path)
    a = kvtier.load_checkpoint(tmp_path, framework="pt")["a"]
    import gc

    gc.collect()
    junk = [np.full(1 << 20, 0xCD, np.uint8) for _ in range(8)]
    assert tensor_bytes(a) == tensor_bytes(tensors["a"])
    del junk
