"""Fixtures: generated models written by the reference safetensors package."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kvtier
from helpers import numpy_tensors, torch_tensors, write_sharded

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))


def pytest_report_header() -> list[str]:
    return [f"kvtier {kvtier.__version__} from {Path(kvtier.__file__).parent}"]


@pytest.fixture
def numpy_model(tmp_path: Path) -> tuple[Path, dict]:
    """A 3-shard model of numpy dtypes with its index, and its tensors."""
    tensors = numpy_tensors(seed=1, count=30)
    write_sharded(tmp_path / "np-model", tensors, shards=3)
    return tmp_path / "np-model", tensors


@pytest.fixture
def torch_model(tmp_path: Path) -> tuple[Path, dict]:
    """A 4-shard model of torch dtypes (f32, f16, bf16, i64, f8, ...) with
    its index, and its tensors."""
    tensors = torch_tensors(seed=2, count=45)
    # Larger than the loader's 8 MiB reads: its shard is read in several.
    tensors["lm_head.weight"] = torch.randn(1300, 4099, generator=torch.Generator().manual_seed(3))
    write_sharded(tmp_path / "pt-model", tensors, shards=4)
    return tmp_path / "pt-model", tensors


# Skipping is never a pass: a test that cannot run fails the suite.
from no_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401
