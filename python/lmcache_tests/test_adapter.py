"""kvtier.lmcache's adapter through LMCache's native_plugin contract, as
LMCache's ``NativeConnectorL2Adapter`` calls it (built by LMCache's own
factory from an adapter spec), without a server: the eventfd, per-key
results, objects of several sizes and ranks, a restart, a corrupt block."""

from __future__ import annotations

import ctypes
import os
import select
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmcache.v1.distributed.l2_adapters.native_plugin_l2_adapter import (
    NativePluginL2AdapterConfig,
    _create_native_plugin_l2_adapter,
)

from kvtier.lmcache import KvtierL2Adapter, _model_id, parse_key


def _wait(a: KvtierL2Adapter, fid: int) -> tuple[int, bool, str | None, list[bool] | None]:
    poller = select.poll()
    poller.register(a.event_fd(), select.POLLIN)
    for _ in range(100):
        assert poller.poll(10_000), "the eventfd never became readable"
        for c in a.drain_completions():
            if c[0] == fid:
                return c
    raise AssertionError(f"no completion for {fid}")


def _buf(n: int, fill: int) -> Any:
    return (ctypes.c_ubyte * n)(*([fill] * n))


KEYS = [f"model-a@{r:08x}@0@{h:064x}" for r, h in [(0, 1), (0, 2), (1, 1), (1, 2)]]


def test_store_lookup_load_and_restart(tmp_path: Path) -> None:
    a = KvtierL2Adapter(cache_dir=str(tmp_path), g2_bytes=16 << 20, g3_bytes=16 << 20)
    srcs = [_buf(4096, i + 1) for i in range(4)] + [_buf(100, 9)]
    keys = [*KEYS, "model-a@00000000@0@" + "ab" * 32]
    assert _wait(a, a.submit_batch_exists(keys))[3] == [False] * 5
    _, ok, err, _ = _wait(a, a.submit_batch_set(keys[:4:2] + keys[4:], [memoryview(srcs[i]) for i in (0, 2, 4)]))
    assert ok
    assert err is None
    # Ranks 0 and 1 of one hash are two objects.
    assert _wait(a, a.submit_batch_exists(keys))[3] == [True, False, True, False, True]
    dst = [_buf(4096, 0) for _ in range(4)] + [_buf(100, 0)]
    _, ok, _, per_key = _wait(a, a.submit_batch_get(keys, [memoryview(d) for d in dst]))
    assert per_key == [True, False, True, False, True]
    assert [bytes(d) for d in dst] == [bytes(srcs[0]), bytes(4096), bytes(srcs[2]), bytes(4096), bytes(srcs[4])]
    # An object of a size never stored is a miss.
    _, _, _, per_key = _wait(a, a.submit_batch_get(keys[:1], [memoryview(_buf(512, 0))]))
    assert per_key == [False]
    a.close()
    assert sorted(os.listdir(tmp_path)) == [f"lmc-{_model_id('model-a')}-100", f"lmc-{_model_id('model-a')}-4096"]

    b = KvtierL2Adapter(cache_dir=str(tmp_path), g2_bytes=16 << 20)
    # Both namespaces are open at once, and one faults G2's read buffers in.
    opened = b.metrics()["namespaces"]
    assert sorted(opened) == sorted(os.listdir(tmp_path))
    assert sorted(n["read_buffers_warm_target"] > 0 for n in opened.values()) == [False, True]
    assert _wait(b, b.submit_batch_exists(keys))[3] == [True, False, True, False, True]
    dst = [_buf(4096, 0) for _ in range(4)] + [_buf(100, 0)]
    _, _, _, per_key = _wait(b, b.submit_batch_get(keys, [memoryview(d) for d in dst]))
    assert per_key == [True, False, True, False, True]
    assert bytes(dst[2]) == bytes(srcs[2])
    b.close()


