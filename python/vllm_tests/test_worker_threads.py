"""Where the connector's threads may run (kvtier.vllm.threads.all_cpus), on a real
store without a vLLM process: a thread inherits its creator's CPU affinity,
and vLLM's CPU worker pins its thread to its compute cores."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvtier import Layout, Store
from kvtier.vllm.threads import all_cpus
from vllm_server import thread_cpus

LAYOUT = Layout.vllm_cpu(2, 2, 64)


def _open_pinned(root: Path, unpinned: bool) -> dict[str, Any]:
    """On a thread pinned to one CPU (as vLLM's worker thread), opens a
    store and a namespace, with or without ``all_cpus``; returns the new
    kvtier threads' CPUs and the opener's CPUs afterwards."""
    every = os.sched_getaffinity(0)
    out: dict[str, Any] = {}

    def opener() -> None:
        os.sched_setaffinity(0, {min(every)})
        before = set(thread_cpus([os.getpid()], "kvtier-"))
        with all_cpus() if unpinned else contextlib.nullcontext():
            store = Store(str(root), g2_bytes=16 << 20, g3_bytes=16 << 20)
            out["ns"] = store.namespace(LAYOUT, fingerprint="threads")
        out["opener"] = os.sched_getaffinity(0)
        # A thread names itself once it runs: wait for the readers' names.
        deadline = time.monotonic() + 30
        while not set(thread_cpus([os.getpid()], "kvtier-read")) - before and time.monotonic() < deadline:
            time.sleep(0.01)
        now = thread_cpus([os.getpid()], "kvtier-")
        out["threads"] = {tid: cpus for tid, cpus in now.items() if tid not in before}

    t = threading.Thread(target=opener)
    t.start()
    t.join()
    return out


def test_store_threads_started_under_all_cpus_may_run_on_every_cpu(tmp_path: Path) -> None:
    every = os.sched_getaffinity(0)
    assert len(every) >= 2, "needs two CPUs to tell pinned from not"
    one = {min(every)}

    # The premise: opened from a pinned thread, the store's threads are
    # pinned to its CPU too.
    pinned = _open_pinned(tmp_path / "pinned", unpinned=False)
    assert pinned["threads"], "the store started no kvtier threads"
    assert all(cpus == one for cpus in pinned["threads"].values()), pinned["threads"]

    # Under all_cpus they may run anywhere, and the opener is pinned back.
    free = _open_pinned(tmp_path / "free", unpinned=True)
    assert free["threads"], "the store started no kvtier threads"
    assert all(cpus == every for cpus in free["threads"].values()), free["threads"]
    assert free["opener"] == one


def test_a_process_started_on_fewer_cpus_keeps_its_threads_on_them(tmp_path: Path) -> None:
    # As under `taskset -c 0 vllm ...`: a process whose parent runs on one
    # CPU does not widen its threads past it.
    every = os.sched_getaffinity(0)
    assert len(every) >= 2, "needs two CPUs to tell pinned from not"
    one = {min(every)}
    script = (
        "import json, sys; from pathlib import Path; "
        f"sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'testing')!r}); "
        "from test_worker_threads import _open_pinned; "
        "got = _open_pinned(Path(sys.argv[1]), unpinned=True); "
        "print(json.dumps({str(t): sorted(c) for t, c in got['threads'].items()}))"
    )
    os.sched_setaffinity(0, one)
    try:
        run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=600)
    finally:
        os.sched_setaffinity(0, every)
    assert run.returncode == 0, run.stderr[-3000:]
    threads = json.loads(run.stdout.strip().splitlines()[-1])
    assert threads, "the store started no kvtier threads"
    assert all(set(cpus) == one for cpus in threads.values()), threads
