"""LMCache's own engine-side client (``lmcache bench server --mode cpu``'s
``ServerBenchClient``) against a real ``lmcache server``, one L2 adapter
after another: kvtier's, LMCache's ``fs`` and ``fs_native`` (and
``fs_native`` with ``use_odirect``), runs interleaved, one directory (one
disk).

Per run and adapter, in a fresh directory:

1. a server stores ``--sequences`` sequences of ``--tokens`` tokens (the
   client's KV, checksummed per chunk) and waits until L2 holds them all;
2. ``warm``: ``POST /cache/clear`` empties L1, then each sequence is looked
   up and retrieved (the lookup brings its chunks from L2 into L1), timed;
   kvtier serves from its G2, the file adapters from the page cache;
3. ``restart``: the server is stopped (Ctrl-C: adapters close), every file
   under the directory is dropped from the page cache
   (``posix_fadvise(DONTNEED)``), a new server starts on the same
   directory and the same lookups and retrievals are timed: kvtier reads
   G3 with O_DIRECT, the file adapters read their files.

Every retrieved sequence's chunk checksums are compared with the stored
ones; a run where one differs or misses counts as failed. Prints, per
adapter and phase, the median (min-max) GB/s of KV retrieved and ms per
sequence; ``--json`` writes every run.

    python bench_server.py --dir DIR [--sequences 8] [--tokens 512] [--runs 5] [--json OUT]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "testing"))

from servers import drop_page_cache
from test_lmcache_server import CHUNK, Server, kvtier_adapter


def adapters(root: Path) -> dict[str, dict[str, Any]]:
    """The ``--l2-adapter`` spec of each adapter compared, under ``root``."""
    return {
        "kvtier": kvtier_adapter(root, g2_bytes=2 << 30, g3_bytes=4 << 30),
        "fs": {"type": "fs", "base_path": str(root)},
        "fs_native": {"type": "fs_native", "base_path": str(root)},
        "fs_native_odirect": {"type": "fs_native", "base_path": str(root), "use_odirect": True},
    }


def request(client: Any, seq: int, kind: str) -> Any:
    req = client.create_request(seq, request_id=f"bench-{seq}-{kind}-{time.monotonic_ns()}", request_kind=kind)
    if req is None:
        raise RuntimeError(f"no request for sequence {seq}")
    return req


def store_all(client: Any, sequences: int) -> dict[int, list[str]]:
    """Stores every sequence; returns each one's chunk checksums."""
    expected: dict[int, list[str]] = {}
    for seq in range(sequences):
        req = request(client, seq, "cold")
        expected[seq] = client.compute_checksums(req, start_token=0, token_count=req.num_full_tokens)
        stored = client.store(req, start_token=0, token_count=req.num_full_tokens)
        if not stored.succeeded:
            raise RuntimeError(f"store of sequence {seq} failed: {stored}")
        client.end_session(req)
    return expected


def load_all(client: Any, expected: dict[int, list[str]]) -> tuple[float, bool]:
    """Looks up and retrieves every sequence (timed); whether every chunk
    hit with the stored checksums (checked after the clock stops)."""
    seconds = 0.0
    whole = True
    for seq, want in expected.items():
        req = request(client, seq, "warm")
        client.zero_destination(req, start_token=0, token_count=req.num_full_tokens)
        start = time.perf_counter()
        lookup = client.lookup(req)
        n = lookup.hit_chunks if lookup.succeeded else 0
        if n:
            got = client.retrieve(req, start_token=0, token_count=n * CHUNK)
            whole = whole and got.succeeded
        seconds += time.perf_counter() - start
        if n != len(want) or client.compute_checksums(req, start_token=0, token_count=n * CHUNK) != want:
            whole = False
        client.end_session(req)
    return seconds, whole


def wait_for_l2(server: Server, client: Any, expected: dict[int, list[str]]) -> None:
    """Waits until L2 holds every stored chunk: L1 emptied, then every
    lookup full (LMCache writes L2 behind the store)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        server.clear_l1()
        full = True
        for seq, want in expected.items():
            req = request(client, seq, "probe")
            lookup = client.lookup(req)
            full = full and lookup.succeeded and lookup.hit_chunks == len(want)
            client.end_session(req)
        if full:
            return
        time.sleep(0.5)
    raise RuntimeError("L2 never held every stored chunk")


def one_run(name: str, spec: dict[str, Any], root: Path, args: argparse.Namespace) -> dict[str, Any]:
    root.parent.mkdir(parents=True, exist_ok=True)
    log = root.parent / f"{root.name}.log"
    l1_gb = max(1.0, 2.5 * args.sequences * args.tokens * args.kv_bytes_per_token / 1e9)
    s = Server(root, log, adapter=spec, l1_gb=round(l1_gb, 1), num_tokens=args.tokens)
    try:
        client = s.client()
        expected = store_all(client, args.sequences)
        wait_for_l2(s, client, expected)
        s.clear_l1()
        warm_s, warm_ok = load_all(client, expected)
        client.close()
    finally:
        s.stop()
    drop_page_cache(root)
    s = Server(root, log, adapter=spec, l1_gb=round(l1_gb, 1), num_tokens=args.tokens)
    try:
        client = s.client()
        restart_s, restart_ok = load_all(client, expected)
        client.close()
    finally:
        s.stop()
    total = args.sequences * args.tokens * args.kv_bytes_per_token
    return {
        "adapter": name,
        "warm_gbps": total / warm_s / 1e9,
        "warm_ms_per_sequence": warm_s * 1000 / args.sequences,
        "warm_ok": warm_ok,
        "restart_gbps": total / restart_s / 1e9,
        "restart_ms_per_sequence": restart_s * 1000 / args.sequences,
        "restart_ok": restart_ok,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="a directory on the disk to measure (made if missing)")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="tokens per sequence (a multiple of 16)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--adapters", default="kvtier,fs,fs_native,fs_native_odirect")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    # The client's default KV shape, (2, NB, 16, 8, 128) float16 x 32 layers:
    # K and V, 8 heads of 128 fp16 per layer.
    args.kv_bytes_per_token = 2 * 8 * 128 * 2 * 32
    names = args.adapters.split(",")
    runs: list[dict[str, Any]] = []
    for r in range(args.runs):
        for name in names:
            root = args.dir / f"run{r}-{name}"
            spec = adapters(root)[name]
            out = one_run(name, spec, root, args)
            runs.append(out)
            print(json.dumps(out), flush=True)
    print(f"\n{args.sequences} sequences x {args.tokens} tokens, {args.runs} runs, median (min-max):")
    print(f"{'adapter':<20}{'warm GB/s':>22}{'restart GB/s':>22}{'restart ms/seq':>22}  all verified")
    for name in names:
        mine = [x for x in runs if x["adapter"] == name]

        def cell(k: str, rows: list[dict[str, Any]] = mine) -> str:
            v = [x[k] for x in rows]
            return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

        ok = all(x["warm_ok"] and x["restart_ok"] for x in mine)
        print(f"{name:<20}{cell('warm_gbps'):>22}{cell('restart_gbps'):>22}{cell('restart_ms_per_sequence'):>22}  {ok}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
