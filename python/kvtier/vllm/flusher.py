"""Saves made durable: the flusher.

A save copies a step's computed blocks into the store's G2, where a block
stays until it is evicted or written on; a restart or a kill moments later
would lose it there. :class:`Flusher` writes G2 on to G3 as soon as each
save's copy is done. It does not wait for vLLM: vLLM runs no step once its
last request is done (a save of that request is then never reported), and by
default it kills its engine at once on SIGTERM (``--shutdown-timeout 0``),
before the connector's ``shutdown`` can flush. The store's own periodic sync
(``g3_sync_ms``, 1 s) is the backstop; a stop within that second of a save
loses it, and a save still being copied when the engine is killed is lost
too (recomputed next time), never served torn.

This module needs no vLLM."""

from __future__ import annotations

import logging
import queue
import threading

from ..store import Namespace, Transfer

# vLLM's logger of this name (vLLM's init_logger gives the same one).
logger = logging.getLogger("vllm.kvtier")


class Flusher:
    """A thread that waits for each save's copy into the store, then writes
    the namespace's G2 to G3. One flush covers every save into that
    namespace queued before it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Namespace, Transfer] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtier-flush", daemon=True)
        self._thread.start()

    def add(self, ns: Namespace, save: Transfer) -> None:
        """Flushes ``ns`` once ``save`` (a save into it) is done."""
        self._queue.put((ns, save))

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get())
            stop = any(item is None for item in batch)
            # wait() releases the GIL, and may be called again by the worker.
            stored = {
                id(ns): ns
                for ns, t in (item for item in batch if item is not None)
                if any(r.status == "stored" for r in t.wait() or [])
            }
            for ns in stored.values():
                try:
                    ns.flush()  # releases the GIL while it writes
                except Exception as e:  # noqa: BLE001 - a failed flush leaves blocks in G2, logged
                    logger.warning("kvtier: flush of %s to G3 failed: %s", ns.name, e)

    def stop(self, timeout: float = 60) -> None:
        """Flushes every save queued so far, then ends the thread."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)
