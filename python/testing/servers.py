"""Helpers of the end-to-end checks that start real servers (vLLM,
LMCache, SGLang): wait until one answers, and take files off the page
cache so a benchmark reads the disk."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


def wait_until_up(proc: subprocess.Popen[bytes], url: str, timeout: float, what: str, tail: Callable[[], str]) -> bool:
    """Polls ``url`` until it answers 200 (``True``), at most ``timeout``
    seconds (``False``: the caller stops the server and fails). A server
    that exits while starting is a ``RuntimeError`` with ``tail()``, its
    log's end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting:\n{tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def drop_page_cache(root: Path) -> None:
    """Writes back and drops from the page cache every regular file under
    ``root``, so the next reads of them come from the disk."""
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