def test_corrupt_block_is_a_miss(tmp_path: Path) -> None:
    a = KvtierL2Adapter(cache_dir=str(tmp_path))
    srcs = [_buf(8192, 7), _buf(8192, 8)]
    assert _wait(a, a.submit_batch_set(KEYS[:2], [memoryview(s) for s in srcs]))[1]
    a.close()

    b = KvtierL2Adapter(cache_dir=str(tmp_path))
    assert _wait(b, b.submit_batch_exists(KEYS[:2]))[3] == [True, True]
    ns = b._open[_model_id("model-a")][8192]
    where = ns._ns.locate(parse_key(KEYS[1])[1])
    assert where is not None
    path, offset = where
    with open(path, "r+b") as f:
        f.seek(offset + ns.layout.slot_bytes // 2)
        byte = f.read(1)[0]
        f.seek(offset + ns.layout.slot_bytes // 2)
        f.write(bytes([byte ^ 0x01]))
    dst = [_buf(8192, 0), _buf(8192, 0)]
    _, _, _, per_key = _wait(b, b.submit_batch_get(KEYS[:2], [memoryview(d) for d in dst]))
    assert per_key == [True, False]
    assert bytes(dst[0]) == bytes(srcs[0])
    # Dropped: no longer held.
    assert _wait(b, b.submit_batch_exists(KEYS[:2]))[3] == [True, False]
    assert ns.stats()["g3_corrupt_blocks"] == 1
    b.close()


def test_built_by_lmcache(tmp_path: Path) -> None:
    config = NativePluginL2AdapterConfig.from_dict(
        {
            "type": "native_plugin",
            "module_path": "kvtier.lmcache",
            "class_name": "KvtierL2Adapter",
            "adapter_params": {"cache_dir": str(tmp_path), "g2_bytes": 8 << 20, "g3_bytes": 8 << 20},
        }
    )
    adapter = _create_native_plugin_l2_adapter(config)
    try:
        assert type(adapter).__name__ == "NativeConnectorL2Adapter"
    finally:
        adapter.close()


def test_bad_key_is_refused(tmp_path: Path) -> None:
    a = KvtierL2Adapter(cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not an LMCache object key"):
        a.submit_batch_exists(["no-separators"])
    a.close()


def test_bad_buffers_are_refused_and_read_only_ones_still_store(tmp_path: Path) -> None:
    a = KvtierL2Adapter(cache_dir=str(tmp_path))
    frozen = memoryview(bytes(range(256)) * 16)
    assert _wait(a, a.submit_batch_set(KEYS[:1], [frozen]))[1], "a read-only buffer can be stored"
    with pytest.raises(ValueError, match="buffer 0: a read-only buffer"):
        a.submit_batch_get(KEYS[:1], [frozen])
    strided = memoryview(np.zeros(8192, np.uint8))[::2]
    with pytest.raises(ValueError, match="buffer 0: a buffer that is not C-contiguous"):
        a.submit_batch_get(KEYS[:1], [strided])
    dst = np.zeros(4096, np.uint8)
    assert _wait(a, a.submit_batch_get(KEYS[:1], [memoryview(dst)]))[3] == [True]
    assert dst.tobytes() == frozen.tobytes()
    a.close()


def test_codec_keeps_objects_as_kv_elements(tmp_path: Path) -> None:
    a = KvtierL2Adapter(cache_dir=str(tmp_path), codec="bf16", kv_dtype="f32")
    src = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    assert _wait(a, a.submit_batch_set(KEYS[:1], [memoryview(src).cast("B")]))[1]
    dst = np.zeros(4096, np.float32)
    assert _wait(a, a.submit_batch_get(KEYS[:1], [memoryview(dst).cast("B")]))[3] == [True]
    # bf16 keeps 8 bits of mantissa: close, not equal.
    err = float(np.abs(dst - src).max())
    assert 0 < err < 0.02 * float(np.abs(src).max())
    a.close()
