"""G3 restore GB/s through the Python store API beside the Rust
``kvtier store bench`` on a block set of the same shape, in one run.

The Python side saves ``--total-bytes`` of blocks of vLLM's CPU page layout
whose slot is ``--block-bytes`` into a :class:`kvtier.Store` namespace,
flushes them to G3, and then, ``--repeat`` times, empties G2, drops the page
cache and loads every block into per-layer torch tensors
(:meth:`kvtier.Namespace.load_pages`), each verified and copied. After each
Python round the Rust side runs once (``kvtier store bench --json --repeat
1``) with the same total, block size and reads in flight: the rounds are
interleaved, so drift in the device's speed hits both sides alike; the
medians are reported. GB/s is bytes of slots read over the time (10^9 bytes per
second). The binary is ``--kvtier``, else ``$KVTIER_BIN``, else ``kvtier``
on ``PATH``.

JSON (``--json``): ``{"python_gbps": f64, "rust_gbps": f64}`` plus
``ratio``, ``paired_ratio`` (the median of each round's python / rust), the
samples and the shape.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._host import drop_page_cache, median

if TYPE_CHECKING:
    from kvtier import Layout

# One vLLM CPU page per block: 16 layers, 2 KV heads of 64, f32; tokens per
# block are chosen so the slot (header + payload, 4 KiB-aligned) fits
# --block-bytes.
LAYERS, KV_HEADS, HEAD_DIM = 16, 2, 64


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dir", default=None, help="where to put the block sets (default: a temporary directory)")
    ap.add_argument("--total-bytes", type=int, default=1 << 30, help="bytes of blocks (default 1 GiB)")
    ap.add_argument("--block-bytes", type=int, default=2 << 20, help="bytes of one slot (default 2 MiB)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the median is reported (default 3)")
    ap.add_argument("--in-flight", type=int, default=32, help="reads in flight on both sides (default 32)")
    ap.add_argument("--kvtier", default=None, help="the kvtier binary for the Rust side")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _layout(block_bytes: int) -> Layout:
    import kvtier

    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
    tokens = max(1, (block_bytes - 4096) // per_token)
    layout = kvtier.Layout.vllm_cpu(LAYERS, KV_HEADS, HEAD_DIM, block_tokens=tokens)
    if layout.slot_bytes > block_bytes:
        raise SystemExit(f"--block-bytes {block_bytes} is too small for one {per_token}-byte token")
    return layout


def _binary(arg: str | None) -> str:
    b = arg or os.environ.get("KVTIER_BIN") or shutil.which("kvtier")
    if not b:
        raise SystemExit("no kvtier binary: pass --kvtier PATH or set KVTIER_BIN")
    return b


class PythonSide:
    """The Python side's block set, saved once into a :class:`kvtier.Store`
    namespace and flushed to G3; each :meth:`round` empties G2, drops the
    page cache and loads every block into per-layer torch tensors."""

    def __init__(self, root: Path, layout: Layout, blocks: int) -> None:
        import torch

        import kvtier

        self.layout, self.blocks = layout, blocks
        self.store = kvtier.Store(str(root), g2_bytes=256 << 20, g3_bytes=(blocks + 8) * layout.slot_bytes)
        self.ns = self.store.namespace(layout, fingerprint="kvtier.bench restore")
        pages = min(blocks, 64)
        kv = [torch.randn(pages, layout.layer_bytes // 4) for _ in range(LAYERS)]
        self.keys = [i.to_bytes(8, "little") for i in range(blocks)]
        for start in range(0, blocks, pages):
            chunk = self.keys[start : start + pages]
            res = self.ns.save_pages(chunk, kv, range(len(chunk))).wait()
            assert res is not None
            assert all(r.ok for r in res), res
        self.ns.flush()
        self.dest = [torch.empty(blocks, layout.layer_bytes // 4) for _ in range(LAYERS)]
        for t in self.dest:
            t.fill_(0)  # touched once: the timed loads write resident memory
        self.files = [str(p) for p in root.rglob("*.kvt")]

    def round(self) -> float:
        """GB/s of one cold load of every block from G3."""
        self.ns.evict_memory()
        drop_page_cache(self.files)
        t = time.perf_counter()
        res = self.ns.load_pages(self.keys, self.dest, range(self.blocks)).wait()
        secs = time.perf_counter() - t
        assert res is not None
        bad = [r for r in res if r.tier != "g3"]
        if bad:
            raise RuntimeError(f"{len(bad)} blocks did not come from G3: {bad[:3]}")
        return float(self.blocks * self.layout.slot_bytes / secs / 1e9)


def rust_side(binary: str, root: Path, args: argparse.Namespace, block_bytes: int) -> dict[str, Any]:
    cmd = [
        binary,
        "store",
        "bench",
        "--dir",
        str(root),
        "--total-bytes",
        str(args.total_bytes),
        "--block-bytes",
        str(block_bytes),
        "--in-flight",
        str(args.in_flight),
        "--repeat",
        "1",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-2000:]}")
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def run(args: argparse.Namespace) -> int:
    binary = _binary(args.kvtier)
    layout = _layout(args.block_bytes)
    slot = layout.slot_bytes
    blocks = max(1, args.total_bytes // slot)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvtier-bench-restore-"))
    made = args.dir is None
    py_root = base / f"python-{os.getpid()}"
    py_samples: list[float] = []
    rust_samples: list[float] = []
    limits: list[float] = []
    rust: dict[str, Any] = {}
    try:
        py = PythonSide(py_root, layout, blocks)
        # Interleaved, A B A B: the device's speed drifts on a shared VM.
        for r in range(max(1, args.repeat)):
            py_samples.append(py.round())
            rust = rust_side(binary, base, args, slot)
            case = max(rust["cases"], key=lambda c: c["in_flight"])
            rust_samples.extend(case["samples_gbps"])
            limits.append(rust["device_limit_gbps"])
            if not args.json:
                print(
                    f"round {r + 1}: python {py_samples[-1]:.2f} GB/s, rust {rust_samples[-1]:.2f} GB/s",
                    file=sys.stderr,
                )
        del py
    finally:
        shutil.rmtree(py_root, ignore_errors=True)
        if made:
            shutil.rmtree(base, ignore_errors=True)
    python_gbps, rust_gbps = median(py_samples), median(rust_samples)
    report = {
        "python_gbps": python_gbps,
        "rust_gbps": rust_gbps,
        "ratio": python_gbps / rust_gbps if rust_gbps else 0.0,
        # Median of each round's python / rust (neighbours in time).
        "paired_ratio": median([p / r for p, r in zip(py_samples, rust_samples, strict=True) if r > 0]),
        "python_samples_gbps": py_samples,
        "rust_samples_gbps": rust_samples,
        "device_limit_gbps": median(limits),
        "slot_bytes": slot,
        "blocks": blocks,
        "rust_blocks": rust["blocks"],
        "in_flight": args.in_flight,
        "layout": repr(layout),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{blocks} blocks of {slot} bytes; device read limit {rust['device_limit_gbps']:.2f} GB/s")
    print(f"python (kvtier.Namespace.load_pages)  {report['python_gbps']:6.2f} GB/s")
    print(f"rust (kvtier store bench)             {report['rust_gbps']:6.2f} GB/s")
    print(f"python / rust                         {report['ratio']:6.2f} (paired rounds: {report['paired_ratio']:.2f})")
    return 0
