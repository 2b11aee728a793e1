"""kvtier.Store through the Python API: every layout round-trips with numpy
and torch memory, across a restart of the process; a flipped byte on disk
is reported corrupt for that block only; a cancelled load leaves memory
untouched past what it reports; a layer-wise load has each layer in when it
says so; bad memory is refused with a clear error."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtier
from kvtier import Layout, Store

ARRANGEMENTS = ["kv-major", "layer-major", "layer-fused", "latent"]


def pages(layout: Layout, blocks: int, seed: int, dtype: str) -> list[np.ndarray]:
    """Per layer a [blocks, layer_bytes] tensor of pages (as numpy bytes)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(blocks, layout.layer_bytes), dtype=np.uint8) for _ in range(layout.layers)]


def as_float(a: np.ndarray, dtype: str) -> np.ndarray:
    return a.view(np.float32) if dtype == "f32" else a.view(np.uint16)


def region_views(layout: Layout, layers: list[np.ndarray], block: int) -> list[np.ndarray]:
    """The regions of one block in payload order, as views of `layers`."""
    half = layout.layer_bytes // 2
    if layout.arrangement == "kv-major":
        return [t[block, part * half : (part + 1) * half] for part in (0, 1) for t in layers]
    return [t[block] for t in layers]


def hashes(n: int, tag: bytes = b"") -> list[bytes]:
    return [tag + i.to_bytes(8, "little") for i in range(n)]


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_every_layout_round_trips_with_numpy(tmp_path: Path, arrangement: str, dtype: str) -> None:
    layout = Layout(3, 2, 16, 8, dtype=dtype, arrangement=arrangement)
    store = Store(str(tmp_path), g2_bytes=64 << 20, g3_bytes=64 << 20)
    ns = store.namespace(layout, fingerprint="model-a")
    src = pages(layout, 20, 1, dtype)
    keys = hashes(20)
    saved = ns.save(keys, [region_views(layout, src, b) for b in range(20)]).wait()
    assert [r.status for r in saved] == ["stored"] * 20
    assert ns.lookup(keys) == 20
    assert ns.lookup(hashes(3, b"x") + keys) == 0

    dst = [np.zeros_like(t) for t in src]
    got = ns.load(keys, [region_views(layout, dst, b) for b in range(20)]).wait()
    assert all(r == "hit" and r.tier == "g2" for r in got), got
    for a, b in zip(src, dst, strict=True):
        np.testing.assert_array_equal(a, b)

    ns.evict_memory()
    dst = [np.zeros_like(t) for t in src]
    got = ns.load(keys, [region_views(layout, dst, b) for b in range(20)]).wait()
    assert all(r.tier == "g3" for r in got), got
    for a, b in zip(src, dst, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_cpu_pages_round_trip_with_torch(tmp_path: Path, dtype: torch.dtype) -> None:
    name = "f32" if dtype == torch.float32 else "bf16"
    layout = Layout.vllm_cpu(4, 2, 64, block_tokens=16, dtype=name)
    store = Store(str(tmp_path), g2_bytes=64 << 20, g3_bytes=64 << 20)
    ns = store.namespace(layout, fingerprint=b"model-b")
    # vLLM's CPU cache: per layer [num_blocks, kv_heads, block_size, 2 * head_size].
    torch.manual_seed(0)
    kv = [torch.randn(32, 2, 16, 128).to(dtype) for _ in range(4)]
    keys = hashes(10)
    ids = [3, 1, 4, 15, 9, 2, 6, 5, 30, 31]
    assert all(r == "stored" for r in ns.save_pages(keys, kv, ids).wait())
    ns.evict_memory()
    fresh = [torch.zeros_like(t) for t in kv]
    into = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    res = ns.load_pages(keys, fresh, into).wait()
    assert all(r.ok and r.tier == "g3" for r in res), res
    for li in range(4):
        for k, (a, b) in enumerate(zip(ids, into, strict=True)):
            assert torch.equal(kv[li][a], fresh[li][b]), (li, k)
        # Pages not loaded into stay zero.
        assert torch.count_nonzero(fresh[li][10:]) == 0


@pytest.mark.parametrize("codec", ["bf16", "fp8-e4m3", "int8"])
def test_a_coded_store_keeps_fewer_bytes_and_gives_torch_pages_back_within_bound(tmp_path: Path, codec: str) -> None:
    layout = Layout.vllm_cpu(2, 2, 64, block_tokens=16, dtype="f32", codec=codec)
    plain = Layout.vllm_cpu(2, 2, 64, block_tokens=16, dtype="f32")
    assert layout.codec == codec
    assert plain.codec == "none"
    assert layout.payload_bytes == plain.payload_bytes
    # bf16: 2 bytes a value; fp8 and int8: a 4-byte scale and 64 bytes a row of 64.
    per_row = 128 if codec == "bf16" else 68
    assert layout.stored_payload_bytes == plain.payload_bytes // 256 * per_row
    assert f"codec={codec!r}".replace("'", '"') in repr(layout)
    store = Store(str(tmp_path), g2_bytes=64 << 20, g3_bytes=64 << 20)
    ns = store.namespace(layout, fingerprint=b"model-c")
    torch.manual_seed(1)
    # Rows of very different sizes: each (token, head) row has its own scale.
    kv = [torch.randn(8, 2, 16, 128) * torch.logspace(-3, 3, 16).view(1, 1, 16, 1) for _ in range(2)]
    keys = hashes(8)
    assert all(r == "stored" for r in ns.save_pages(keys, kv, list(range(8))).wait())
    ns.evict_memory()
    back = [torch.zeros_like(t) for t in kv]
    res = ns.load_pages(keys, back, list(range(8))).wait()
    assert all(r.ok and r.tier == "g3" for r in res), res
    for a, b in zip(kv, back, strict=True):
        # Per 64-value group (K's half and V's half of each row).
        a64, b64 = a.reshape(-1, 64), b.reshape(-1, 64)
        amax = a64.abs().amax(dim=1, keepdim=True)
        bound = {
            "bf16": a64.abs() / 256,
            "fp8-e4m3": a64.abs() / 16 + amax / 448 / 1024,
            "int8": amax / 254 + 0 * a64,
        }[codec]
        assert bool(((a64 - b64).abs() <= bound * 1.001).all()), codec
        # And value for value what PyTorch's own bf16, float8_e4m3fn and
        # round-half-even make of the format's rule (docs/block-format.md).
        if codec == "bf16":
            want = a64.to(torch.bfloat16).float()
        else:
            top = 448.0 if codec == "fp8-e4m3" else 127.0
            scale = amax / top
            y = (a64 * (1.0 / scale)).clamp(-top, top)
            y = y.to(torch.float8_e4m3fn).float() if codec == "fp8-e4m3" else torch.round(y)
            want = y * scale
        assert torch.equal(b64, want), (codec, (b64 - want).abs().max())
    # The uncoded namespace of the same model shares no key with it.
    other = store.namespace(plain, fingerprint=b"model-c")
    assert other.lookup(keys) == 0
    with pytest.raises(ValueError, match="unknown codec"):
        Layout.vllm_cpu(2, 2, 64, codec="fp4")
    with pytest.raises(ValueError, match="cannot store"):
        Layout(2, 2, 64, 16, dtype="bf16", codec="bf16")


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_layerwise_load_has_each_layer_in_when_wait_layer_says_so(tmp_path: Path, codec: str) -> None:
    layout = Layout.vllm_cpu(4, 2, 64, block_tokens=16, dtype="f32", codec=codec)
    store = Store(str(tmp_path), g2_bytes=64 << 20, g3_bytes=64 << 20)
    ns = store.namespace(layout, fingerprint=b"model-l")
    torch.manual_seed(2)
    kv = [torch.randn(12, 2, 16, 128) for _ in range(4)]
    keys = hashes(10)
    assert all(r == "stored" for r in ns.save_pages(keys, kv, range(10)).wait())
    ns.evict_memory()
    whole = [torch.zeros_like(t) for t in kv]
    assert all(r.tier == "g3" for r in ns.load_pages(keys, whole, range(10)).wait())
    ns.evict_memory()

    # Block 10 is no one's: a miss, never written.
    back = [torch.full_like(t, 7.0) for t in kv]
    t = ns.load_pages(keys + hashes(1, b"none"), back, range(11), layerwise=True)
    for li in range(4):
        assert t.wait_layer(li, timeout=60)
        # Layer li is in now, while later layers may still be read.
        assert torch.equal(back[li][:10], whole[li][:10]), li
    res = t.wait()
    assert [r.status for r in res] == ["hit"] * 10 + ["miss"]
    assert all(r.tier == "g3" for r in res[:10])
    assert all(bool((b[10:] == 7.0).all()) for b in back)
    with pytest.raises(ValueError, match="timeout"):
        t.wait_layer(0, timeout=-1.0)

    # A corrupt layer on disk: that block is corrupt (its pages may have
    # been written: a caller keeps nothing made from it), the rest whole.
    path, off = ns.locate(keys[4]) or ("", 0)
    with open(path, "r+b") as f:
        at = off + 128 + 3 * layout.stored_payload_bytes // 4 + 5
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    ns.evict_memory()
    back = [torch.zeros_like(t) for t in kv]
    res = ns.load_pages(keys, back, range(10), layerwise=True).wait()
    assert [r.status for r in res] == ["hit"] * 4 + ["corrupt"] + ["hit"] * 5
    for li in range(4):
        assert torch.equal(back[li][:4], whole[li][:4])
        assert torch.equal(back[li][5:10], whole[li][5:10])


def test_warm_read_buffers_commit_the_g2_budget_at_open_and_reads_still_work(tmp_path: Path) -> None:
    # In a fresh process each: the resident memory a namespace adds within
    # a few seconds of its open, with and without warming.
    script = textwrap.dedent(
        """
        import sys, time, torch
        from kvtier import Layout, Store
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        warm = sys.argv[2] == "1"
        layout = Layout.vllm_cpu(2, 2, 64, block_tokens=16)
        store = Store(sys.argv[1], g2_bytes=96 << 20, g3_bytes=64 << 20)
        before = rss()
        ns = store.namespace(layout, fingerprint="w", warm_read_buffers=warm)
        deadline = time.monotonic() + (20 if warm else 2)
        while time.monotonic() < deadline and rss() - before < (64 << 20):
            time.sleep(0.1)
        grown = rss() - before
        kv = [torch.randn(4, 2, 16, 128) for _ in range(2)]
        keys = [bytes([i]) * 16 for i in range(4)]
        assert all(r == "stored" for r in ns.save_pages(keys, kv, range(4)).wait())
        ns.evict_memory()
        back = [torch.zeros_like(t) for t in kv]
        assert all(r.tier == "g3" for r in ns.load_pages(keys, back, range(4)).wait())
        assert all(torch.equal(a, b) for a, b in zip(kv, back))
        print(grown)
        """
    )
    grown = {}
    for warm in ("1", "0"):
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / f"w{warm}"), warm],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        grown[warm] = int(out.stdout.strip())
    # Warmed: most of the 96 MiB budget's blocks faulted in; cold: none.
    assert grown["1"] >= 64 << 20, grown
    assert grown["0"] < 16 << 20, grown


