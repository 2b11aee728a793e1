"""Fixtures: generated models written by the reference safetensors package."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvtier
from helpers import numpy_tensors, torch_tensors, write_sharded


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
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, and skips are not allowed here: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped at collection, and skips are not allowed here: {report.longrepr}"
