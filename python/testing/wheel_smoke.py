"""What a user does first with an installed kvtier wheel, run by
scripts/wheel-check in a clean venv (numpy and safetensors only, no Rust
toolchain on PATH): a store round trip through G2 and G3, a safetensors load
and a checkpoint save and load. Each step asserts the bytes it got back."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import kvtier


def store_round_trip(root: Path) -> None:
    """Blocks saved, pushed out of memory, and read back from disk."""
    layout = kvtier.Layout(2, 2, 16, 8, dtype="f32")
    store = kvtier.Store(str(root / "cache"), g2_bytes=8 << 20, g3_bytes=8 << 20)
    ns = store.namespace(layout, fingerprint="smoke")
    rng = np.random.default_rng(7)
    blocks = 4
    src = [rng.integers(0, 256, (blocks, layout.layer_bytes), dtype=np.uint8) for _ in range(2)]
    half = layout.layer_bytes // 2

    def regions(layers: list[np.ndarray], b: int) -> list[np.ndarray]:
        return [t[b, p * half : (p + 1) * half] for p in (0, 1) for t in layers]

    keys = [i.to_bytes(8, "little") for i in range(blocks)]
    saved = ns.save(keys, [regions(src, b) for b in range(blocks)]).wait()
    assert [r.status for r in saved] == ["stored"] * blocks, saved
    ns.evict_memory()
    dst = [np.zeros_like(t) for t in src]
    got = ns.load(keys, [regions(dst, b) for b in range(blocks)]).wait()
    assert all(r == "hit" and r.tier == "g3" for r in got), got
    for a, b in zip(src, dst, strict=True):
        np.testing.assert_array_equal(a, b)


def load_weights(root: Path) -> None:
    """A safetensors file written by the safetensors package, loaded by kvtier."""
    tensors = {
        "w": np.arange(4096, dtype=np.float32).reshape(64, 64),
        "b": np.arange(7, dtype=np.int64),
    }
    path = root / "model.safetensors"
    save_file(tensors, str(path))
    got = kvtier.load_safetensors(path)
    assert sorted(got) == ["b", "w"], sorted(got)
    for name, want in tensors.items():
        np.testing.assert_array_equal(got[name], want)


def checkpoint(root: Path) -> None:
    """A checkpoint saved and loaded back, every tensor equal."""
    tensors = {"layer.0": np.linspace(0, 1, 1000, dtype=np.float32), "step": np.array([3], dtype=np.int64)}
    kvtier.save_checkpoint(tensors, root / "ckpt")
    got = kvtier.load_checkpoint(root / "ckpt")
    for name, want in tensors.items():
        np.testing.assert_array_equal(np.asarray(got[name]), want)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store_round_trip(root)
        load_weights(root)
        checkpoint(root)
    print(f"kvtier {kvtier.__version__} wheel: store, load and checkpoint ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