def test_a_restore_after_the_warming_takes_no_fresh_memory(tmp_path: Path) -> None:
    # What kvtier.vllm relies on at start: once wait_warm() returns, a
    # restore from G3 reads into warmed buffers, never into fresh memory.
    layout = Layout.vllm_cpu(2, 2, 64, block_tokens=16)
    kv = [torch.randn(8, 2, 16, 128) for _ in range(2)]
    keys = [bytes([i]) * 16 for i in range(8)]
    store = Store(str(tmp_path / "cache"), g2_bytes=4 << 20, g3_bytes=16 << 20)
    ns = store.namespace(layout, fingerprint="w")
    assert ns.wait_warm(timeout=0), "no warming asked for: nothing to wait for"
    assert all(r == "stored" for r in ns.save_pages(keys, kv, range(8)).wait())
    ns.flush()
    del ns, store

    def restore(warm: bool) -> tuple[dict[str, int], int]:
        gc.collect()  # the directory's last owner is closed
        store = Store(str(tmp_path / "cache"), g2_bytes=4 << 20, g3_bytes=16 << 20)
        ns = store.namespace(layout, fingerprint="w", warm_read_buffers=warm)
        assert ns.wait_warm(timeout=60)
        before = ns.stats()
        back = [torch.zeros_like(t) for t in kv]
        assert all(r.tier == "g3" for r in ns.load_pages(keys, back, range(8)).wait())
        assert all(torch.equal(a, b) for a, b in zip(kv, back, strict=True))
        return before, ns.stats()["fresh_buffers"] - before["fresh_buffers"]

    warmed, fresh = restore(warm=True)
    assert warmed["read_buffers_warm_target"] > len(keys), warmed
    assert warmed["read_buffers_warmed"] == warmed["read_buffers_warm_target"], warmed
    assert fresh == 0, f"{fresh} read buffers of a restore after the warming were fresh memory"
    # The control: without warming, the same restore's buffers are fresh.
    cold, fresh = restore(warm=False)
    assert cold["read_buffers_warm_target"] == 0, cold
    assert fresh >= len(keys), fresh


