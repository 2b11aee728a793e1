"""Reads of N pages from disk into SGLang's host pool: kvtier's backend
(``batch_get_v1``, zero-copy, every block verified) beside SGLang's own
``file`` backend (the path SGLang's cache controller takes for it:
``batch_get`` into flat pages, then ``set_from_flat_data_page``), both
under one directory (one disk), runs interleaved, GB/s of page bytes.

Before each timed read the pages are taken off host memory: kvtier's G2 is
emptied into G3 (``Namespace.evict_memory``), and every file of both
backends is dropped from the page cache (``posix_fadvise(DONTNEED)``), so
both read from the disk. SGLang 0.5.23's file backend has no O_DIRECT
option (it reads with ``open(..., buffering=0)``, through the page cache);
kvtier's G3 reads with O_DIRECT.

    python bench_hicache.py --dir DIR [--pages 256] [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "testing"))

import torch
from pools import PoolSpec, fill, kvtier_extra, make_backend, make_pool, page_bytes, page_indices, page_keys
from servers import drop_page_cache
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE


def read_kvtier(b: Any, keys: list[str], idx: torch.Tensor, page_size: int) -> int:
    ok = 0
    for s in range(0, len(keys), STORAGE_BATCH_SIZE):
        chunk = keys[s : s + STORAGE_BATCH_SIZE]
        ok += sum(b.batch_get_v1(chunk, idx[s * page_size : (s + len(chunk)) * page_size]))
    return ok


def read_file(b: Any, pool: Any, keys: list[str], idx: torch.Tensor, page_size: int) -> int:
    # SGLang's CacheController._generic_page_get, batch by batch.
    ok = 0
    for s in range(0, len(keys), STORAGE_BATCH_SIZE):
        chunk = keys[s : s + STORAGE_BATCH_SIZE]
        dummies = [pool.get_dummy_flat_data_page() for _ in chunk]
        data = b.batch_get(chunk, dummies)
        for i, d in enumerate(data):
            if d is None:
                break
            pool.set_from_flat_data_page(int(idx[(s + i) * page_size]), d)
            ok += 1
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a fresh directory on the disk to measure")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()

    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    spec = PoolSpec(
        "mha",
        a.layout,
        layers=a.layers,
        heads=a.heads,
        head_dim=a.head_dim,
        page_size=a.page_size,
        tokens=a.pages * a.page_size,
        dtype="bf16",
    )
    pool = make_pool(spec)
    fill(pool, 1)
    pages = list(range(a.pages))
    idx = page_indices(pages, spec.page_size)
    keys = page_keys(a.pages, spec.page_size, 1)
    want = [page_bytes(pool, p) for p in pages[:: max(1, a.pages // 16)]]
    page_nbytes = len(page_bytes(pool, 0))
    total = a.pages * page_nbytes

    kv = make_backend(spec, pool, kvtier_extra(str(root / "kvtier"), g2_bytes=2 * total, g3_bytes=4 * total))
    file_extra = {"file_storage_path": str(root / "file")}
    fb = make_backend(spec, pool, file_extra, backend="file")
    for s in range(0, a.pages, STORAGE_BATCH_SIZE):
        chunk = keys[s : s + STORAGE_BATCH_SIZE]
        assert all(kv.batch_set_v1(chunk, idx[s * spec.page_size : (s + len(chunk)) * spec.page_size]))
        vals = [pool.get_data_page(p * spec.page_size, flat=True) for p in pages[s : s + len(chunk)]]
        assert fb.batch_set(chunk, vals)
    kv.close()

    gbps: dict[str, list[float]] = {"kvtier": [], "file": []}
    for run in range(a.runs):
        order = ["kvtier", "file"] if run % 2 == 0 else ["file", "kvtier"]
        for name in order:
            kv.namespace.evict_memory()
            drop_page_cache(root)
            pool.kv_buffer.zero_()
            t0 = time.perf_counter()
            n = (
                read_kvtier(kv, keys, idx, spec.page_size)
                if name == "kvtier"
                else read_file(fb, pool, keys, idx, spec.page_size)
            )
            dt = time.perf_counter() - t0
            assert n == a.pages, (name, n)
            assert [page_bytes(pool, p) for p in pages[:: max(1, a.pages // 16)]] == want, name
            gbps[name].append(total / dt / 1e9)
            print(f"run {run} {name}: {total / dt / 1e9:.2f} GB/s ({dt:.3f} s)", flush=True)
    out = {
        "pages": a.pages,
        "page_bytes": page_nbytes,
        "layout": a.layout,
        "runs": a.runs,
        "gbps": gbps,
        "median": {k: statistics.median(v) for k, v in gbps.items()},
        "min": {k: min(v) for k, v in gbps.items()},
        "max": {k: max(v) for k, v in gbps.items()},
    }
    print(json.dumps(out["median"]), json.dumps(out["min"]), json.dumps(out["max"]))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
