"""Every bad input of the Rust reader is a Python exception naming the file
(and the tensor, where there is one), never a crash or a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import kvtier
from helpers import entry, raw_file, write_sharded

# Each case writes a bad file under a directory and returns its path, the
# exception class expected, the tensor the error must name (or None) and a
# phrase of the Rust error's message.
Case = Callable[[Path], tuple[Path, type, str | None, str]]


def _good(dir: Path) -> Path:
    path = dir / "good.safetensors"
    safetensors.numpy.save_file({"a": np.arange(6, dtype=np.float32), "b": np.arange(4, dtype=np.int64)}, str(path))
    return path


def _hdr(**entries) -> str:
    text = json.dumps(entries)
    return text + " " * (-len(text) % 8)


def truncated(d: Path):
    good = _good(d)
    data = good.read_bytes()
    path = d / "truncated.safetensors"
    path.write_bytes(data[:-3])
    # safetensors puts the larger-aligned I64 tensor "b" first: "a" is cut short.
    return path, kvtier.SafetensorsFormatError, "a", "truncated"


def too_short(d: Path):
    path = d / "short.safetensors"
    path.write_bytes(b"\x10\x00\x00")
    return path, kvtier.SafetensorsFormatError, None, "too short"


def malformed_json(d: Path):
    path = raw_file(d / "json.safetensors", "{,}     ")
    return path, kvtier.SafetensorsFormatError, None, "not valid JSON"


def json_cut_inside_a_tensor(d: Path):
    path = raw_file(d / "cut.safetensors", '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]', b"\0" * 4)
    return path, kvtier.SafetensorsFormatError, "a", "EOF while parsing"


def malformed_entry(d: Path):
    path = raw_file(d / "entry.safetensors", '{"w": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}', b"\0" * 4)
    return path, kvtier.SafetensorsFormatError, "w", "w"


def not_a_brace(d: Path):
    path = raw_file(d / "brace.safetensors", '["a"]   ')
    return path, kvtier.SafetensorsFormatError, None, "'{'"


def not_utf8(d: Path):
    path = raw_file(d / "utf8.safetensors", b'{"\xff\xfe": 1}  ')
    return path, kvtier.SafetensorsFormatError, None, "UTF-8"


def header_longer_than_file(d: Path):
    path = raw_file(d / "hlen.safetensors", "{}", length=1000)
    return path, kvtier.SafetensorsFormatError, None, "runs past the end"


def header_length_4gib(d: Path):
    path = raw_file(d / "huge.safetensors", "{}", length=4 << 30)
    return path, kvtier.SafetensorsFormatError, None, "exceeds the limit"


def offsets_past_end(d: Path):
    path = raw_file(d / "past.safetensors", _hdr(w=entry("F32", [4], 0, 16)), b"\0" * 8)
    return path, kvtier.SafetensorsFormatError, "w", "16"


def terabyte_tensor(d: Path):
    n = 1 << 38
    path = raw_file(d / "tera.safetensors", _hdr(w=entry("F32", [n], 0, 4 * n)), b"\0" * 8)
    return path, kvtier.SafetensorsFormatError, "w", "truncated"


def overlap(d: Path):
    path = raw_file(d / "overlap.safetensors", _hdr(a=entry("F32", [2], 0, 8), b=entry("F32", [2], 4, 12)), b"\0" * 12)
    return path, kvtier.SafetensorsFormatError, "b", "inside tensor"


def gap(d: Path):
    path = raw_file(d / "gap.safetensors", _hdr(a=entry("F32", [1], 0, 4), b=entry("F32", [1], 8, 12)), b"\0" * 12)
    return path, kvtier.SafetensorsFormatError, "b", "gap"


def size_mismatch(d: Path):
    path = raw_file(d / "size.safetensors", _hdr(w=entry("F32", [3], 0, 8)), b"\0" * 8)
    return path, kvtier.SafetensorsFormatError, "w", "shape x dtype"


def end_before_start(d: Path):
    path = raw_file(d / "order.safetensors", _hdr(w=entry("F32", [0], 8, 4)), b"\0" * 8)
    return path, kvtier.SafetensorsFormatError, "w", "end before"


def shape_overflow(d: Path):
    big = 1 << 62
    path = raw_file(d / "overflow.safetensors", _hdr(w=entry("F32", [big, big], 0, 0)))
    return path, kvtier.SafetensorsFormatError, "w", "overflows"


def unknown_dtype(d: Path):
    path = raw_file(d / "dtype.safetensors", _hdr(w=entry("F128", [1], 0, 16)), b"\0" * 16)
    return path, kvtier.SafetensorsFormatError, "w", "F128"


def duplicate_name(d: Path):
    h = (
        '{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
        '"w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
    )
    path = raw_file(d / "dup.safetensors", h, b"\0\0")
    return path, kvtier.SafetensorsFormatError, "w", "more than once"


def longer_than_data(d: Path):
    path = raw_file(d / "long.safetensors", _hdr(w=entry("U8", [2], 0, 2)), b"\0" * 10)
    return path, kvtier.SafetensorsFormatError, None, "account for"


def bad_metadata(d: Path):
    path = raw_file(d / "meta.safetensors", _hdr(__metadata__={"k": 1}))
    return path, kvtier.SafetensorsFormatError, None, "__metadata__"


def missing_file(d: Path):
    return d / "nope.safetensors", kvtier.KvtierOSError, None, "No such file"


def fifo(d: Path):
    path = d / "fifo.safetensors"
    os.mkfifo(path)
    return path, kvtier.KvtierOSError, None, "a FIFO"


def dev_zero_symlink(d: Path):
    path = d / "zero.safetensors"
    path.symlink_to("/dev/zero")
    return path, kvtier.KvtierOSError, None, "a device"


def empty_dir(d: Path):
    path = d / "empty-model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path, kvtier.ModelDirError, None, "no model.safetensors.index.json"


def _model(d: Path) -> Path:
    dir = d / "model"
    write_sharded(dir, {f"t{i}": np.full(5, i, np.float32) for i in range(4)}, shards=2)
    return dir


def index_names_missing_shard(d: Path):
    dir = _model(d)
    (dir / "model-00002-of-00002.safetensors").unlink()
    return dir, kvtier.ModelDirError, None, "model-00002-of-00002.safetensors"


def index_not_json(d: Path):
    dir = _model(d)
    (dir / "model.safetensors.index.json").write_text("{not json")
    return dir, kvtier.ModelDirError, None, "invalid index"


def index_escapes_dir(d: Path):
    dir = _model(d)
    (dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"t0": "../x.safetensors"}}))
    return dir, kvtier.ModelDirError, None, "not a relative path"


def index_tensor_not_in_shard(d: Path):
    dir = _model(d)
    index = json.loads((dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return dir, kvtier.ModelDirError, "ghost", "does not hold it"


def corrupt_shard_in_dir(d: Path):
    dir = _model(d)
    shard = dir / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    return shard, kvtier.SafetensorsFormatError, None, "truncated"


CASES: list[Case] = [
    truncated,
    too_short,
    malformed_json,
    json_cut_inside_a_tensor,
    malformed_entry,
    not_a_brace,
    not_utf8,
    header_longer_than_file,
    header_length_4gib,
    offsets_past_end,
    terabyte_tensor,
    overlap,
    gap,
    size_mismatch,
    end_before_start,
    shape_overflow,
    unknown_dtype,
    duplicate_name,
    longer_than_data,
    bad_metadata,
    missing_file,
    dev_zero_symlink,
    empty_dir,
    index_names_missing_shard,
    index_not_json,
    index_escapes_dir,
    index_tensor_not_in_shard,
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("framework", ["numpy", "pt"])
def test_bad_input_raises_a_kvtier_error(tmp_path, case, framework):
    path, cls, tensor, phrase = case(tmp_path)
    with pytest.raises(cls) as e:
        kvtier.load_safetensors(path, framework=framework)
    err = e.value
    assert isinstance(err, kvtier.KvtierError)
    msg = str(err)
    assert phrase in msg, msg
    assert err.path is not None, msg
    assert Path(err.path).name in msg, (err.path, msg)
    if tensor is not None:
        assert err.tensor == tensor, (err.tensor, msg)
        assert repr(tensor).replace("'", '"') in msg, msg


def test_corrupt_shard_of_a_directory_is_named(tmp_path):
    path, cls, _, phrase = corrupt_shard_in_dir(tmp_path)
    with pytest.raises(cls) as e:
        kvtier.load_safetensors(path.parent)
    assert phrase in str(e.value)
    assert e.value.path == str(path)


def test_classes_derive_from_the_builtin_a_caller_expects(tmp_path):
    with pytest.raises(ValueError, match="too short"):
        kvtier.load_safetensors(too_short(tmp_path)[0])
    with pytest.raises(OSError, match="No such file") as e:
        kvtier.load_safetensors(tmp_path / "missing.safetensors")
    assert e.value.errno == 2
    with pytest.raises(ValueError, match=r"no model\.safetensors\.index\.json"):
        kvtier.load_safetensors(empty_dir(tmp_path)[0])


def test_fifo_is_an_error_not_a_hang(tmp_path):
    # In a child process with a time limit: a blocking open of a FIFO with
    # no writer would hang forever, which must fail this test, not CI.
    path, _, _, _ = fifo(tmp_path)
    code = textwrap.dedent(f"""
        import kvtier
        try:
            kvtier.load_safetensors({str(path)!r})
        except kvtier.KvtierOSError as e:
            assert "a FIFO" in str(e) and {str(path)!r} in str(e), str(e)
            print("raised", type(e).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised KvtierOSError"


def test_bad_input_leaves_the_process_usable(tmp_path):
    # After every bad case, a good file still loads in the same process.
    for case in CASES:
        sub = tmp_path / case.__name__
        sub.mkdir()
        path = case(sub)[0]
        with pytest.raises(kvtier.KvtierError):
            kvtier.load_safetensors(path)
    good = _good(tmp_path)
    got = kvtier.load_safetensors(good)
    assert got["a"].tolist() == list(range(6))
