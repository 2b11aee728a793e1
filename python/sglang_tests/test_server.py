"""A real SGLang 0.5.23 server (``python -m sglang.launch_server``) on the
CPU with kvtier as its HiCache storage backend (``dynamic``,
``kvtier.sglang.KvtierHiCacheStorage``, ``interface_v1``), serving a tiny
random Llama made here (python/testing/make_model.py; nothing downloaded).

Two servers, one after the other, on one kvtier cache directory:

1. a prompt of 15 full pages (and a part page) is answered (greedy, a
   fixed number of tokens); SGLang backs the full pages of prompt and
   answer up to kvtier (``batch_set_v1``: kvtier's page count in SGLang's
   storage metrics);
   after ``POST /flush_cache`` (SGLang's device and host caches emptied)
   the same prompt is served from kvtier (``cached_tokens_details``'
   ``storage``: every full page; ``batch_get_v1``'s page count in the
   metrics) and the answer is the same;
2. the server stopped, kvtier's store opened on the directory here (the
   backend built as SGLang builds it): the prompt's 15 pages on disk, in
   the server's namespace; one of them corrupted in its slot;
3. a new server on the directory (its caches and kvtier's memory tier
   empty): the prompt is served from kvtier up to the corrupt page only
   (kvtier read every other page and refused that one: a miss, recomputed,
   never served) and the answer is the same; after the recomputed page is
   backed up again, a flush and the prompt: every page from kvtier, the
   same answer.

The server needs sglang_cpu's patches on a CPU-only machine; they reach
its processes through cpu_server/sitecustomize.py (``PYTHONPATH`` of the
server only). Every process listens on 127.0.0.1; Hugging Face's hub is
offline and its telemetry off. Run by scripts/sglang-e2e.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang_cpu
import torch
from pools import PoolSpec, kvtier_extra, make_pool, page_indices, storage_config
from servers import wait_until_up

import make_model

HERE = Path(__file__).resolve().parent
CPU_SERVER = HERE / "cpu_server"

PAGE = 16
FULL_PAGES = 15
PROMPT_TOKENS = FULL_PAGES * PAGE + 10  # the part page is never stored
MAX_NEW = 16
CORRUPT_PAGE = 5
#: Pages SGLang backs up after the first answer: the prompt's and the
#: answer's tokens (all but the last answer token, whose KV is never
#: computed) in full pages.
STORED_PAGES = (PROMPT_TOKENS + MAX_NEW - 1) // PAGE
#: The tiny model's geometry (make_model.SIZES["tiny"]), f32 KV.
SPEC = PoolSpec("mha", "layer_first", layers=4, heads=2, head_dim=64, page_size=PAGE, tokens=2048, dtype="f32")


def _free_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range (as
    SGLang picks its own ports that a process binds later): the server binds
    it a minute after it is picked, and in between any outgoing connection
    on the machine may be handed an ephemeral port (bind(0) gives one too)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    # SGLang takes its torch.distributed port from 22000-29999.
    for port in random.sample(range(30000, max(ephemeral_low, 30100)), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port from 30000 up to the ephemeral range ({ephemeral_low})")


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count:
    they hold no file or lock)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Server:
    """One SGLang server (its own process group) with kvtier as HiCache's
    storage backend."""

    def __init__(self, model: Path, extra: dict[str, Any], log: Path) -> None:
        self.log = log
        for attempt in range(3):
            start = log.stat().st_size if log.exists() else 0
            self.port = _free_port()
            self._start(model, extra)
            try:
                self._wait_healthy(timeout=400)
                return
            except BaseException:
                self.stop()  # what it started too, not just the first process
                taken = b"address already in use" in log.read_bytes()[start:]
                if not taken or attempt == 2:
                    raise
            # Another process took the port before the server bound it: again.

    def _start(self, model: Path, extra: dict[str, Any]) -> None:
        # SGLang's own keys of the backend's extra config, read (and taken
        # out) by SGLang before kvtier sees the rest: prefetch a hit of one
        # page or more (default: 256 tokens).
        backend_config = {**extra, "prefetch_threshold": PAGE}
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--dtype", "float32",
            "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--page-size", str(PAGE), "--max-total-tokens", "2048", "--context-length", "1024",
            "--skip-server-warmup", "--enable-metrics",
            "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
            "--hicache-write-policy", "write_through",
            # Wait for a prefetch from storage to finish (the default gives
            # up after a time, which a busy CPU can exceed).
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(backend_config),
        ]  # fmt: skip
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SERVER), env.get("PYTHONPATH")) if p)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1")
        self._out = self.log.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _wait_healthy(self, timeout: float) -> None:
        if not wait_until_up(self.proc, f"http://127.0.0.1:{self.port}/health", timeout, "SGLang", self.tail):
            raise RuntimeError(f"SGLang not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def _post(self, path: str, body: dict[str, Any]) -> bytes:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return bytes(r.read())
        except (OSError, http.client.HTTPException) as e:  # HTTPError is an OSError
            body = e.read().decode(errors="replace") if isinstance(e, urllib.error.HTTPError) else ""
            raise AssertionError(f"POST {path}: {e} {body}\nserver log:\n{self.tail()}") from e

    def generate(self, ids: list[int]) -> dict[str, Any]:
        """A greedy completion of ``MAX_NEW`` tokens: SGLang's ``/generate``
        answer (``output_ids``, ``text``, ``meta_info``)."""
        params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
        out: dict[str, Any] = json.loads(self._post("/generate", {"input_ids": ids, "sampling_params": params}))
        assert out["meta_info"]["prompt_tokens"] == len(ids), out
        assert len(out["output_ids"]) == MAX_NEW, out
        return out

    def flush_cache(self) -> None:
        """Empties SGLang's device and host caches (``POST /flush_cache``;
        400 while requests run)."""
        self._post("/flush_cache", {})

    def metric(self, name: str) -> float:
        """The sum of ``/metrics`` samples called ``name`` (labels aside)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            body = r.read().decode()
        total = 0.0
        for line in body.splitlines():
            if line.startswith((name + "{", name + " ")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_metric(self, name: str, at_least: float, timeout: float = 60) -> float:
        """Waits until metric ``name`` reaches ``at_least`` (SGLang backs
        pages up, and publishes the backend's counts, in the background)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name)
            if value >= at_least or time.monotonic() > deadline:
                return value
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s; returns
        when none of its processes runs (kvtier's store is closed)."""
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 30.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and (self.proc.poll() is None or _group_alive(pgid)):
                time.sleep(0.2)
            if self.proc.poll() is not None and not _group_alive(pgid):
                break
        self.proc.wait(timeout=10)
        self._out.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """The servers a test started, all stopped at its end, passed or not."""
    started: list[Server] = []
    yield started
    for s in started:
        s.stop()


def _storage_tokens(out: dict[str, Any]) -> int:
    """Prompt tokens SGLang took from the storage backend (kvtier)."""
    details = out["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage", 0))


