"""scripts/bench-llamacpp: kvtier's reference engine beside llama.cpp on the
same model (make_model.py's random Llama, f32), the same machine, one job
at a time (never both engines computing at once).

Rows, per thread count:

- ``prefill_tok_s``: a 2,048-token prompt. kvtier: ``kvtier serve
  --no-prefix-reuse``, max_tokens 1, prompt tokens / the server's TTFT
  (``kvtier.ttft_seconds``), after one warm-up request. llama.cpp:
  ``llama-bench -p 2048 -n 0`` (its own warm-up run included).
- ``decode_tok_s``: 64 tokens from a near-empty context. kvtier: an
  8-token prompt, max_tokens 64, streamed; tokens after the first chunk's
  / (last chunk - first chunk) on the client. llama.cpp: ``llama-bench -p
  0 -n 64`` (no HTTP, no client beside it).
- ``decode_served_tok_s``: the same kvtier figure beside llama-server's,
  measured the same way by the same client (both engines pay a streamed
  HTTP reply per token, and share the cores with the client).
- ``ttft_recompute_s``, ``ttft_g1_hit_s``, ``ttft_disk_restore_s``: the
  client's time to the (only) token of a max_tokens-1 request whose
  prompt is 2,000 token ids, the same ids for both engines: first sight
  of the prompt on a running server; the same prompt again (kvtier: G1;
  llama.cpp: ``cache_prompt`` in its slot); after a restart (kvtier:
  SIGTERM, which writes its cache to disk, and a new server on the same
  ``--cache-dir`` restoring from G3; llama.cpp: ``POST
  /slots/0?action=save`` before the stop, ``action=restore`` then the
  request after it, both timed). The page cache is dropped before each
  restarted server starts, when this process may.

Each figure is the median of ``--repeats`` samples (three times as many
for the decode rows), the two engines
interleaved sample by sample (kvtier's server sits idle while llama.cpp
runs). ``ratio`` is kvtier / llama.cpp: above 1 is kvtier faster for the
tok/s rows, slower for the TTFT rows.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))

import setup_llamacpp
from make_model import text
from setup_llamacpp import REPO, log

HOST = "127.0.0.1"


# ---------------------------------------------------------------- processes


def _die_with_parent() -> None:
    """In the child: SIGKILL when this script dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Proc:
    """A server or tool this script started; every live one is stopped on
    exit, error or signal (see :func:`main`)."""

    live: ClassVar[list[Proc]] = []

    def __init__(self, name: str, cmd: list[str], logs: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.out = logs / f"{name}.stdout"
        self.err = logs / f"{name}.stderr"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.p = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        Proc.live.append(self)

    def check_alive(self) -> None:
        if self.p.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.p.returncode}:\n{self.tail()}")

    def tail(self) -> str:
        parts = []
        for f in (self.out, self.err):
            with contextlib.suppress(OSError):
                parts.append(f.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def stop(self, timeout: float = 120.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s."""
        if self in Proc.live:
            Proc.live.remove(self)
        if self.p.poll() is not None:
            return
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"{self.name} did not stop in {timeout:.0f} s after SIGTERM: killing it")
            self.p.kill()
            self.p.wait()

    @classmethod
    def stop_all(cls) -> None:
        for p in list(reversed(cls.live)):
            p.stop(timeout=30.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def drop_page_cache() -> bool:
    """Drops the page cache (as root); False when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------- HTTP


def post(port: int, path: str, body: dict[str, Any], timeout: float = 600.0) -> tuple[dict[str, Any], float]:
    """(the JSON reply, the client's seconds from sending to the whole reply)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        dt = time.perf_counter() - t0
    finally:
        conn.close()
    if r.status != 200:
        raise RuntimeError(f"POST {path}: HTTP {r.status}: {raw[:500]!r}")
    return json.loads(raw), dt


def stream_times(port: int, path: str, body: dict[str, Any], timeout: float = 600.0) -> list[tuple[float, int]]:
    """Client times (perf_counter) of each streamed chunk that carries
    tokens, with how many: the length of its ``logprobs.tokens`` when the
    request asked for log probabilities, else 1 per chunk with text.

    Counting text chunks undercounts tokens: a token that ends inside a
    multi-byte character is held back and goes out with the next one (56
    text chunks for 64 tokens on the bench model), so the decode rate is
    measured from the tokens each chunk reports."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    times: list[tuple[float, int]] = []
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {r.status}: {r.read()[:500]!r}")
        while True:
            line = r.readline()
            if not line:
                break
            now = time.perf_counter()
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for c in chunk.get("choices", []):
                lp = c.get("logprobs")
                if lp:  # noqa: SIM108 - two cases, each with its own comment
                    # kvtier (and OpenAI): ``tokens``; llama-server: ``content``.
                    n = len(lp["tokens"] if "tokens" in lp else lp["content"])
                else:
                    n = 1 if c.get("text") else 0
                if n:
                    times.append((now, n))
    finally:
        conn.close()
    return times


def wait_http_ok(port: int, proc: Proc, path: str = "/health", timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.check_alive()
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready on port {port} after {timeout:.0f} s:\n{proc.tail()}")


def served_decode_tok_s(port: int, ids: list[int], tokens: int, logprobs: int) -> float:
    """A server's decode rate as a client sees it: ``/v1/completions``
    streamed, tokens after the first chunk's over the time from the first
    chunk to the last (llama-bench's tg counts generated tokens the same
    way, without the prompt's processing). ``logprobs`` makes each chunk
    list its tokens (kvtier: 0, the chosen token only; llama-server lists
    them from 1); either costs one pass over the logits per token."""
    times = stream_times(
        port,
        "/v1/completions",
        {
            "prompt": ids,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "logprobs": logprobs,
        },
    )
    if len(times) < 2:
        raise RuntimeError(f"port {port} streamed {len(times)} token chunks for max_tokens {tokens}")
    after_first = sum(n for _, n in times[1:])
    return after_first / (times[-1][0] - times[0][0])


DECODE_SAMPLES_PER_REPEAT = 3
"""Decode samples of each engine per repeat (the median is over all)."""


# ------------------------------------------------------------------ engines


@dataclass
class Kvtier:
    binary: Path
    model_dir: Path
    logs: Path
    threads_flag: bool
    starts: int = 0

    def start(self, threads: int, cache_dir: Path, no_prefix_reuse: bool) -> tuple[Proc, int]:
        """A ``kvtier serve``; (the process, its port) once it listens."""
        cmd = [
            str(self.binary),
            "serve",
            "--model",
            str(self.model_dir),
            "--host",
            HOST,
            "--port",
            "0",
            "--cache-dir",
            str(cache_dir),
        ]
        env = dict(os.environ)
        if self.threads_flag:
            cmd += ["--threads", str(threads)]
            env.pop("RAYON_NUM_THREADS", None)
        else:
            env["RAYON_NUM_THREADS"] = str(threads)
        if no_prefix_reuse:
            cmd.append("--no-prefix-reuse")
        self.starts += 1
        proc = Proc(f"kvtier-{self.starts}", cmd, self.logs, env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            first = proc.out.read_text(errors="replace").split("\n", 1)
            if len(first) == 2:
                line = first[0].strip()
                if not line.startswith("listening on http://"):
                    raise RuntimeError(f"kvtier serve's first line is not 'listening on http://ADDR': {line!r}")
                port = int(line.rsplit(":", 1)[1].strip("/"))
                wait_http_ok(port, proc)
                return proc, port
            proc.check_alive()
            time.sleep(0.1)
        raise RuntimeError(f"kvtier serve printed no 'listening on' line in 300 s:\n{proc.tail()}")

    @staticmethod
    def complete(port: int, ids: list[int], max_tokens: int = 1) -> tuple[dict[str, Any], float]:
        return post(port, "/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0})

    @staticmethod
    def decode_tok_s(port: int, ids: list[int], tokens: int) -> float:
        return served_decode_tok_s(port, ids, tokens, logprobs=0)


@dataclass
class LlamaCpp:
    build: Path
    gguf: Path
    logs: Path
    ctx: int
    starts: int = 0

    @property
    def bench_bin(self) -> Path:
        return self.build / "build" / "bin" / "llama-bench"

    def bench(self, threads: int, prompt: int, gen: int) -> float:
        """One llama-bench test (its warm-up run, then 1 measured run): tok/s."""
        cmd = [
            str(self.bench_bin),
            "-m",
            str(self.gguf),
            "-p",
            str(prompt),
            "-n",
            str(gen),
            "-t",
            str(threads),
            "-r",
            "1",
            "-o",
            "json",
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, preexec_fn=_die_with_parent).stdout
        rows = json.loads(out)
        return float(rows[0]["avg_ts"])

    def start(self, threads: int, slot_dir: Path) -> tuple[Proc, int]:
        port = free_port()
        cmd = [
            str(self.build / "build" / "bin" / "llama-server"),
            "-m",
            str(self.gguf),
            "--host",
            HOST,
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(self.ctx),
            "-np",
            "1",
            "--slot-save-path",
            str(slot_dir),
        ]
        self.starts += 1
        proc = Proc(f"llama-server-{self.starts}", cmd, self.logs)
        wait_http_ok(port, proc)
        return proc, port

    @staticmethod
    def complete(port: int, ids: list[int]) -> tuple[dict[str, Any], float]:
        return post(
            port, "/completion", {"prompt": ids, "n_predict": 1, "cache_prompt": True, "temperature": 0, "id_slot": 0}
        )

    @staticmethod
    def decode_tok_s(port: int, ids: list[int], tokens: int) -> float:
        return served_decode_tok_s(port, ids, tokens, logprobs=1)

    @staticmethod
    def slot(port: int, action: str, filename: str) -> float:
        _, dt = post(port, f"/slots/0?action={action}", {"filename": filename})
        return dt


# -------------------------------------------------------------------- rows


@dataclass
class Row:
    threads: int
    metric: str
    kvtier: list[float] = field(default_factory=list)
    llamacpp: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        k, ll = statistics.median(self.kvtier), statistics.median(self.llamacpp)
        return {
            "threads": self.threads,
            "metric": self.metric,
            "kvtier": k,
            "llamacpp": ll,
            "ratio": k / ll if ll else None,
            "kvtier_samples": self.kvtier,
            "llamacpp_samples": self.llamacpp,
            **self.extra,
        }


def prompt_ids(tokenizer: Any, seed: int, n: int) -> list[int]:
    """``n`` token ids of make_model text (one word is about one token)."""
    ids: list[int] = tokenizer.encode(text(seed, n + n // 4 + 16)).ids
    if len(ids) < n:
        raise RuntimeError(f"text({seed}) made {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def speed_rows(kv: Kvtier, lc: LlamaCpp, tok: Any, threads: int, a: argparse.Namespace, work: Path) -> list[Row]:
    pre = Row(threads, "prefill_tok_s", extra={"prompt_tokens": a.prefill_tokens})
    dec = Row(threads, "decode_tok_s", extra={"tokens": a.decode_tokens})
    served = Row(threads, "decode_served_tok_s", extra={"tokens": a.decode_tokens})
    long_ids = prompt_ids(tok, 100, a.prefill_tokens)
    short_ids = prompt_ids(tok, 101, 8)
    proc, port = kv.start(threads, work / f"kv-speed-{threads}", no_prefix_reuse=True)
    # llama-server idles while kvtier computes and the other way round.
    (work / f"slots-speed-{threads}").mkdir()
    lproc, lport = lc.start(threads, work / f"slots-speed-{threads}")
    try:
        log(f"  warm-up (threads {threads})")
        kv.complete(port, long_ids)
        kv.decode_tok_s(port, short_ids, a.decode_tokens)
        lc.decode_tok_s(lport, short_ids, a.decode_tokens)
        for i in range(a.repeats):
            r, _ = kv.complete(port, long_ids)
            pre.kvtier.append(r["usage"]["prompt_tokens"] / r["kvtier"]["ttft_seconds"])
            pre.llamacpp.append(lc.bench(threads, a.prefill_tokens, 0))
            # Decode samples are short (about a second) and the VM's memory
            # bandwidth drifts between them: three per repeat.
            for _ in range(DECODE_SAMPLES_PER_REPEAT):
                dec.kvtier.append(kv.decode_tok_s(port, short_ids, a.decode_tokens))
                dec.llamacpp.append(lc.bench(threads, 0, a.decode_tokens))
                served.kvtier.append(dec.kvtier[-1])
                served.llamacpp.append(lc.decode_tok_s(lport, short_ids, a.decode_tokens))
            log(
                f"  sample {i + 1}/{a.repeats}: prefill {pre.kvtier[-1]:.1f} / {pre.llamacpp[-1]:.1f} tok/s, "
                f"decode {dec.kvtier[-1]:.1f} / {dec.llamacpp[-1]:.1f} (llama-bench) / "
                f"{served.llamacpp[-1]:.1f} (llama-server) tok/s (kvtier / llama.cpp)"
            )
    finally:
        lproc.stop()
        proc.stop()
    return [pre, dec, served]


def ttft_rows(
    kv: Kvtier, lc: LlamaCpp, tok: Any, threads: int, a: argparse.Namespace, work: Path
) -> tuple[list[Row], bool]:
    """The three TTFT rows; and whether the page cache was dropped."""
    n = a.ttft_tokens
    extra = {"prompt_tokens": n}
    rec = Row(threads, "ttft_recompute_s", extra=dict(extra))
    hit = Row(threads, "ttft_g1_hit_s", extra=dict(extra))
    disk = Row(threads, "ttft_disk_restore_s", extra=dict(extra))
    prompts = [prompt_ids(tok, 200 + threads * 100 + i, n) for i in range(a.repeats)]
    warm_ids = prompt_ids(tok, 199 + threads * 100, n)
    kv_cache = work / f"kv-ttft-{threads}"
    slots = work / f"slots-{threads}"
    slots.mkdir()
    cached: dict[str, list[int]] = {
        k: []
        for k in ("kvtier_rec", "kvtier_hit", "kvtier_restore", "llamacpp_rec", "llamacpp_hit", "llamacpp_restore")
    }
    restore_tiers: list[dict[str, int]] = []
    # The servers' own figures beside the client's: kvtier.ttft_seconds;
    # llama.cpp's timings.prompt_ms (plus the restore call's time).
    server: dict[str, list[float]] = {f"{e}_{m}": [] for e in ("kvtier", "llamacpp") for m in ("rec", "hit", "disk")}

    # kvtier: recompute, G1 hit; SIGTERM writes the cache to disk.
    proc, port = kv.start(threads, kv_cache, no_prefix_reuse=False)
    try:
        kv.complete(port, warm_ids)
        for ids in prompts:
            r, dt = kv.complete(port, ids)
            rec.kvtier.append(dt)
            server["kvtier_rec"].append(r["kvtier"]["ttft_seconds"])
            cached["kvtier_rec"].append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
            r, dt = kv.complete(port, ids)
            hit.kvtier.append(dt)
            server["kvtier_hit"].append(r["kvtier"]["ttft_seconds"])
            cached["kvtier_hit"].append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        log(f"  kvtier: recompute {rec.kvtier} s, G1 hit {hit.kvtier} s")
    finally:
        proc.stop()

    # llama.cpp: recompute, prompt-cache hit, slot saved to a file.
    proc, port = lc.start(threads, slots)
    try:
        lc.complete(port, warm_ids)
        for i, ids in enumerate(prompts):
            r, dt = lc.complete(port, ids)
            rec.llamacpp.append(dt)
            server["llamacpp_rec"].append(r["timings"]["prompt_ms"] / 1000)
            cached["llamacpp_rec"].append(int(r["timings"]["cache_n"]))
            r, dt = lc.complete(port, ids)
            hit.llamacpp.append(dt)
            server["llamacpp_hit"].append(r["timings"]["prompt_ms"] / 1000)
            cached["llamacpp_hit"].append(int(r["timings"]["cache_n"]))
            lc.slot(port, "save", f"p{i}.bin")
        log(f"  llama.cpp: recompute {rec.llamacpp} s, hit {hit.llamacpp} s")
    finally:
        proc.stop()

    # kvtier after a restart: G3.
    dropped = a.drop_caches and drop_page_cache()
    proc, port = kv.start(threads, kv_cache, no_prefix_reuse=False)
    try:
        kv.complete(port, prompt_ids(tok, 198 + threads * 100, n))
        for ids in prompts:
            r, dt = kv.complete(port, ids)
            disk.kvtier.append(dt)
            server["kvtier_disk"].append(r["kvtier"]["ttft_seconds"])
            cached["kvtier_restore"].append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
            restore_tiers.append(r["kvtier"]["cached_tokens"])
        log(f"  kvtier: restore {disk.kvtier} s, cached tokens by tier {restore_tiers}")
    finally:
        proc.stop()

    # llama.cpp after a restart: slot restore + the request.
    dropped = (a.drop_caches and drop_page_cache()) and dropped
    proc, port = lc.start(threads, slots)
    try:
        lc.complete(port, prompt_ids(tok, 198 + threads * 100, n))
        for i, ids in enumerate(prompts):
            t_restore = lc.slot(port, "restore", f"p{i}.bin")
            r, dt = lc.complete(port, ids)
            disk.llamacpp.append(t_restore + dt)
            server["llamacpp_disk"].append(t_restore + r["timings"]["prompt_ms"] / 1000)
            cached["llamacpp_restore"].append(int(r["timings"]["cache_n"]))
        log(f"  llama.cpp: restore {disk.llamacpp} s")
    finally:
        proc.stop()

    for row, m in ((rec, "rec"), (hit, "hit"), (disk, "disk")):
        row.extra |= {"kvtier_server_s": server[f"kvtier_{m}"], "llamacpp_server_s": server[f"llamacpp_{m}"]}
    rec.extra |= {"kvtier_cached_tokens": cached["kvtier_rec"], "llamacpp_cached_tokens": cached["llamacpp_rec"]}
    hit.extra |= {"kvtier_cached_tokens": cached["kvtier_hit"], "llamacpp_cached_tokens": cached["llamacpp_hit"]}
    disk.extra |= {
        "kvtier_cached_tokens": cached["kvtier_restore"],
        "kvtier_cached_tokens_by_tier": restore_tiers,
        "llamacpp_cached_tokens": cached["llamacpp_restore"],
        "page_cache_dropped": dropped,
    }
    return [rec, hit, disk], dropped


# -------------------------------------------------------------------- main


def kvtier_binary(arg: str | None) -> Path:
    path = Path(arg) if arg else REPO / "target" / "release" / "kvtier"
    if not path.is_file():
        raise SystemExit(f"no kvtier binary at {path}: build it with cargo build --release (or pass --kvtier PATH)")
    return path.resolve()


def serve_help(binary: Path) -> str:
    out = subprocess.run([str(binary), "serve", "--help"], capture_output=True, text=True, check=True)
    text_ = out.stdout + out.stderr
    for flag in ("--no-prefix-reuse", "--cache-dir", "--port"):
        if flag not in text_:
            raise SystemExit(f"{binary} serve --help lists no {flag}: this script needs it")
    return text_


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'metric':<22} {'threads':>7} {'kvtier':>12} {'llama.cpp':>12} {'ratio':>7}"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        fmt = ".1f" if r["metric"].endswith("tok_s") else ".4f"
        lines.append(f"{r['metric']:<22} {r['threads']:>7} {r['kvtier']:>12{fmt}} {r['llamacpp']:>12{fmt}} {ratio:>7}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/bench-llamacpp",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    ap.add_argument("--json", action="store_true", help="the results as JSON on stdout (progress on stderr)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 1 repeat, a 512-token prefill, a 600-token TTFT prompt, 16 decode tokens, threads 1",
    )
    ap.add_argument("--kvtier", metavar="PATH", help="the kvtier binary (default: target/release/kvtier)")
    ap.add_argument("--threads", default=None, help="thread counts, comma-separated (default: 1,2)")
    ap.add_argument("--ttft-threads", default=None, help="thread counts of the TTFT rows (default: those of --threads)")
    ap.add_argument("--repeats", type=int, default=None, help="samples per figure, the median reported (default 3)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="prefill prompt tokens (default 2048)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="decoded tokens (default 64)")
    ap.add_argument("--ttft-tokens", type=int, default=None, help="TTFT prompt tokens (default 2000)")
    ap.add_argument("--size", default="100m", choices=["tiny", "100m"], help="make_model.py's size (default 100m)")
    ap.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="leave the page cache alone before the restarted servers",
    )
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where the logs, kvtier's G3 and llama.cpp's slot files go, on the disk to measure "
        "(default: a new temp dir, removed after a successful run)",
    )
    ap.add_argument("--keep-work", action="store_true", help="keep the work directory (logs, caches, slot files)")
    a = ap.parse_args()
    quick = {"threads": "1", "repeats": 1, "prefill_tokens": 512, "decode_tokens": 16, "ttft_tokens": 600}
    full = {"threads": "1,2", "repeats": 3, "prefill_tokens": 2048, "decode_tokens": 64, "ttft_tokens": 2000}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.threads = [int(t) for t in str(a.threads).split(",")]
    a.ttft_threads = [int(t) for t in str(a.ttft_threads).split(",")] if a.ttft_threads else a.threads
    return a


def main() -> int:
    a = parse_args()
    binary = kvtier_binary(a.kvtier)
    threads_flag = re.search(r"(^|\s)--threads\b", serve_help(binary)) is not None

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    # Every way out stops the servers (the finally blocks); SIGINT too when
    # a non-interactive shell started this in the background (ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    build = setup_llamacpp.llamacpp_build()
    hf_dir, gguf = setup_llamacpp.model(build, a.size, 0)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    if a.work_dir:
        a.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-llamacpp-", dir=a.work_dir))
    logs = work / "logs"
    logs.mkdir()
    kv = Kvtier(binary, hf_dir, logs, threads_flag)
    ctx = max(a.prefill_tokens, a.ttft_tokens) + 2 * a.decode_tokens + 64
    lc = LlamaCpp(build, gguf, logs, ctx)
    rows: list[Row] = []
    dropped: list[bool] = []
    started = time.monotonic()
    ok = False
    try:
        for t in a.threads:
            log(f"prefill and decode, {t} thread(s)")
            rows += speed_rows(kv, lc, tok, t, a, work)
        for t in a.ttft_threads:
            log(f"TTFT of a {a.ttft_tokens}-token prompt, {t} thread(s)")
            r, d = ttft_rows(kv, lc, tok, t, a, work)
            rows += r
            dropped.append(d)
        ok = True
    finally:
        Proc.stop_all()
        if a.keep_work or not ok:
            log(f"work directory (logs): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = {
        "rows": [r.as_json() for r in rows],
        "model": {
            "size": a.size,
            "dtype": "f32",
            "hf": "python/testing/make_model.py",
            "gguf": "llama.cpp convert_hf_to_gguf.py --outtype f32",
        },
        "llamacpp_build": f"llama-cpp-python {setup_llamacpp.LLAMA_CPP_PYTHON_VERSION} sdist's vendor/llama.cpp, "
        "cmake Release CPU",
        "kvtier_threads": "--threads" if threads_flag else "RAYON_NUM_THREADS",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "quick": a.quick,
        "repeats": a.repeats,
        "page_cache_dropped": bool(dropped) and all(dropped),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if a.json:
        log(table(out["rows"]))
        print(json.dumps(out, indent=2))
    else:
        print(table(out["rows"]))
        print(
            f"ratio = kvtier / llama.cpp; {a.repeats} sample(s) per figure (median); "
            f"page cache dropped before restarts: {out['page_cache_dropped']}; {out['wall_s']} s"
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted: every server this script started is stopped")
        sys.exit(130)
    finally:
        Proc.stop_all()
