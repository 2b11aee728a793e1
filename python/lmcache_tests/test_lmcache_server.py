"""kvtier as the L2 of a real LMCache 0.5.6 multiprocess server, driven by
LMCache's own engine-side benchmark client (``lmcache bench server --mode
cpu``'s ``ServerBenchClient``: KV tensors on the CPU, moved over shared
memory, checksummed per chunk).

One server after another on one kvtier cache directory:

1. objects stored go through LMCache's L1 to kvtier; after ``POST
   /cache/clear`` (L1 empty) every lookup is a full hit, loaded from kvtier,
   and the loaded KV's checksums are the stored KV's;
2. a new server on the same directory (its L1 empty): the same lookups still
   hit, with the same checksums;
3. blocks corrupted on disk, then a new server: those chunks are misses (a
   shorter prefix), and what is loaded still has the stored checksums.

Every process listens on 127.0.0.1 only; LMCache's usage report is off.
Run by scripts/lmcache-e2e in the venv of scripts/lmcache-env.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.command import add_server_arguments
from lmcache.cli.commands.bench.server_bench.config import parse_args_to_config
from servers import wait_until_up

from kvtier import Layout
from kvtier.lmcache import _NAME

SEQUENCES = range(4)
NUM_TOKENS = 256
CHUNK = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["LMCACHE_TRACK_USAGE"] = "false"
    env["DO_NOT_TRACK"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def kvtier_adapter(cache_dir: Path, g2_bytes: int = 64 << 20, g3_bytes: int = 256 << 20) -> dict[str, Any]:
    """The ``--l2-adapter`` spec of kvtier's adapter on ``cache_dir``."""
    return {
        "type": "native_plugin",
        "module_path": "kvtier.lmcache",
        "class_name": "KvtierL2Adapter",
        "adapter_params": {
            "cache_dir": str(cache_dir),
            "g2_bytes": g2_bytes,
            "g3_bytes": g3_bytes,
            "g3_sync_ms": 200,
        },
    }