def _inspect_store(cache_dir: Path, extra: dict[str, Any], model: str, keys: list[str]) -> dict[str, Any]:
    """Opens kvtier's backend on ``cache_dir`` as the server's cache
    controller builds it (SGLang's factory, an MHA layer_first host pool of
    the model's geometry, its model name): what it holds of ``keys``. Its
    store is closed before returning (one store may own a directory)."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = make_pool(SPEC)
    b = StorageBackendFactory.create_backend("dynamic", storage_config(SPEC, extra, model=model), pool)
    try:
        b.register_mem_pool_host(pool)
        out = {
            "namespace": b.namespace.name,
            "exists": b.batch_exists(keys),
            "where": [b.namespace.locate(bytes.fromhex(k)) for k in keys],
            "payload_bytes": b.layout.stored_payload_bytes,
            "stats": b.kvtier_stats(),
        }
    finally:
        # The last backend of a directory closes its store: a server can
        # open the directory next.
        b.close()
    return out


def _corrupt(path: str, slot: int, payload_bytes: int) -> None:
    """Flips bits of one payload byte of the block at ``slot`` in ``path``
    (a block is a 128-byte header, then its payload: docs/block-format.md)."""
    at = slot + 128 + payload_bytes // 2 + 3
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def test_sglang_server_serves_a_prompt_from_kvtier_and_never_a_corrupt_page(
    tmp_path: Path, servers: list[Server]
) -> None:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    model = tmp_path / "model"
    make_model.make(model, "tiny", seed=3, random_vectors=True)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(11)
    ids = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]  # 0-2: unk, bos, eos
    keys = get_storage_hash_str(ids[: FULL_PAGES * PAGE], None, page_size=PAGE)
    assert isinstance(keys, list)
    assert len(keys) == FULL_PAGES
    cache = tmp_path / "kvtier"
    extra = kvtier_extra(str(cache), g2_bytes=64 << 20, g3_bytes=64 << 20, g3_sync_ms=100)
    log = tmp_path / "sglang.log"

    # 1. Answer, back up to kvtier, flush SGLang's caches, answer from kvtier.
    s = Server(model, extra, log)
    servers.append(s)
    first = s.generate(ids)
    assert first["meta_info"]["cached_tokens"] == 0, first["meta_info"]
    backed_up = s.wait_metric("sglang:backup_pgs_sum", STORED_PAGES)
    assert backed_up == STORED_PAGES, f"kvtier stored {backed_up} pages (batch_set_v1), not {STORED_PAGES}"
    s.flush_cache()
    again = s.generate(ids)
    assert _storage_tokens(again) == FULL_PAGES * PAGE, again["meta_info"]
    assert again["meta_info"]["cached_tokens_details"]["storage_backend"] == "KvtierHiCacheStorage"
    assert again["meta_info"]["cached_tokens"] == FULL_PAGES * PAGE, again["meta_info"]
    assert again["output_ids"] == first["output_ids"]
    assert again["text"] == first["text"]
    read = s.wait_metric("sglang:prefetch_pgs_sum", FULL_PAGES)
    assert read == FULL_PAGES, f"kvtier read {read} pages (batch_get_v1), not {FULL_PAGES}"
    s.stop()
    servers.remove(s)
    assert "Creating dynamic storage backend 'kvtier' (kvtier.sglang.KvtierHiCacheStorage)" in s.tail(10**7)

    # 2. kvtier's side: every page on disk in the server's namespace; one corrupted.
    dirs = [p.name for p in cache.iterdir() if p.is_dir()]
    held = _inspect_store(cache, extra, str(model), keys)
    assert dirs == [held["namespace"]], (dirs, held["namespace"])  # the server's namespace, not a new one
    assert held["exists"] == FULL_PAGES, held
    assert all(w is not None for w in held["where"]), held["where"]
    assert len({tuple(w) for w in held["where"]}) == FULL_PAGES
    assert held["stats"]["g3_blocks"] == STORED_PAGES, held["stats"]
    path, off = held["where"][CORRUPT_PAGE]
    _corrupt(path, off, held["payload_bytes"])

    # 3. A new server: kvtier's pages up to the corrupt one, that one recomputed.
    s = Server(model, extra, log)
    servers.append(s)
    partial = s.generate(ids)
    assert _storage_tokens(partial) == CORRUPT_PAGE * PAGE, partial["meta_info"]
    assert partial["output_ids"] == first["output_ids"]
    assert partial["text"] == first["text"]
    # kvtier counts the pages SGLang could use: those before the corrupt one.
    read = s.wait_metric("sglang:prefetch_pgs_sum", CORRUPT_PAGE)
    assert read == CORRUPT_PAGE, f"kvtier reported {read} pages read, not {CORRUPT_PAGE}"
    # The recomputed pages go back to kvtier (the corrupt one among them).
    assert s.wait_metric("sglang:backup_pgs_sum", FULL_PAGES - CORRUPT_PAGE) >= FULL_PAGES - CORRUPT_PAGE
    s.flush_cache()
    healed = s.generate(ids)
    assert _storage_tokens(healed) == FULL_PAGES * PAGE, healed["meta_info"]
    assert healed["output_ids"] == first["output_ids"]


def test_cpu_stand_ins_match_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's stand-ins do what SGLang's own code does: the rotation
    matches SGLang's ``apply_rotary_emb`` (what ``RotaryEmbedding.forward_native``
    applies), NeoX and GPT-J styles; the page copy, called by SGLang's MHA
    host pool itself (a backup from the device pool, a load back into it,
    ``--hicache-io-backend direct``), moves exactly the pages asked for."""
    import sglang.srt.mem_cache.pool_host.mha as mha
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    g = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head, rot = 7, 4, 2, 64, 32
    positions = torch.randint(0, 100, (tokens,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(128, dtype=torch.float32), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    for neox in (True, False):
        q = torch.randn(tokens, heads * head, generator=g)
        k = torch.randn(tokens, kv_heads * head, generator=g)
        cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
        want = []
        for x in (q, k):
            v = x.view(tokens, -1, head)
            want.append(torch.cat((apply_rotary_emb(v[..., :rot], cos, sin, neox), v[..., rot:]), dim=-1))
        sglang_cpu.rotary_embedding(positions, q, k, head, cache, neox)
        torch.testing.assert_close(q.view(tokens, heads, head), want[0])
        torch.testing.assert_close(k.view(tokens, kv_heads, head), want[1])

    monkeypatch.setattr(mha, "transfer_kv_direct", sglang_cpu.transfer_kv_direct, raising=False)
    pool = make_pool(SPEC)
    device = [*pool.device_k_buffers, *pool.device_v_buffers]  # [tokens, heads, dim] per layer
    for t in device:
        t.copy_(torch.randn(t.shape, generator=g))
    want = [t.clone() for t in device]
    src, dst = [3, 9, 4], [20, 7, 31]  # device pages, host pages
    pool.backup_from_device_all_layer(None, page_indices(dst, PAGE), page_indices(src, PAGE), "direct")
    for sp, hp in zip(src, dst, strict=True):
        rows = slice(sp * PAGE, (sp + 1) * PAGE)
        page = pool.get_data_page(hp * PAGE, flat=False)  # [K/V, layers, page, heads, dim]
        assert torch.equal(page[0], torch.stack([t[rows] for t in want[: SPEC.layers]]))
        assert torch.equal(page[1], torch.stack([t[rows] for t in want[SPEC.layers :]]))
    assert not pool.get_data_page(0, flat=True).any()  # no other host page written
    for t in device:
        t.zero_()
    back = [12, 1, 30]  # device pages to load the host pages into
    for layer in range(SPEC.layers):
        pool.load_to_device_per_layer(None, page_indices(dst, PAGE), page_indices(back, PAGE), layer, "direct")
    for t, w in zip(device, want, strict=True):
        for sp, bp in zip(src, back, strict=True):
            assert torch.equal(t[bp * PAGE : (bp + 1) * PAGE], w[sp * PAGE : (sp + 1) * PAGE])
        assert int(t.count_nonzero()) == len(back) * PAGE * SPEC.heads * SPEC.head_dim  # nothing else
