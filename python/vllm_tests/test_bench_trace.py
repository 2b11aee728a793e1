"""scripts/bench-trace's supervisor: the restart the replay's
``--restart-cmd`` runs stops a server's whole process group and starts the
same command again."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trace import _group_alive, restart, stop, supervise

# A "server" that starts a child of its own (as vLLM starts its engine core)
# and records both pids.
SERVER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()} {child.pid}\\n")
time.sleep(600)
"""

# One that ignores SIGTERM.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_lines(path: Path, n: int) -> list[list[int]]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.exists():
            lines = [[int(x) for x in line.split()] for line in path.read_text().splitlines()]
            if len(lines) >= n:
                return lines
        time.sleep(0.05)
    raise AssertionError(f"{path} has fewer than {n} lines")


def test_restart_stops_the_whole_group_and_starts_the_same_command(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    state = tmp_path / "server"
    supervise(state, [sys.executable, "-c", SERVER, str(pids)], dict(os.environ), tmp_path / "log")
    (first, first_child) = _wait_lines(pids, 1)[0]
    assert int((state / "pid").read_text()) == first
    restart(state)
    (second, second_child) = _wait_lines(pids, 2)[1]
    assert second != first
    assert int((state / "pid").read_text()) == second
    assert not _alive(first), "the old server is gone"
    assert not _alive(first_child), "the old server's child is gone"
    assert _alive(second)
    assert _alive(second_child)
    stop(state)
    assert not _group_alive(second)
    assert not _alive(second_child)


def test_a_server_deaf_to_sigterm_is_killed_past_the_timeout(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    state = tmp_path / "server"
    supervise(state, [sys.executable, "-c", STUBBORN, str(pids)], dict(os.environ), tmp_path / "log")
    (pid,) = _wait_lines(pids, 1)[0]
    t0 = time.monotonic()
    stop(state, timeout=1)
    assert not _alive(pid)
    assert time.monotonic() - t0 >= 1, "it waited for SIGTERM first"


def test_stopping_a_server_already_gone_is_quiet(tmp_path: Path) -> None:
    state = tmp_path / "server"
    supervise(state, [sys.executable, "-c", "pass"], dict(os.environ), tmp_path / "log")
    time.sleep(0.5)
    stop(state)
    with pytest.raises(FileNotFoundError):
        stop(tmp_path / "never-started")
