"""A ``kvtier serve`` process for the tests: started on port 0 (the address
read from its first stdout line, ``listening on http://ADDR``), spoken to
over HTTP with the standard library, stopped with SIGTERM (a clean exit
that writes its KV cache under the cache directory) or killed when a test
fails."""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: Seconds to wait for the address line, for a request, for the exit after
#: SIGTERM. The tests run the debug build on small CI machines.
START_TIMEOUT = 120.0
REQUEST_TIMEOUT = 300.0
STOP_TIMEOUT = 120.0


def kvtier_bin() -> str:
    """The binary under test: ``$KVTIER_BIN``; a missing variable or file
    is an error (the checks fail, never skip)."""
    path = os.environ.get("KVTIER_BIN")
    if not path:
        raise RuntimeError(
            "KVTIER_BIN is not set: point it at the kvtier binary to test (scripts/test sets it to target/debug/kvtier)"
        )
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"KVTIER_BIN={path} is not an executable file")
    return path


class HttpError(AssertionError):
    """A response that is not 2xx."""

    def __init__(self, status: int, body: str, path: str) -> None:
        super().__init__(f"POST {path}: HTTP {status}: {body}")
        self.status = status
        self.body = body


class KvtierServer:
    """One running ``kvtier serve --model MODEL --port 0 --cache-dir CACHE``."""

    def __init__(self, model: Path, cache: Path, log: Path, extra: list[str] | None = None) -> None:
        self.log = log
        args = [kvtier_bin(), "serve", "--model", str(model), "--port", "0", "--cache-dir", str(cache)]
        # $KVTIER_SERVE_ARGS: flags added to every server, e.g. `--device
        # cuda:0` to run these checks on a GPU build.
        args += [*shlex.split(os.environ.get("KVTIER_SERVE_ARGS", "")), *(extra or [])]
        self._stderr = open(log, "ab")  # noqa: SIM115 - open while the server runs, closed by stop()
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr)
        lines: queue.Queue[str | None] = queue.Queue()

        def drain() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                lines.put(raw.decode(errors="replace").rstrip("\n"))
            lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        try:
            first = lines.get(timeout=START_TIMEOUT)
        except queue.Empty:
            first = None
        if first is None or not first.startswith("listening on http://"):
            self.kill()
            raise AssertionError(
                f"kvtier serve printed {first!r}, not 'listening on http://ADDR' "
                f"(exit {self.proc.returncode}); command {args}; stderr:\n{self.stderr()}"
            )
        self.url = first.removeprefix("listening on ")
        # The client must reach 127.0.0.1 directly, whatever proxy is set.
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        models = self.get("/v1/models")["data"]
        assert len(models) == 1, models
        self.model: str = models[0]["id"]

    def stderr(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def _send(self, req: urllib.request.Request, path: str) -> Any:
        try:
            with self._http.open(req, timeout=REQUEST_TIMEOUT) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise HttpError(e.code, e.read().decode(errors="replace"), path) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise AssertionError(
                f"{path}: no answer from kvtier serve ({e}; exit status {self.proc.poll()}); stderr:\n{self.stderr()}"
            ) from None

    def get(self, path: str) -> Any:
        return self._send(urllib.request.Request(self.url + path), path)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POSTs ``body`` as JSON; the decoded reply (HttpError if not 2xx)."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        return self._send(req, path)

    def terminate(self) -> int:
        """SIGTERM, then the exit status (the server flushes its cache)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"kvtier serve did not exit {STOP_TIMEOUT} s after SIGTERM; stderr:\n{self.stderr()}"
            ) from None
        self._stderr.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()
