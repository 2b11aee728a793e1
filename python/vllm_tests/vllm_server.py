"""Real vLLM servers (CPU backend) and a real redis-server for the
end-to-end checks and scripts/bench-vllm: start, wait until healthy, send
OpenAI requests, read /metrics, stop (SIGTERM) or kill -9."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servers import wait_until_up


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvtier_transfer_config(extra: dict[str, Any]) -> str:
    """``--kv-transfer-config`` for :class:`kvtier.vllm.KvtierConnector`."""
    return json.dumps(
        {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    )


def example_transfer_config(path: str) -> str:
    """``--kv-transfer-config`` for vLLM's in-tree ExampleConnector."""
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": path},
        }
    )


def vllm_command(
    model: str,
    port: int,
    transfer_config: str | None = None,
    kv_space_gb: int = 1,
    max_model_len: int = 4096,
    extra_args: list[str] | None = None,
    *,
    tp: int = 1,
    hybrid: bool | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a vLLM OpenAI server (CPU
    backend) on 127.0.0.1:``port``; ``transfer_config`` (a
    ``--kv-transfer-config`` JSON) adds a connector.

    ``tp`` > 1: ``--tensor-parallel-size tp``, each rank's OpenMP threads
    bound to one CPU of its own (``0|1|...``, modulo the CPU count):
    ``auto`` refuses more ranks than NUMA nodes ("Not enough allowed NUMA
    nodes to bind threads of 2 local CPUWorkers"). ``hybrid``: True or
    False asks for vLLM's hybrid KV cache manager or turns it off
    (``--[no-]disable-hybrid-kv-cache-manager``); None leaves vLLM to
    decide (on for a hybrid model, unless the connector does not support
    it)."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, not {tp}")
    cpus = os.cpu_count() or 1
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gb),
        VLLM_CPU_OMP_THREADS_BIND="auto" if tp == 1 else "|".join(str(i % cpus) for i in range(tp)),
        VLLM_LOGGING_LEVEL="INFO",
    )
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--enable-prefix-caching", "-O0",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    if hybrid is not None:
        cmd.append("--no-disable-hybrid-kv-cache-manager" if hybrid else "--disable-hybrid-kv-cache-manager")
    if transfer_config is not None:
        cmd += ["--kv-transfer-config", transfer_config]
    cmd += extra_args or []
    return cmd, env


@dataclass
class Reply:
    """One completion: its text, time to the first token, total time and
    the prompt's and completion's token counts."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int = 0


class VllmServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` process.

    ``transfer_config`` (a ``--kv-transfer-config`` JSON) adds a connector;
    ``None`` is vLLM alone. ``tp`` and ``hybrid``: see :func:`vllm_command`."""

    def __init__(
        self,
        model: str,
        log: Path,
        transfer_config: str | None = None,
        kv_space_gb: int = 1,
        max_model_len: int = 4096,
        extra_args: list[str] | None = None,
        *,
        tp: int = 1,
        hybrid: bool | None = None,
    ) -> None:
        self.model = model
        self.port = free_port()
        self.log = log
        cmd, env = vllm_command(
            model, self.port, transfer_config, kv_space_gb, max_model_len, extra_args, tp=tp, hybrid=hybrid
        )
        self._out = open(log, "ab")  # noqa: SIM115 - open while the server runs, closed by stop()
        # A session of its own: stop() and kill9() reach the engine core
        # and worker processes vLLM starts.
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_healthy(timeout=300)

    def _wait_healthy(self, timeout: float) -> None:
        url = f"http://127.0.0.1:{self.port}/health"
        if not wait_until_up(self.proc, url, timeout, "vLLM", self.log_tail):
            self.kill9()
            raise RuntimeError(f"vLLM not healthy after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _post(self, path: str, body: dict[str, Any], timeout: float = 600) -> Any:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids, as a completion sees them."""
        return list(self._post("/tokenize", {"model": self.model, "prompt": prompt})["tokens"])

    def complete(self, prompt: str, max_tokens: int = 16, cache_salt: str | None = None) -> Reply:
        """A greedy completion, streamed: its text and time to first token."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.monotonic()
        ttft: float | None = None
        text: list[str] = []
        prompt_tokens = completion_tokens = 0
        with urllib.request.urlopen(req, timeout=900) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                for c in chunk.get("choices") or []:
                    if c.get("text"):
                        if ttft is None:
                            ttft = time.monotonic() - start
                        text.append(c["text"])
                if chunk.get("usage"):
                    prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                    completion_tokens = int(chunk["usage"].get("completion_tokens") or 0)
        total = time.monotonic() - start
        return Reply("".join(text), ttft if ttft is not None else total, total, prompt_tokens, completion_tokens)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples: name (labels dropped) -> value, summed."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            body = r.read().decode()
        out: dict[str, float] = {}
        for line in body.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def thread_cpus(self, prefix: str) -> dict[int, set[int]]:
        """The CPUs each thread named ``prefix...`` of the server's
        processes may run on, by thread id."""
        return thread_cpus(_session_pids(self.proc.pid), prefix)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the whole session (a clean shutdown), SIGKILL after
        ``timeout``."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill9()

    def kill9(self) -> None:
        """SIGKILL to the server and every process it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        # The engine core and workers share the session; wait until none
        # is left, so their memory and sockets are gone.
        deadline = time.monotonic() + 60
        while _session_alive(self.proc.pid):
            if time.monotonic() > deadline:
                self._out.close()
                raise RuntimeError(f"vLLM's processes (session {self.proc.pid}) live 60 s after SIGKILL")
            time.sleep(0.1)
        self._out.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cpu_list(text: str) -> set[int]:
    """A kernel CPU list (``0-3,6``) as a set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def thread_cpus(pids: list[int], prefix: str) -> dict[int, set[int]]:
    """The CPUs each thread of ``pids`` whose name starts with ``prefix``
    may run on, by thread id."""
    out: dict[int, set[int]] = {}
    for pid in pids:
        for t in Path(f"/proc/{pid}/task").glob("*"):
            try:
                if not (t / "comm").read_text().startswith(prefix):
                    continue
                status = (t / "status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    out[int(t.name)] = cpu_list(line.split(":", 1)[1])
    return out


def _session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def _session_alive(sid: int) -> bool:
    """True while a process of session ``sid`` lives. A process whose main
    thread is already a zombie still holds its files (and their locks, a
    G3's owner lock among them) until its last thread has exited: a thread
    in a disk write finishes the write first, SIGKILL or not."""
    for pid in _session_pids(sid):
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
            states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks]
        except OSError:
            continue
        if any(s not in ("Z", "X") for s in states):
            return True
    return False


class RedisServer:
    """A real redis-server on 127.0.0.1 (no persistence), stopped on exit."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def keys(self) -> int:
        """How many keys it holds (``DBSIZE``)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"*1\r\n$6\r\nDBSIZE\r\n")
            line = s.recv(64).decode()
        return int(line.strip().lstrip(":"))

    def wait_keys(self, count: int, timeout: float = 60) -> int:
        """Waits until it holds ``count`` keys or more (a writer's G4 writes
        run behind its replies), at most ``timeout`` seconds; the count."""
        deadline = time.monotonic() + timeout
        while (n := self.keys()) < count and time.monotonic() < deadline:
            time.sleep(0.2)
        return n

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
