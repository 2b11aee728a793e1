"""The connector's flusher (kvtier.vllm.flusher.Flusher) on a real store, without
a vLLM process: a save stays in G2 until something writes it on to G3; the
flusher does so once the save's copy is done, with nobody calling flush,
and its stop writes every save queued before it."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvtier import Layout, Store
from kvtier.vllm.flusher import Flusher

LAYOUT = Layout.vllm_cpu(4, 2, 64)


def _pages(blocks: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (blocks, LAYOUT.kv_heads, LAYOUT.block_tokens, 2 * LAYOUT.head_dim)
    return [torch.randn(shape, generator=g) for _ in range(LAYOUT.layers)]


def test_saves_reach_g3_once_copied_and_a_stop_writes_the_rest(tmp_path: Path) -> None:
    # No periodic G3 sync (g3_sync_ms, 1 s by default): only the flusher
    # writes to G3 here.
    store = Store(str(tmp_path), g2_bytes=64 << 20, g3_bytes=64 << 20, g3_sync_ms=0)
    ns = store.namespace(LAYOUT, fingerprint="flusher-test")
    layers = _pages(6)
    keys = ns.token_keys(list(range(6 * LAYOUT.block_tokens)))

    # A save alone stays in G2: a restart (or a kill) would lose it.
    first = ns.save_pages(keys[:2], layers, [0, 1]).wait()
    assert [r.status for r in first or []] == ["stored"] * 2
    assert ns.stats()["g3_blocks"] == 0

    # Handed to the flusher, it reaches G3 with nobody calling flush (one
    # flush takes every block in G2, the earlier save's too).
    flusher = Flusher()
    flusher.add(ns, ns.save_pages(keys[2:4], layers, [2, 3]))
    deadline = time.monotonic() + 60
    while ns.stats()["g3_blocks"] < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ns.stats()["g3_blocks"] == 4

    # A stop right after a save still writes it.
    flusher.add(ns, ns.save_pages(keys[4:], layers, [4, 5]))
    flusher.stop()
    assert ns.stats()["g3_blocks"] == 6
    assert ns.stats()["writeback_pending"] == 0

    # What G3 holds reads back from G3, equal to the pages saved.
    ns.evict_memory()
    out = [torch.zeros_like(t) for t in layers]
    got = ns.load_pages(keys, out, list(range(6))).wait()
    assert [(r.status, r.tier) for r in got or []] == [("hit", "g3")] * 6
    for a, b in zip(layers, out, strict=True):
        assert torch.equal(a, b)
