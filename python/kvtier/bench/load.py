"""Cold load of a sharded safetensors model: kvtier beside safetensors,
Run:ai Model Streamer and fastsafetensors, interleaved in one run, with the
device's read limit measured between them.

Each load runs in a fresh Python process that imports its loader, then
waits while the parent drops the page cache, then loads every tensor as a
torch CPU tensor and touches one byte per 4 KiB of it (so lazy loaders pay
for the bytes too). Rounds rotate the order of the loaders. GB/s is bytes
of tensors over the load's own time (10^9 bytes per second).

JSON (``--json``): ``{"device_limit_gbps": f64, "loaders": [{"name": str,
"gbps": f64}]}`` plus the samples, the model's bytes and whether the page
cache was dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._host import drop_page_cache, ensure_installed, median

if TYPE_CHECKING:
    import torch

#: Loader name -> (module to import, pip requirement); kvtier is this package.
CONTENDERS: dict[str, tuple[str, str] | None] = {
    "kvtier": None,
    "safetensors": ("safetensors", "safetensors"),
    "runai-streamer": ("runai_model_streamer", "runai-model-streamer"),
    "fastsafetensors": ("fastsafetensors", "fastsafetensors"),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("dir", help="a model directory of .safetensors shards (with or without an index)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the median is reported (default 3)")
    ap.add_argument(
        "--only",
        default=",".join(CONTENDERS),
        help=f"loaders to run, comma-separated (default: {','.join(CONTENDERS)})",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")


def shard_files(d: Path) -> list[str]:
    files = sorted(str(p) for p in d.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no .safetensors files in {d}")
    return files


def _touch(t: torch.Tensor) -> int:
    flat = t.reshape(-1).view(dtype=__import__("torch").uint8)
    if flat.numel() == 0:
        return 0
    return int(flat[::4096].sum()) + int(flat[-1])


def _load(loader: str, files: list[str]) -> tuple[list[object], int, int]:
    """Loads every tensor of ``files``; returns (what keeps them alive, bytes, touched sum)."""
    keep: list[object] = []
    nbytes = acc = 0

    def take(t: torch.Tensor) -> None:
        nonlocal nbytes, acc
        nbytes += t.numel() * t.element_size()
        acc += _touch(t)
        keep.append(t)

    if loader == "kvtier":
        import kvtier

        d = Path(files[0]).parent
        for t in kvtier.load_safetensors(str(d) if len(files) > 1 else files[0], framework="pt").values():
            take(t)
    elif loader == "safetensors":
        from safetensors.torch import load_file

        for f in files:
            for t in load_file(f).values():
                take(t)
    elif loader == "runai-streamer":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as s:
            s.stream_files(files)
            for _, t in s.get_tensors():
                take(t.clone())
    elif loader == "fastsafetensors":
        import torch
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        fl = SafeTensorsFileLoader(SingleGroup(), torch.device("cpu"), nogds=True)
        fl.add_filenames({0: files})
        fb = fl.copy_files_to_device()
        for name in list(fb.key_to_rank_lidx.keys()):
            take(fb.get_tensor(name))
        keep.append(fb)
        keep.append(fl)
    else:
        raise ValueError(f"unknown loader {loader!r}")
    return keep, nbytes, acc


def child(loader: str, files: list[str]) -> int:
    """The child process: import, say ready, wait for a line, load, report."""
    try:
        import torch  # noqa: F401

        mod = CONTENDERS[loader]
        # Imports are not part of the load: kvtier's too.
        __import__(mod[0] if mod is not None else "kvtier")
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
        t = time.perf_counter()
        _keep, nbytes, _acc = _load(loader, files)
        secs = time.perf_counter() - t
        print(json.dumps({"loader": loader, "bytes": nbytes, "seconds": secs}), flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the bench
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 2


def _one(loader: str, files: list[str]) -> tuple[float, int, bool]:
    """One cold load in a fresh process: (GB/s, bytes, page cache dropped)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "kvtier.bench", "_child", loader, *files],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin is not None
    assert p.stdout is not None
    ready = json.loads(p.stdout.readline() or '{"error": "the loader process died"}')
    if "error" in ready:
        p.wait()
        raise RuntimeError(f"{loader}: {ready['error']}")
    dropped = drop_page_cache(files)
    p.stdin.write("go\n")
    p.stdin.flush()
    out = json.loads(p.stdout.readline() or '{"error": "the loader process died"}')
    p.wait()
    if "error" in out:
        raise RuntimeError(f"{loader}: {out['error']}")
    return out["bytes"] / out["seconds"] / 1e9, int(out["bytes"]), dropped


def run(args: argparse.Namespace) -> int:
    from .. import _kvtier

    files = shard_files(Path(args.dir))
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    for n in names:
        if n not in CONTENDERS:
            raise SystemExit(f"unknown loader {n!r} (known: {', '.join(CONTENDERS)})")
        req = CONTENDERS[n]
        if req is not None:
            ensure_installed(*req)
    total = sum(os.path.getsize(f) for f in files)
    samples: dict[str, list[float]] = {n: [] for n in names}
    limits: list[float] = []
    dropped_all = True
    loaded_bytes = 0
    for r in range(max(1, args.repeat)):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            drop_page_cache(files)
            gbps, _direct = _kvtier.device_read_gbps(files, total)
            limits.append(gbps)
            g, loaded_bytes, dropped = _one(n, files)
            dropped_all &= dropped
            samples[n].append(g)
            if not args.json:
                print(f"round {r + 1}: {n:16s} {g:6.2f} GB/s   (device limit {gbps:.2f})", file=sys.stderr)
    limit = median(limits)
    # The JSON report: values of several types.
    report: dict[str, Any] = {
        "device_limit_gbps": limit,
        "loaders": [
            {
                "name": n,
                "gbps": median(samples[n]),
                "fraction_of_limit": median(samples[n]) / limit if limit else 0.0,
                "samples_gbps": samples[n],
            }
            for n in names
        ],
        "device_limit_samples_gbps": limits,
        "model_bytes": total,
        "tensor_bytes": loaded_bytes,
        "files": len(files),
        "page_cache_dropped": dropped_all,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model: {len(files)} files, {total / 1e9:.2f} GB; device read limit {limit:.2f} GB/s (median)")
    print(f"{'loader':18s} {'GB/s':>6s} {'of limit':>9s}  samples")
    for row in report["loaders"]:
        s = " ".join(f"{x:.2f}" for x in row["samples_gbps"])
        print(f"{row['name']:18s} {row['gbps']:6.2f} {row['fraction_of_limit']:9.2f}  {s}")
    return 0
