"""The connector's staged path (KV caches that are not in host memory, an
accelerator's) round-trips pages through host buffers and kvtier's store.
Run here on CPU tensors: everything but the device copy itself."""

from __future__ import annotations

from pathlib import Path

import torch

from kvtier import Layout, Store
from kvtier.vllm import _Staging


def test_staged_pages_round_trip_through_the_store(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(3, 2, 64)
    ns = Store(str(tmp_path)).namespace(layout, fingerprint="staging-test")
    torch.manual_seed(0)
    layers = [torch.randn(8, 2, 128, 128) for _ in range(3)]
    original = [t.clone() for t in layers]
    staging = _Staging(layers, layout)
    blocks = [5, 2]
    keys = ns.token_keys(list(range(256)))
    host = staging.gather(blocks)
    assert all(r.ok for r in ns.save(keys, _Staging.pieces(host)).wait() or [])
    for t in layers:
        t.zero_()
    back = staging.buffer(len(blocks))
    results = ns.load(keys, _Staging.pieces(back)).wait() or []
    assert [r.status for r in results] == ["hit", "hit"]
    staging.scatter(back, blocks)
    for t, o in zip(layers, original):
        for b in range(8):
            if b in blocks:
                assert torch.equal(t[b], o[b])
            else:
                assert torch.count_nonzero(t[b]) == 0
