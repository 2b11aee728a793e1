"""KV restore into accelerator memory: kvtier's store (G3, staged through
pinned host memory by :class:`kvtier.staging.PageStaging`) beside the way
vLLM's ExampleConnector restores (one safetensors file per layer,
``safetensors.torch.load_file(device=...)``), on the same pages, in one run.

A KV cache of ``--layers`` per-layer tensors in vLLM's GPU form (``[blocks,
kv_heads, block_size, 2 * head_size]``, K and V side by side per token,
bf16) is filled with random values on ``--device``; ``--total-bytes`` of its
blocks are saved both ways. Then ``--repeat`` interleaved rounds, each side
with an empty G2 and a dropped page cache, restore every block into another
cache's blocks on the device (kvtier: in chunks of 64 blocks, each copied to
the device as soon as it is read, while the later ones are still being read)
and check them against the source (``torch.equal``:
a restore that is fast but wrong fails the bench). The host-to-device copy
limit (pinned memory) is measured between them. GB/s is bytes of KV restored
over the time until the device holds it (10^9 bytes per second).

JSON (``--json``): ``{"kvtier_gbps": f64, "safetensors_gbps": f64,
"h2d_gbps": f64, "ratio": f64, "identical": bool}`` plus the samples, the
device and the shape. Runs on the CPU too (``--device cpu``), where the
"device" is host memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ._host import drop_page_cache, median

if TYPE_CHECKING:
    import torch

#: Blocks per load of the kvtier side (a pinned buffer each).
CHUNK_BLOCKS = 64


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default=None, help="torch device of the KV cache (default: cuda if torch sees one)")
    ap.add_argument("--dir", default=None, help="where to put the files (default: a temporary directory)")
    ap.add_argument("--total-bytes", type=int, default=1 << 30, help="bytes of KV restored per round (default 1 GiB)")
    ap.add_argument("--layers", type=int, default=32, help="layers (default 32, as Llama 3 8B)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    ap.add_argument("--head-size", type=int, default=128, help="head size (default 128)")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16, vLLM's GPU default)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the median is reported (default 3)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    """Both sides' saved pages and the caches they restore into."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        import torch

        import kvtier
        from kvtier.staging import KV_PER_TOKEN, PageStaging

        self.torch = torch
        name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(name)
        self.layout = kvtier.Layout.vllm_cpu(
            args.layers, args.kv_heads, args.head_size, block_tokens=args.block_tokens, dtype="bf16"
        )
        self.blocks: int = max(1, args.total_bytes // (self.layout.layer_bytes * args.layers))
        self.bytes: int = self.blocks * self.layout.layer_bytes * args.layers
        shape = (self.blocks, args.kv_heads, args.block_tokens, 2 * args.head_size)
        g = torch.Generator(device=self.device).manual_seed(1)
        self.src = [torch.randn(shape, generator=g, device=self.device).to(torch.bfloat16) for _ in range(args.layers)]
        self.dst = [torch.zeros_like(t) for t in self.src]
        # The restored blocks land elsewhere than they were saved from.
        self.order = list(range(self.blocks))[::-1]
        self.ids = torch.tensor(self.order, device=self.device)

        # kvtier: pages gathered to the canonical form, saved, flushed to G3.
        self.store = kvtier.Store(
            str(root / "kvtier"), g2_bytes=256 << 20, g3_bytes=(self.blocks + 8) * self.layout.slot_bytes
        )
        self.ns = self.store.namespace(self.layout, fingerprint="kvtier.bench gpu-restore")
        self.keys = [i.to_bytes(8, "little") for i in range(self.blocks)]
        self.staging = PageStaging(self.src, KV_PER_TOKEN)
        self.back = PageStaging(self.dst, KV_PER_TOKEN)
        for start in range(0, self.blocks, CHUNK_BLOCKS):
            ids = list(range(start, min(start + CHUNK_BLOCKS, self.blocks)))
            host = self.staging.gather(ids)
            res = self.ns.save(self.keys[start : start + len(ids)], PageStaging.pieces(host)).wait()
            assert res is not None
            assert all(r.ok for r in res), res
        self.ns.flush()

        # The ExampleConnector's way: a safetensors file per layer.
        from safetensors.torch import save_file

        self.st_dir = root / "safetensors"
        self.st_dir.mkdir()
        for li, t in enumerate(self.src):
            save_file({"kv": t.cpu()}, str(self.st_dir / f"layer{li}.safetensors"))
        self.files = [str(p) for p in root.rglob("*") if p.is_file()]

    def check(self) -> bool:
        """Every restored block equals its source block; then the cache is
        cleared for the next round."""
        pairs = zip(self.dst, self.src, strict=True)
        ok = all(bool(self.torch.equal(d.index_select(0, self.ids), s)) for d, s in pairs)
        for d in self.dst:
            d.zero_()
        _sync(self.device)
        return ok

    def kvtier_round(self) -> tuple[float, bool]:
        """One cold restore as a connector would run it: every chunk's load
        submitted at once (all reads in flight), then each chunk copied to
        the device as soon as its own load is done, while later chunks are
        still being read."""
        self.ns.evict_memory()
        drop_page_cache(self.files)
        t = time.perf_counter()
        chunks = []
        for start in range(0, self.blocks, CHUNK_BLOCKS):
            n = min(CHUNK_BLOCKS, self.blocks - start)
            host = self.back.buffer(n)
            chunks.append((start, host, self.ns.load(self.keys[start : start + n], self.back.pieces(host))))
        results = []
        for start, host, transfer in chunks:
            res = transfer.wait()
            assert res is not None
            results += res
            self.back.scatter(host, self.order[start : start + host.shape[1]])
        _sync(self.device)
        secs = time.perf_counter() - t
        if any(r.tier != "g3" for r in results):
            raise RuntimeError(f"blocks not restored from G3: {[r for r in results if r.tier != 'g3'][:3]}")
        return self.bytes / secs / 1e9, self.check()

    def safetensors_round(self) -> tuple[float, bool]:
        from safetensors.torch import load_file

        drop_page_cache(self.files)
        t = time.perf_counter()
        for li, d in enumerate(self.dst):
            kv = load_file(str(self.st_dir / f"layer{li}.safetensors"), device=str(self.device))["kv"]
            d.index_copy_(0, self.ids, kv)
        _sync(self.device)
        secs = time.perf_counter() - t
        return self.bytes / secs / 1e9, self.check()

    def h2d_round(self) -> float:
        """GB/s of one pinned host-to-device copy of the restored bytes
        (on the CPU: one host memory copy)."""
        torch = self.torch
        host = torch.empty(self.bytes // 2, dtype=torch.bfloat16, pin_memory=self.device.type == "cuda")
        host.fill_(1)
        dev = torch.empty_like(host, device=self.device)
        _sync(self.device)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        _sync(self.device)
        return self.bytes / (time.perf_counter() - t) / 1e9


def run(args: argparse.Namespace) -> int:
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvtier-bench-gpu-restore-"))
    made = args.dir is None
    root = base / "gpu-restore"
    samples: dict[str, list[float]] = {"kvtier": [], "safetensors": [], "h2d": []}
    identical = True
    try:
        root.mkdir(parents=True, exist_ok=False)
        b = Bench(root, args)
        # Interleaved, A B A B: drift in the disk's speed hits both alike.
        for r in range(max(1, args.repeat)):
            gbps, ok = b.kvtier_round()
            samples["kvtier"].append(gbps)
            identical &= ok
            samples["h2d"].append(b.h2d_round())
            gbps, ok = b.safetensors_round()
            samples["safetensors"].append(gbps)
            identical &= ok
            if not args.json:
                print(
                    f"round {r + 1}: kvtier {samples['kvtier'][-1]:.2f} GB/s, safetensors "
                    f"{samples['safetensors'][-1]:.2f} GB/s, h2d {samples['h2d'][-1]:.2f} GB/s",
                    file=sys.stderr,
                )
        device, blocks, total, layout = str(b.device), b.blocks, b.bytes, repr(b.layout)
        del b
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if made:
            shutil.rmtree(base, ignore_errors=True)
    kv, st = median(samples["kvtier"]), median(samples["safetensors"])
    report = {
        "kvtier_gbps": kv,
        "safetensors_gbps": st,
        "h2d_gbps": median(samples["h2d"]),
        "ratio": kv / st if st else 0.0,
        "identical": identical,
        "samples_gbps": samples,
        "device": device,
        "blocks": blocks,
        "bytes": total,
        "layout": layout,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{blocks} blocks, {total / 1e9:.2f} GB of bf16 KV restored into {device} per round")
        print(f"kvtier (G3, staged)                 {kv:6.2f} GB/s")
        print(f"safetensors per layer (Example)     {st:6.2f} GB/s")
        print(f"host-to-device copy limit           {report['h2d_gbps']:6.2f} GB/s")
        print(f"kvtier / safetensors                {report['ratio']:6.2f}   identical: {identical}")
    return 0 if identical else 1
