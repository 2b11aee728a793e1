"""The engine's reference checks: make_model.py from python/testing, skips
counted as failures, the versions of the reference in the header."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Models are made here; transformers never needs the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))

from no_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401


def pytest_report_header() -> list[str]:
    import tokenizers
    import torch
    import transformers

    return [
        f"reference: transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
        f"torch {torch.__version__}"
    ]
