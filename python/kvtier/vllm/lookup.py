"""The lookup sockets between the scheduler and the workers.

vLLM runs the scheduler in another process than the workers, and only the
workers open the store (a store directory has one owner), so the scheduler
asks the workers how much of a prompt kvtier holds. Every tensor-parallel
rank answers for the KV heads it holds, so the answer covers the whole
model: a block counts only if every rank holds all its heads. A question is
whole blocks of tokens and a key salt; the answer is, per KV cache group
and block, whether the rank holds it in any tier (a sliding-window
group needs only the blocks in its window, so a leading count is not
enough; :func:`~kvtier.vllm.groups.hit_end` turns the answers into a hit).

The sockets are Linux abstract sockets (no file to clean up) named after
the engine id the scheduler and the workers share and the rank, with an
auth key from the same id. Every failure on either side counts as a miss: a
lookup never stalls a request or serves anything, it only decides whether
to restore.

This module needs no vLLM: it reads the config it is given by attribute."""

from __future__ import annotations

import array
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING

from ..store import Namespace
from .groups import KvGroup

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM's logger of this name (vLLM's init_logger gives the same one), whose
# output goes through the handlers vLLM configures on "vllm".
logger = logging.getLogger("vllm.kvtier")

#: How long the scheduler waits for the worker's socket at its first lookup.
CONNECT_TIMEOUT_S = 60.0


def lookup_address(vllm_config: VllmConfig, rank: int = 0) -> tuple[str, bytes]:
    """The lookup socket of one rank of one vLLM engine and its auth key,
    both from the engine id the scheduler and the workers share."""
    ktc = vllm_config.kv_transfer_config
    engine = str(getattr(ktc, "engine_id", "") or "")
    digest = hashlib.sha256(f"kvtier.vllm.lookup:{engine}".encode()).hexdigest()
    return f"\0kvtier-vllm-{digest[:24]}-{rank}", digest.encode()


def encode_lookup(tokens: list[int], salt: bytes) -> bytes:
    """A question: the salt's length (4 bytes, little-endian), the salt,
    then the tokens as native unsigned 32-bit integers."""
    return len(salt).to_bytes(4, "little") + salt + array.array("I", tokens).tobytes()


def decode_lookup(msg: bytes) -> tuple[list[int], bytes]:
    """The tokens and salt of :func:`encode_lookup`'s message."""
    n = int.from_bytes(msg[:4], "little")
    salt = msg[4 : 4 + n]
    tokens = array.array("I")
    tokens.frombytes(msg[4 + n :])
    return tokens.tolist(), salt


def presence(group: KvGroup, spaces: Sequence[Namespace], tokens: list[int], salt: bytes) -> bytes:
    """Per whole block of ``tokens``, 1 if every namespace in ``spaces``
    (the heads of ``group`` a rank holds) holds it, else 0. A full group
    needs every block from the start, so it stops at the first miss; a
    sliding-window group is asked block by block."""
    flags = bytearray(b"\1" * (len(tokens) // group.block_size))
    for ns in spaces:
        keys = ns.token_keys(tokens, salt=salt)
        if group.window_blocks is None:
            held = ns.lookup(keys)
            flags[held:] = bytes(len(flags) - held)
            continue
        for i, key in enumerate(keys):
            if flags[i] and ns.lookup([key]) == 0:
                flags[i] = 0
    return bytes(flags)


class LookupServer:
    """One rank's worker side: answers lookups against ``spaces`` (per KV
    cache group, the namespaces of the heads the rank holds) on a thread per
    connection, until :meth:`close`."""

    def __init__(self, address: str, authkey: bytes, spaces: Sequence[tuple[KvGroup, Sequence[Namespace]]]) -> None:
        self._spaces = list(spaces)
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self._thread = threading.Thread(target=self._accept, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            except Exception as e:  # noqa: BLE001 - a client with a wrong key: refuse it, keep serving
                logger.warning("kvtier: lookup connection refused: %s", e)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    tokens, salt = decode_lookup(msg)
                    answer = b"".join(presence(g, spaces, tokens, salt) for g, spaces in self._spaces)
                except Exception as e:  # noqa: BLE001 - a failed lookup is a miss, logged
                    logger.warning("kvtier: lookup failed (counted as a miss): %s", e)
                    answer = b""
                conn.send_bytes(answer)

    def close(self) -> None:
        """Stops accepting connections."""
        self._listener.close()


class LookupClient:
    """The scheduler's side of :class:`LookupServer`: connects on first
    use, waits for the worker for up to :data:`CONNECT_TIMEOUT_S`, and
    counts every error as a miss (recompute, never a stall)."""

    def __init__(self, address: str, authkey: bytes) -> None:
        self._address = address
        self._key = authkey
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def connect_now(self) -> None:
        """Connects at once if the worker listens (the scheduler is built
        after the workers registered their caches), so that the first
        request does not pay for the connection; a worker not yet there is
        connected to at the first lookup instead."""
        with self._lock:
            if self._conn is None:
                with contextlib.suppress(OSError, EOFError):
                    self._conn = Client(self._address, family="AF_UNIX", authkey=self._key)

    def lookup(self, tokens: list[int], salt: bytes) -> bytes:
        """The rank's answer for ``tokens`` (whole blocks): per KV cache
        group in order, one byte per block, 1 where the rank holds it (see
        :func:`presence`); empty on any error (one reconnection is tried
        first), which the caller counts as a miss."""
        with self._lock:
            for attempt in range(2):
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                    self._conn.send_bytes(encode_lookup(tokens, salt))
                    return self._conn.recv_bytes()
                except (OSError, EOFError) as e:
                    self._conn = None
                    if attempt == 1:
                        logger.warning("kvtier: lookup failed (a miss): %s", e)
            return b""

    def _connect(self) -> Connection:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                return Client(self._address, family="AF_UNIX", authkey=self._key)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
