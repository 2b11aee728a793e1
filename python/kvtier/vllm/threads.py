"""Where the connector's threads run.

The store's threads (its readers, writers and io_uring rings), the flusher
and the lookup server are started from vLLM's worker thread, and a thread
inherits its creator's CPUs. vLLM's CPU worker pins its thread to the cores
it computes on (``VLLM_CPU_OMP_THREADS_BIND``), so those threads would share
the model's core and a restore would wait on the forward pass for CPU time.
:func:`all_cpus` lets them run wherever the kernel finds time, as another
process's threads would.

This module needs no vLLM."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

# vLLM's logger of this name (vLLM's init_logger gives the same one).
logger = logging.getLogger("vllm.kvtier")


@contextlib.contextmanager
def all_cpus() -> Iterator[None]:
    """Lets the calling thread run on every CPU the process was given while
    threads are started from it, then pins it back.

    "Given" is the parent's CPUs (vLLM's engine core, which vLLM does not
    pin) with this thread's own: a ``taskset`` or cpuset vLLM was started
    under still holds for kvtier's threads."""
    pinned = os.sched_getaffinity(0)
    given = set(pinned)
    try:
        given |= os.sched_getaffinity(os.getppid())
        os.sched_setaffinity(0, given)
    except OSError as e:
        logger.warning("kvtier: its threads stay on CPUs %s: %s", sorted(pinned), e)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
