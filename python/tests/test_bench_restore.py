"""``python -m kvtier.bench restore`` end to end on a small block set: the
Python API and the Rust ``kvtier store bench`` read the same shape, the
JSON contract holds, and every Python block came from G3 (the bench
raises otherwise). The binary is ``$KVTIER_BIN`` (scripts/test sets it to
the build's ``kvtier``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_restore_bench_reports_both_sides_in_one_run(tmp_path: Path) -> None:
    binary = os.environ.get("KVTIER_BIN")
    assert binary, "set KVTIER_BIN to a built kvtier binary"
    assert Path(binary).is_file(), f"KVTIER_BIN={binary} is not a file"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.bench",
            "restore",
            "--total-bytes",
            str(32 << 20),
            "--block-bytes",
            str(1 << 20),
            "--repeat",
            "2",
            "--in-flight",
            "8",
            "--kvtier",
            binary,
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["python_gbps"] > 0, report
    assert report["rust_gbps"] > 0, report
    assert len(report["python_samples_gbps"]) == 2 == len(report["rust_samples_gbps"])
    assert report["ratio"] == report["python_gbps"] / report["rust_gbps"]
    assert report["blocks"] == (32 << 20) // report["slot_bytes"]
    assert report["slot_bytes"] <= 1 << 20
    # Only the bench's own directories were made, and removed.
    assert list(tmp_path.iterdir()) == []


def test_gpu_restore_bench_checks_every_block_both_ways(tmp_path: Path) -> None:
    """``python -m kvtier.bench gpu-restore`` on the CPU (the same code a
    GPU runs, the device being host memory): both sides restore every
    block, checked equal to its source, and the JSON contract holds."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.bench",
            "gpu-restore",
            "--device",
            "cpu",
            "--total-bytes",
            str(8 << 20),
            "--layers",
            "4",
            "--repeat",
            "2",
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["identical"] is True, report
    for key in ("kvtier_gbps", "safetensors_gbps", "h2d_gbps"):
        assert report[key] > 0, report
    assert report["ratio"] == report["kvtier_gbps"] / report["safetensors_gbps"]
    assert all(len(v) == 2 for v in report["samples_gbps"].values()), report
    # 4 layers of 8 heads x 16 tokens x 256 bf16 values: 64 KiB a page.
    assert report["blocks"] == (8 << 20) // (4 * 64 << 10)
    assert report["device"] == "cpu"
    assert list(tmp_path.iterdir()) == []