class Server:
    """One ``lmcache server`` with kvtier as its L2 (or ``adapter``, an
    ``--l2-adapter`` spec), L1 of ``l1_gb``, clients of ``num_tokens``."""

    def __init__(
        self,
        cache_dir: Path,
        log: Path,
        adapter: dict[str, Any] | None = None,
        l1_gb: float = 0.5,
        num_tokens: int = NUM_TOKENS,
    ) -> None:
        self.port = _free_port()
        self.http = _free_port()
        self.shm = f"kvtier-lmc-{os.getpid()}-{self.port}"
        self.num_tokens = num_tokens
        if adapter is None:
            adapter = kvtier_adapter(cache_dir)
        cmd = [
            str(Path(sys.executable).parent / "lmcache"),
            "server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--http-host", "127.0.0.1",
            "--http-port", str(self.http),
            "--shm-name", self.shm,
            "--l1-size-gb", str(l1_gb),
            "--no-l1-use-lazy",
            "--eviction-policy", "LRU",
            "--chunk-size", str(CHUNK),
            "--supported-transfer-mode", "auto",
            "--l2-adapter", json.dumps(adapter),
        ]  # fmt: skip
        self.log = log
        self._out = log.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=_env())
        url = f"http://127.0.0.1:{self.http}/healthcheck"
        if not wait_until_up(self.proc, url, 180, "lmcache server", self._tail):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"lmcache server did not come up: {self._tail()}")

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def clear_l1(self) -> None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http}/cache/clear",
            data=b"{}",
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200, r.read()

    def stop(self) -> None:
        """Stops the server as Ctrl-C does (it closes its L2 adapter)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"lmcache server ignored SIGINT: {self._tail()}") from None
        self._out.close()

    def client(self) -> ServerBenchClient:
        parser = argparse.ArgumentParser()
        add_server_arguments(parser)
        args = parser.parse_args(
            [
                "--rpc-url", f"tcp://127.0.0.1:{self.port}",
                "--url", f"http://127.0.0.1:{self.http}",
                "--mode", "cpu",
                "--num-tokens", str(self.num_tokens),
            ]
        )  # fmt: skip
        c = ServerBenchClient(parse_args_to_config(args), lambda _msg: None)
        c.start()
        return c


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for s in started:
        s.stop()


def _request(client: ServerBenchClient, seq: int, kind: str) -> Any:
    req = client.create_request(seq, request_id=f"req-{seq}-{kind}-{time.monotonic_ns()}", request_kind=kind)
    assert req is not None
    return req


def _expected(client: ServerBenchClient) -> dict[int, list[str]]:
    """Each sequence's chunk checksums as the client's KV holds them (the
    same in every client: LMCache's bench seeds its random KV)."""
    out = {}
    for seq in SEQUENCES:
        req = _request(client, seq, "expect")
        cs = client.compute_checksums(req, start_token=0, token_count=req.num_full_tokens)
        assert cs is not None
        assert len(cs) == req.total_chunks
        out[seq] = cs
    return out


def _store(client: ServerBenchClient) -> None:
    for seq in SEQUENCES:
        req = _request(client, seq, "cold")
        lookup = client.lookup(req)
        assert lookup.is_full_miss, lookup
        stored = client.store(req, start_token=0, token_count=req.num_full_tokens)
        assert stored.succeeded, stored
        client.end_session(req)


def _load(client: ServerBenchClient, expected: dict[int, list[str]]) -> dict[int, int]:
    """Per sequence the chunks LMCache found; asserts that what it loaded
    has the stored checksums."""
    hits = {}
    for seq in SEQUENCES:
        req = _request(client, seq, "warm")
        lookup = client.lookup(req)
        assert lookup.succeeded, lookup
        n = lookup.hit_chunks
        hits[seq] = n
        if n:
            client.zero_destination(req, start_token=0, token_count=n * CHUNK)
            got = client.retrieve(req, start_token=0, token_count=n * CHUNK)
            assert got.succeeded, got
            cs = client.compute_checksums(req, start_token=0, token_count=n * CHUNK)
            assert cs == expected[seq][:n], f"seq {seq}: loaded KV differs from the stored KV"
        client.end_session(req)
    return hits


def _wait_for_l2(cache_dir: Path, chunks: int) -> None:
    """Waits until kvtier holds ``chunks`` blocks on disk (LMCache stores
    into L2 in the background)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _disk_blocks(cache_dir) >= chunks:
            return
        time.sleep(0.2)
    raise AssertionError(f"kvtier got {_disk_blocks(cache_dir)} of {chunks} blocks")


def _slot_files(ns_dir: Path) -> list[Path]:
    return [p for p in ns_dir.rglob("*") if p.is_file() and p.suffix == ".kvt"]


def _written_slots(cache_dir: Path) -> Iterator[tuple[Path, int, int]]:
    """(segment file, offset, slot bytes) of every written slot (not all
    zero at its start) of every LMCache namespace kvtier keeps on disk, in
    file order."""
    for ns in cache_dir.iterdir():
        m = _NAME.match(ns.name)
        if not m:
            continue
        slot = Layout(1, 1, int(m[2]), 1, dtype="f8e4m3", arrangement="latent").slot_bytes
        for seg in _slot_files(ns):
            with seg.open("rb") as f:
                i = 0
                while True:
                    f.seek(i * slot)
                    head = f.read(64)
                    if len(head) < 64:
                        break
                    if any(head):
                        yield seg, i * slot, slot
                    i += 1


def _disk_blocks(cache_dir: Path) -> int:
    """Blocks kvtier wrote to disk."""
    return sum(1 for _ in _written_slots(cache_dir))


def _corrupt_every_other_block(cache_dir: Path) -> int:
    """Flips one payload byte in every other written slot (by position in
    its segment file); returns how many."""
    flipped = 0
    for seg, off, slot in list(_written_slots(cache_dir)):
        if (off // slot) % 2 == 1:
            with seg.open("r+b") as f:
                f.seek(off + slot // 2)
                b = f.read(1)
                f.seek(off + slot // 2)
                f.write(bytes([b[0] ^ 0xFF]))
            flipped += 1
    return flipped


def test_lmcache_server_with_kvtier_l2(tmp_path: Path, servers: list[Server]) -> None:
    cache_dir = tmp_path / "kvtier"
    log = tmp_path / "lmcache-server.log"
    total = len(SEQUENCES) * (NUM_TOKENS // CHUNK)

    # 1. Store, empty L1, load from kvtier.
    s = Server(cache_dir, log)
    servers.append(s)
    client = s.client()
    expected = _expected(client)
    _store(client)
    _wait_for_l2(cache_dir, total)
    s.clear_l1()
    hits = _load(client, expected)
    assert hits == dict.fromkeys(SEQUENCES, NUM_TOKENS // CHUNK), hits
    client.close()
    s.stop()
    assert "Created native plugin L2 adapter: kvtier.lmcache.KvtierL2Adapter" in log.read_text(errors="replace")

    # 2. A new server on the same cache directory: its L1 is empty.
    s = Server(cache_dir, log)
    servers.append(s)
    client = s.client()
    assert _expected(client) == expected
    hits = _load(client, expected)
    assert hits == dict.fromkeys(SEQUENCES, NUM_TOKENS // CHUNK), hits
    client.close()
    s.stop()

    # 3. Corrupt blocks on disk: misses, never wrong bytes.
    flipped = _corrupt_every_other_block(cache_dir)
    assert flipped >= total // 2 - 1, flipped
    s = Server(cache_dir, log)
    servers.append(s)
    client = s.client()
    hits = _load(client, expected)
    # A chunk's prefix ends at its first corrupt block: every flipped block
    # is a miss at least.
    assert sum(hits.values()) <= total - flipped, (hits, flipped)
    client.close()
    s.stop()