def test_one_namespace_s_warming_serves_every_namespace_of_the_store(tmp_path: Path) -> None:
    # kvtier.vllm keeps a model's KV heads in namespaces of their own and
    # warms the first: the others' restores read into those buffers too.
    layout = Layout.vllm_cpu(2, 1, 64, block_tokens=16)
    kv = [torch.randn(8, 1, 16, 128) for _ in range(2)]
    keys = [bytes([i]) * 16 for i in range(8)]
    store = Store(str(tmp_path / "cache"), g2_bytes=4 << 20, g3_bytes=16 << 20)
    for fp in ("head0", "head1"):
        ns = store.namespace(layout, fingerprint=fp)
        assert all(r == "stored" for r in ns.save_pages(keys, kv, range(8)).wait())
        ns.flush()
    del ns, store
    gc.collect()
    store = Store(str(tmp_path / "cache"), g2_bytes=4 << 20, g3_bytes=16 << 20)
    warm = store.namespace(layout, fingerprint="head0", warm_read_buffers=True)
    other = store.namespace(layout, fingerprint="head1")
    assert warm.wait_warm(timeout=60)
    before = other.stats()["fresh_buffers"]
    back = [torch.zeros_like(t) for t in kv]
    assert all(r.tier == "g3" for r in other.load_pages(keys, back, range(8)).wait())
    assert all(torch.equal(a, b) for a, b in zip(kv, back, strict=True))
    assert other.stats()["fresh_buffers"] == before


