"""The lookup socket between the scheduler and rank 0's worker.

vLLM runs the scheduler in another process than the workers, and only the
workers open the store (a store directory has one owner), so the scheduler
asks rank 0's worker how much of a prompt kvtier holds. A question is whole
blocks of tokens and a key salt; the answer is how many leading blocks the
store holds, in any tier. The scheduler looks up rank 0's shard only: a
rank that lacks a block reports it as a load error, and vLLM recomputes it.

The socket is a Linux abstract socket (no file to clean up) named after the
engine id the scheduler and the workers share, with an auth key from the
same id. Every failure on either side counts as a miss: a lookup never
stalls a request or serves anything, it only decides whether to restore.

This module needs no vLLM: it reads the config it is given by attribute."""

from __future__ import annotations

import array
import contextlib
import hashlib
import logging
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING

from ..store import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM's logger of this name (vLLM's init_logger gives the same one), whose
# output goes through the handlers vLLM configures on "vllm".
logger = logging.getLogger("vllm.kvtier")

#: How long the scheduler waits for the worker's socket at its first lookup.
CONNECT_TIMEOUT_S = 60.0


def lookup_address(vllm_config: VllmConfig) -> tuple[str, bytes]:
    """The lookup socket of one vLLM engine and its auth key, both from the
    engine id the scheduler and the workers share."""
    ktc = vllm_config.kv_transfer_config
    engine = str(getattr(ktc, "engine_id", "") or "")
    digest = hashlib.sha256(f"kvtier.vllm.lookup:{engine}".encode()).hexdigest()
    return f"\0kvtier-vllm-{digest[:24]}", digest.encode()


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


class LookupServer:
    """Rank 0's worker side: answers lookups against ``ns`` on a thread per
    connection, until :meth:`close`."""

    def __init__(self, address: str, authkey: bytes, ns: Namespace) -> None:
        self._ns = ns
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
                    hit = self._ns.lookup(self._ns.token_keys(tokens, salt=salt))
                except Exception as e:  # noqa: BLE001 - a failed lookup is a miss, logged
                    logger.warning("kvtier: lookup failed (counted as a miss): %s", e)
                    hit = 0
                conn.send_bytes(hit.to_bytes(8, "little"))

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

    def lookup(self, tokens: list[int], salt: bytes) -> int:
        """How many leading blocks of ``tokens`` (whole blocks) the store
        holds; 0 on any error (one reconnection is tried first)."""
        with self._lock:
            for attempt in range(2):
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                    self._conn.send_bytes(encode_lookup(tokens, salt))
                    return int.from_bytes(self._conn.recv_bytes(), "little")
                except (OSError, EOFError) as e:
                    self._conn = None
                    if attempt == 1:
                        logger.warning("kvtier: lookup failed (a miss): %s", e)
            return 0

    def _connect(self) -> Connection:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                return Client(self._address, family="AF_UNIX", authkey=self._key)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
