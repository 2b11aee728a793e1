"""Shared fixtures of the vLLM end-to-end checks: ``record`` collects
figures; with ``KVTIER_E2E_JSON=PATH`` they are written there as JSON with
each test's outcome (scripts/vllm-e2e --json)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# make_model.py, shared with the engine's reference checks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))

_FIGURES: dict[str, Any] = {}
_OUTCOMES: dict[str, str] = {}


@pytest.fixture(scope="session")
def record() -> dict[str, Any]:
    """Figures to report (name -> value)."""
    return _FIGURES


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        name = report.nodeid.split("::")[-1]
        if report.outcome != "passed" or name not in _OUTCOMES:
            _OUTCOMES[name] = report.outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("KVTIER_E2E_JSON")
    if path:
        out = {"checks": _OUTCOMES, "passed": exitstatus == 0, "figures": _FIGURES}
        Path(path).write_text(json.dumps(out, indent=2, sort_keys=True))
