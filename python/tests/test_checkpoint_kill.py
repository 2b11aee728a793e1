"""A checkpoint save killed with SIGKILL leaves the old checkpoint or the new
one loadable, never a mix: for real, with a child Python process killed at
several moments of its saves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier

# Tensors of every save; each save i fills every tensor with the value i,
# which is also the generation it commits (the first save is the parent's).
NAMES = [f"layer.{i}.weight" for i in range(6)]
ELEMS = 4 << 20  # 16 MiB of float32 per tensor: 96 MiB per save, 3 shards

CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import kvtier

    dir, names, elems = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    start = kvtier.load_checkpoint(dir)[names[0]].flat[0]
    value = int(start) + 1
    arrays = {n: np.full(elems, value, np.float32) for n in names}
    print("saving", flush=True)
    while True:
        kvtier.save_checkpoint(arrays, dir, shard_bytes=2 * elems * 4)
        value += 1
        for a in arrays.values():
            a.fill(value)
""")


def tensors_of(value: int) -> dict[str, np.ndarray]:
    return {n: np.full(ELEMS, value, np.float32) for n in NAMES}


def check_whole(dir: Path) -> int:
    """Loads the committed checkpoint and checks it is one whole save: every
    tensor present and filled with the generation's own value."""
    got = kvtier.load_checkpoint(dir)
    generation = json.loads((dir / "manifest.json").read_text())["generation"]
    assert list(got) == NAMES
    for name, arr in got.items():
        assert arr.shape == (ELEMS,)
        lo, hi = float(arr.min()), float(arr.max())
        assert lo == hi == generation, (name, lo, hi, generation)
    return generation


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.5, 1.0, 2.0])
def test_sigkill_mid_save_leaves_the_old_or_the_new_checkpoint(tmp_path, delay):
    dir = tmp_path / "ckpt"
    kvtier.save_checkpoint(tensors_of(1), dir, shard_bytes=2 * ELEMS * 4)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(dir), ",".join(NAMES), str(ELEMS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "saving", child.stderr.read() if child.stderr else line
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    generation = check_whole(dir)
    assert generation >= 1
    # The next save cleans up whatever the killed one left and commits.
    info = kvtier.save_checkpoint(tensors_of(generation + 1), dir, shard_bytes=2 * ELEMS * 4)
    assert info.generation == generation + 1
    assert check_whole(dir) == generation + 1
    left = sorted(p.name for p in dir.iterdir())
    assert left == sorted([Path(f).name for f in info.files] + ["manifest.json", ".kvtier-checkpoint.lock"])
