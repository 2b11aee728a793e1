"""What the benchmarks need of the host: a cold page cache, contenders
installed on demand, medians."""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
from collections.abc import Iterable


def drop_page_cache(files: Iterable[str]) -> bool:
    """Evicts ``files`` from the page cache (``POSIX_FADV_DONTNEED``, after
    a sync) and, as root, the whole cache; True when the whole cache was
    dropped."""
    os.sync()
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as drop:
            drop.write("3\n")
        return True
    except OSError:
        return False


def ensure_installed(module: str, requirement: str) -> None:
    """Installs ``requirement`` with pip unless ``module`` imports."""
    if importlib.util.find_spec(module) is not None:
        return
    print(f"installing {requirement} for the bench", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", requirement],
        check=True,
    )


def median(xs: list[float]) -> float:
    """The median of ``xs`` (0.0 when empty)."""
    return statistics.median(xs) if xs else 0.0