@pytest.mark.parametrize(("eviction", "evicted"), [("kvtier", "x"), ("lru", "x"), ("fifo", "h")])
def test_the_eviction_policy_is_chosen_and_the_prefix_aware_ones_keep_a_chains_head(
    tmp_path: Path, eviction: str, evicted: str
) -> None:
    # G2 holds three blocks. A chain h -> x is saved in one call, then y and
    # z: room for z must go. FIFO drops the oldest, the head h; LRU and
    # kvtier drop leaves only, so h stays and x goes to G3. In a fresh
    # process: G2 weighs blocks by their buffers, and buffers recycled from
    # other tests' layouts would weigh more.
    script = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store import pages, region_views
        from kvtier import Layout, Store
        layout = Layout(2, 1, 16, 4)
        probe = Store({str(tmp_path / "probe")!r}, g2_bytes=64 << 20, g3_bytes=64 << 20)
        ns = probe.namespace(layout, fingerprint="m")
        ns.save([b"p"], [region_views(layout, pages(layout, 1, 0, "f32"), 0)]).wait()
        block_bytes = probe.metrics()["g2_used_bytes"]
        store = Store({str(tmp_path / "c")!r}, g2_bytes=3 * block_bytes, g3_bytes=64 << 20,
                      eviction={eviction!r})
        ns = store.namespace(layout, fingerprint="m")
        src = pages(layout, 4, 1, "f32")
        for keys, blocks in (([b"h", b"x"], [0, 1]), ([b"y"], [2]), ([b"z"], [3])):
            ns.save(keys, [region_views(layout, src, b) for b in blocks]).wait()
        g2_blocks = store.metrics()["g2_blocks"]
        # An evicted block stays readable from the write-back queue until
        # written: write it, so a load says where each block lives.
        ns.flush()
        dst = [np.zeros_like(t) for t in src]
        got = ns.load([b"h", b"x"], [region_views(layout, dst, b) for b in (0, 1)]).wait()
        print(json.dumps({{"g2_blocks": g2_blocks, "h": got[0].tier, "x": got[1].tier}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    kept = "h" if evicted == "x" else "x"
    assert seen["g2_blocks"] == 3, (eviction, seen)
    assert seen[evicted] == "g3", (eviction, seen)
    assert seen[kept] == "g2", (eviction, seen)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        Store(str(tmp_path / "d"), eviction="mru")


def test_a_restarted_process_finds_the_blocks(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(2, 1, 64, block_tokens=16)
    src = pages(layout, 8, 7, "f32")
    np.save(tmp_path / "src.npy", np.stack(src))
    store = Store(str(tmp_path / "cache"), g2_bytes=8 << 20, g3_bytes=16 << 20)
    ns = store.namespace(layout, fingerprint="m", salt=b"tenant-1")
    assert all(r.ok for r in ns.save_pages(hashes(8), src, range(8)).wait())
    del ns, store  # closes: G2 is written to G3
    script = textwrap.dedent(
        f"""
        import numpy as np, kvtier
        src = np.load({str(tmp_path / "src.npy")!r})
        store = kvtier.Store({str(tmp_path / "cache")!r}, g2_bytes=8 << 20, g3_bytes=16 << 20)
        layout = kvtier.Layout.vllm_cpu(2, 1, 64, block_tokens=16)
        keys = [i.to_bytes(8, "little") for i in range(8)]
        other = store.namespace(layout, fingerprint="m", salt=b"tenant-2", name="other")
        assert other.lookup(keys) == 0, "another tenant sees the blocks"
        ns = store.namespace(layout, fingerprint="m", salt=b"tenant-1")
        assert ns.lookup(keys) == 8
        dst = [np.zeros_like(src[0]), np.zeros_like(src[1])]
        res = ns.load_pages(keys, dst, range(8)).wait()
        assert all(r.tier == "g3" for r in res), res
        assert (np.stack(dst) == src).all()
        print("restored 8")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "restored 8" in out.stdout


def test_a_second_process_on_the_same_cache_dir_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(2, 1, 64, block_tokens=16)
    store = Store(str(tmp_path / "cache"), g2_bytes=8 << 20, g3_bytes=16 << 20)
    ns = store.namespace(layout, fingerprint="m")
    script = textwrap.dedent(
        f"""
        import kvtier
        store = kvtier.Store({str(tmp_path / "cache")!r}, g2_bytes=8 << 20, g3_bytes=16 << 20)
        layout = kvtier.Layout.vllm_cpu(2, 1, 64, block_tokens=16)
        try:
            store.namespace(layout, fingerprint="m")
        except kvtier.StoreError as e:
            print("refused:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"in use by process {os.getpid()}" in out.stdout, out.stdout
    # The holder is unharmed: it still saves and loads.
    src = pages(layout, 2, 3, "f32")
    assert all(r.ok for r in ns.save_pages(hashes(2), src, range(2)).wait())
    dst = [np.zeros_like(t) for t in src]
    assert all(r.tier == "g2" for r in ns.load_pages(hashes(2), dst, range(2)).wait())
    assert all((a == b).all() for a, b in zip(src, dst, strict=True))


def test_remove_namespace_takes_only_kvtier_files_of_a_namespace_nobody_has_open(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(2, 1, 64, block_tokens=16)
    cache = tmp_path / "cache"
    # Another process holds namespace "a" open: it is refused, files intact.
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, kvtier
        store = kvtier.Store({str(cache)!r}, g2_bytes=8 << 20, g3_bytes=16 << 20)
        ns = store.namespace(kvtier.Layout.vllm_cpu(2, 1, 64, block_tokens=16), fingerprint="m", name="a")
        src = [np.full((2, ns.layout.layer_bytes), 7, dtype=np.uint8) for _ in range(2)]
        assert all(r.ok for r in ns.save_pages([b"k0", b"k1"], src, range(2)).wait())
        ns.flush()
        print("open", flush=True)
        sys.stdin.readline()
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        assert child.stdout.readline().strip() == "open"
        store = Store(str(cache), g2_bytes=8 << 20, g3_bytes=16 << 20)
        files = sorted(p.name for p in (cache / "a").rglob("*"))
        assert store.remove_namespace("a") is False
        assert sorted(p.name for p in (cache / "a").rglob("*")) == files
        child.stdin.write("\n")
        child.stdin.flush()
    finally:
        child.wait(timeout=60)
    assert child.returncode == 0
    # Closed: it goes, but a file kvtier did not write stays, with its directory.
    slot_dirs = list((cache / "a" / "kvtier-g3").iterdir())
    (slot_dirs[0] / "notes.txt").write_text("mine")
    assert store.remove_namespace("a") is True
    assert [p.name for p in (cache / "a").rglob("*") if p.is_file()] == ["notes.txt"]
    assert (slot_dirs[0] / "notes.txt").read_text() == "mine"
    # Open in this very store: refused; none at all: nothing to do.
    store.namespace(layout, fingerprint="m", name="b")
    assert store.remove_namespace("b") is False
    assert (cache / "b").is_dir()
    assert store.remove_namespace("never-made") is True
    with pytest.raises(ValueError, match="namespace name"):
        store.remove_namespace("../elsewhere")


def test_spans_of_one_buffer_round_trip_and_stay_inside_it(tmp_path: Path) -> None:
    layout = Layout(2, 1, 8, 4, dtype="f32", arrangement="layer-major")
    store = Store(str(tmp_path), g2_bytes=8 << 20, g3_bytes=8 << 20)
    ns = store.namespace(layout, fingerprint="m")
    half = layout.payload_bytes // 2
    pool = torch.arange(8 * half // 4, dtype=torch.float32)  # 8 half-blocks
    # Block i is half-blocks (i + 4, i) in that order: spans out of order.
    spans = [[((i + 4) * half, half), (i * half, half)] for i in range(2)]
    assert all(r == "stored" for r in ns.save_spans(hashes(2), pool, spans).wait())
    ns.evict_memory()
    back = torch.zeros_like(pool)
    res = ns.load_spans(hashes(2), back, spans).wait()
    assert all(r.ok and r.tier == "g3" for r in res), res
    raw, got = pool.numpy().view(np.uint8), back.numpy().view(np.uint8)
    for i in range(2):
        for off, n in spans[i]:
            np.testing.assert_array_equal(raw[off : off + n], got[off : off + n])
    assert int(torch.count_nonzero(back[2 * half // 4 : 4 * half // 4])) == 0, "only the spans are written"
    # The block's bytes are the spans in order.
    plain = np.zeros(layout.payload_bytes, dtype=np.uint8)
    assert ns.load(hashes(1), [plain]).wait()[0].ok
    np.testing.assert_array_equal(plain, np.concatenate([raw[4 * half : 5 * half], raw[:half]]))
    with pytest.raises(ValueError, match="outside"):
        ns.load_spans(hashes(1), back, [[(7 * half, half), (8 * half, half)]])
    with pytest.raises(ValueError, match="payload"):
        ns.load_spans(hashes(1), back, [[(0, half)]])


def _blocks_on_disk_after_kill_9(tmp_path: Path, g3_sync_ms: int) -> int:
    """Saves 8 blocks in a child process with ``g3_sync_ms``, kills it with
    SIGKILL a second later, and counts the blocks a new store loads from G3."""
    layout = Layout.vllm_cpu(2, 1, 64, block_tokens=16)
    cache = tmp_path / f"cache-{g3_sync_ms}"
    script = textwrap.dedent(
        f"""
        import sys, time, numpy as np, kvtier
        store = kvtier.Store({str(cache)!r}, g2_bytes=8 << 20, g3_bytes=16 << 20, g3_sync_ms={g3_sync_ms})
        layout = kvtier.Layout.vllm_cpu(2, 1, 64, block_tokens=16)
        ns = store.namespace(layout, fingerprint="m")
        src = [np.full((8, layout.layer_bytes), 7, dtype=np.uint8) for _ in range(2)]
        keys = [i.to_bytes(8, "little") for i in range(8)]
        assert all(r.ok for r in ns.save_pages(keys, src, range(8)).wait())
        print("saved", flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "saved"
        time.sleep(1.0)
        child.kill()
    finally:
        child.wait(timeout=60)
    assert child.returncode == -9
    store = Store(str(cache), g2_bytes=8 << 20, g3_bytes=16 << 20)
    ns = store.namespace(layout, fingerprint="m")
    dst = [np.zeros((8, layout.layer_bytes), dtype=np.uint8) for _ in range(2)]
    res = ns.load_pages(hashes(8), dst, range(8)).wait()
    hits = [r for r in res if r.tier == "g3"]
    assert all((d[[i for i, r in enumerate(res) if r.tier == "g3"]] == 7).all() for d in dst)
    return len(hits)


def test_blocks_older_than_the_sync_bound_survive_a_kill_9(tmp_path: Path) -> None:
    assert _blocks_on_disk_after_kill_9(tmp_path, 100) == 8
    # The control: with the sync off, the blocks never left host memory.
    assert _blocks_on_disk_after_kill_9(tmp_path, 0) == 0


def test_a_flipped_byte_is_corrupt_for_that_block_only(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(2, 2, 64, block_tokens=16)
    store = Store(str(tmp_path), g2_bytes=8 << 20, g3_bytes=16 << 20)
    ns = store.namespace(layout, fingerprint="m")
    src = pages(layout, 6, 3, "f32")
    keys = hashes(6)
    ns.save_pages(keys, src, range(6)).wait()
    ns.evict_memory()
    where = ns.locate(keys[2])
    assert where is not None
    path, off = where
    with open(path, "r+b") as f:
        f.seek(off + 128 + 77)
        b = f.read(1)
        f.seek(off + 128 + 77)
        f.write(bytes([b[0] ^ 0x40]))
    dst = [np.full_like(t, 0xEE) for t in src]
    res = ns.load_pages(keys, dst, range(6)).wait()
    assert [r.status for r in res] == ["hit", "hit", "corrupt", "hit", "hit", "hit"]
    assert "checksum" in (res[2].reason or "")
    assert res[2].cause == "payload_checksum"
    assert res[2].tier is None
    assert res[0].cause is None
    for li in range(2):
        assert (dst[li][2] == 0xEE).all(), "a corrupt block reached memory"
        for b in (0, 1, 3, 4, 5):
            np.testing.assert_array_equal(dst[li][b], src[li][b])
    assert ns.stats()["g3_corrupt_blocks"] == 1
    # Deleted: a miss from now on.
    assert ns.lookup(keys[2:3]) == 0


def test_a_cancelled_load_writes_only_what_it_reports(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(2, 2, 64, block_tokens=16)
    store = Store(str(tmp_path), g2_bytes=64 << 20, g3_bytes=64 << 20)
    ns = store.namespace(layout, fingerprint="m")
    n = 400
    src = pages(layout, n, 5, "f32")
    keys = hashes(n)
    ns.save_pages(keys, src, range(n)).wait()
    ns.evict_memory()
    dst = [np.full_like(t, 0xCC) for t in src]
    t = ns.load_pages(keys, dst, range(n))
    t.cancel()
    res = t.wait()
    assert t.done()
    assert len(t) == n
    statuses = {r.status for r in res}
    assert statuses <= {"hit", "cancelled"}, statuses
    assert "cancelled" in statuses
    for b, r in enumerate(res):
        for li in range(2):
            if r == "hit":
                np.testing.assert_array_equal(dst[li][b], src[li][b])
            else:
                assert (dst[li][b] == 0xCC).all(), f"cancelled block {b} was written"


def test_misses_and_a_dead_pool_are_told_apart(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(1, 1, 64, block_tokens=16)
    store = Store(str(tmp_path / "a"), g2_bytes=1 << 20, g3_bytes=4 << 20)
    ns = store.namespace(layout, fingerprint="m")
    dst = [np.zeros((2, layout.layer_bytes), np.uint8)]
    assert [r.status for r in ns.load_pages(hashes(2), dst, [0, 1]).wait()] == ["miss", "miss"]
    dead = Store(str(tmp_path / "b"), g2_bytes=1 << 20, g3_bytes=4 << 20, remote="redis://127.0.0.1:1")
    res = dead.namespace(layout, fingerprint="m").load_pages(hashes(2), dst, [0, 1]).wait()
    assert all(r.status == "error" and "G4" in (r.reason or "") for r in res), res


def test_bad_memory_and_arguments_are_refused(tmp_path: Path) -> None:
    layout = Layout.vllm_cpu(2, 1, 64, block_tokens=16)
    store = Store(str(tmp_path), g2_bytes=1 << 20, g3_bytes=4 << 20)
    ns = store.namespace(layout, fingerprint="m")
    good = [np.zeros((4, layout.layer_bytes), np.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="outside"):
        ns.load_pages(hashes(1), good, [4])
    with pytest.raises(ValueError, match="2-layer"):
        ns.load_pages(hashes(1), good[:1], [0])
    with pytest.raises(ValueError, match="contiguous"):
        ns.load(hashes(1), [np.zeros((2, layout.payload_bytes), np.uint8)[:, ::2].T])
    ro = np.zeros(layout.payload_bytes, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ns.load(hashes(1), [ro])
    assert ns.save(hashes(1), [ro]).wait()[0] == "stored"  # reading is fine
    with pytest.raises(ValueError, match="payload"):
        ns.load(hashes(1), [np.zeros(layout.payload_bytes - 4, np.uint8)])
    with pytest.raises(ValueError, match="keys but"):
        ns.load(hashes(2), [np.zeros(layout.payload_bytes, np.uint8)])
    with pytest.raises(TypeError):
        ns.lookup(["not bytes"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        ns.load(hashes(1), [[1, 2]])
    with pytest.raises(ValueError, match="arrangement"):
        Layout(1, 1, 8, 4, arrangement="planar")
    with pytest.raises(ValueError, match="dtype"):
        Layout(1, 1, 8, 4, dtype="f64")
    with pytest.raises(ValueError, match="layers must be at least 1"):
        Layout(0, 1, 8, 4)
    with pytest.raises(ValueError, match="rank"):
        Layout(1, 1, 8, 4, tp_rank=2, tp_world=2)
    with pytest.raises(ValueError, match="another model"):
        store.namespace(Layout.vllm_cpu(3, 1, 64, block_tokens=16), fingerprint="m", name=ns.name)
    with pytest.raises(ValueError, match="namespace name"):
        store.namespace(layout, fingerprint="m", name="../escape")
    with pytest.raises(kvtier.KvtierError):
        Store(str(tmp_path / "x"), remote="ftp://nowhere")


def test_namespaces_share_g2_and_keys_follow_the_documented_scheme(tmp_path: Path) -> None:
    store = Store(str(tmp_path), g2_bytes=2 << 20, g3_bytes=16 << 20)
    a = store.namespace(Layout.vllm_cpu(2, 2, 64, block_tokens=16), fingerprint="a")
    b = store.namespace(Layout(1, 1, 64, 16, dtype="bf16"), fingerprint="b")
    assert a.name != b.name
    assert store.namespace(a.layout, fingerprint="a").name == a.name
    src = pages(a.layout, 40, 9, "f32")
    a.save_pages(hashes(40), src, range(40)).wait()
    assert store.metrics()["g2_used_bytes"] <= 2 << 20
    a.flush()
    dst = [np.zeros_like(t) for t in src]
    assert all(r.ok for r in a.load_pages(hashes(40), dst, range(40)).wait())
    for x, y in zip(src, dst, strict=True):
        np.testing.assert_array_equal(x, y)
    # docs/keys.md's golden vector: raw key of b"abc" for the golden seed.
    golden = Store(str(tmp_path / "g")).namespace(
        Layout(2, 2, 8, 4), fingerprint=b"kvtier-golden-model", salt=b"tenant-a"
    )
    assert golden.keys([b"abc"])[0].hex() == "ef79ddfb82bc4c5dfbe2f2ad8f8715b2"
    assert golden.token_keys(range(4))[0].hex() == "d367b8a181f5f23128d58da0cf8632d9"
    salted = golden.token_keys(range(4), salt=b"req-salt")[0].hex()
    assert salted == "5dd51103fa28ad9cdcd31996e7cfe01d"  # docs/keys.md, request salts
    assert golden.token_keys(range(4), salt=b"") == golden.token_keys(range(4))
    m = store.metrics()["namespaces"]
    assert set(m) == {a.name, b.name}
