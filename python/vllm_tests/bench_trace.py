"""scripts/bench-trace: a public trace replayed live (``kvtier trace
replay``) against two pairs of servers on this machine, each with a restart
halfway:

* ``kvtier``: ``kvtier serve`` (the embedded ``small`` preset) against the
  same server with ``--no-prefix-reuse``;
* ``vllm``: vLLM (CPU) with kvtier's connector against vLLM with its own
  prefix cache only.

Every server runs under a small supervisor (``start`` / ``restart`` below,
the replay's ``--restart-cmd``): a restart stops the server's whole process
group with SIGTERM, waits for it, and starts the same command again on the
same port and cache directory. The two servers of a pair are up together;
the replay drives one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))


from vllm_server import free_port, kvtier_transfer_config, vllm_command


def start(state: Path) -> int:
    """Starts the command in ``state/cmd.json`` (``argv``, ``env``,
    ``log``) in a process group of its own; records and returns its pid."""
    spec = json.loads((state / "cmd.json").read_text())
    with open(spec["log"], "ab") as log:
        proc = subprocess.Popen(
            spec["argv"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=spec["env"],
            start_new_session=True,
        )
    (state / "pid").write_text(str(proc.pid))
    return proc.pid


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still answers: ask /proc whether anyone runs.
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pid and fields[0] != "Z":
            return True
    return False


def stop(state: Path, timeout: float = 180) -> None:
    """SIGTERM to the recorded process group, then waits for it to end
    (SIGKILL past ``timeout``)."""
    pid = int((state / "pid").read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _group_alive(pid):
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.2)


def restart(state: Path) -> int:
    """Stops the server and starts it again."""
    stop(state)
    return start(state)


def supervise(state: Path, argv: list[str], env: dict[str, str], log: Path) -> None:
    """Records a server's command in ``state`` and starts it."""
    state.mkdir(parents=True, exist_ok=True)
    (state / "cmd.json").write_text(json.dumps({"argv": argv, "env": env, "log": str(log)}))
    start(state)


def wait_ready(state: Path, timeout: float = 600) -> None:
    """Until the server of ``state`` answers ``/v1/models``; an error if it
    exits first."""
    url = (state / "url").read_text()
    pid = int((state / "pid").read_text())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _group_alive(pid):
            log = Path(json.loads((state / "cmd.json").read_text())["log"])
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"the server of {state.name} exited while starting:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not start in {timeout} s")


def replay(kvtier: str, trace: str, work: Path, name: str, a: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """Runs ``kvtier trace replay`` for one pair (``work/name/kvtier`` and
    ``work/name/baseline`` are the supervisors' state)."""
    states = work / name
    restart = [sys.executable, __file__, "restart"]
    restart_cmd = f"{shlex.join(restart)} {shlex.quote(str(states))}/$KVTIER_REPLAY_SERVER"
    out = work / "results" / name
    cmd = [
        kvtier, "trace", "replay", trace,
        "--endpoint", (states / "kvtier" / "url").read_text(),
        "--baseline-endpoint", (states / "baseline" / "url").read_text(),
        "--sample", a.sample,
        "--time-scale", str(a.time_scale), "--max-output-tokens", str(a.max_output_tokens),
        "--restart-cmd", restart_cmd, "--restart-at", str(a.restart_at),
        "--out", str(out), "--json",
    ]  # fmt: skip
    if a.max_requests:
        cmd += ["--max-requests", str(a.max_requests)]
    cmd += extra
    print(f"[bench-trace] {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, check=True)
    report: dict[str, Any] = json.loads(done.stdout)
    report["command"] = shlex.join(cmd)
    report["results"] = str(out)
    return report


def pair(work: Path, name: str, servers: dict[str, tuple[list[str], dict[str, str], int]]) -> None:
    """Starts a pair of servers under supervisors and waits for both."""
    for mode, (argv, env, port) in servers.items():
        state = work / name / mode
        supervise(state, argv, env, work / "logs" / f"{name}-{mode}.log")
        (state / "url").write_text(f"http://127.0.0.1:{port}")
    for mode in servers:
        wait_ready(work / name / mode)


def stop_pair(work: Path, name: str) -> None:
    for mode in ("kvtier", "baseline"):
        state = work / name / mode
        if (state / "pid").exists():
            stop(state)


def kvtier_part(kvtier: str, trace: str, work: Path, a: argparse.Namespace, block_tokens: int) -> dict[str, Any]:
    model = work / "small"
    if not (model / "config.json").exists():
        subprocess.run(
            [kvtier, "model", "init", "--preset", "small", str(model)], check=True, stdout=subprocess.DEVNULL
        )
    env = dict(os.environ)

    def serve(port: int, flags: list[str]) -> list[str]:
        return [kvtier, "serve", str(model), "--model-name", "small", "--port", str(port),
                "--block-tokens", str(block_tokens), *flags]  # fmt: skip

    p1, p2 = free_port(), free_port()
    servers = {
        # G1 smaller than the cut, so G2 serves too; G3 filled by G2's
        # evictions and the clean stop only (no timer), so the simulator
        # of the server's tiers can follow it.
        "kvtier": (
            serve(p1, ["--cache-dir", str(work / "kvtier-cache"), "--pool-pages", "1024", "--g3-sync-ms", "0"]),
            env,
            p1,
        ),
        "baseline": (serve(p2, ["--cache-dir", str(work / "baseline-cache"), "--no-prefix-reuse"]), env, p2),
    }
    pair(work, "kvtier", servers)
    try:
        return replay(kvtier, trace, work, "kvtier", a, ["--block-tokens", str(block_tokens)])
    finally:
        stop_pair(work, "kvtier")


def vllm_part(kvtier: str, trace: str, work: Path, a: argparse.Namespace, block_tokens: int) -> dict[str, Any]:
    from make_model import make

    model = work / "model-100m"
    if not (model / "config.json").exists():
        make(model, "100m", seed=0)
    p1, p2 = free_port(), free_port()
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens.
    vllm_block = -(-block_tokens // 32) * 32
    common = ["--enable-prompt-tokens-details", "--block-size", str(vllm_block)]
    connector = kvtier_transfer_config({"cache_dir": str(work / "vllm-kvtier-cache"), "g3_bytes": 16 << 30})
    # A clean stop waits for the last request's save (vLLM kills its
    # worker at once on SIGTERM without a shutdown timeout).
    argv1, env1 = vllm_command(str(model), p1, connector, 4, a.max_model_len,
                               [*common, "--shutdown-timeout", "60"])  # fmt: skip
    argv2, env2 = vllm_command(str(model), p2, None, 4, a.max_model_len, common)
    pair(work, "vllm", {"kvtier": (argv1, env1, p1), "baseline": (argv2, env2, p2)})
    try:
        return replay(kvtier, trace, work, "vllm", a, ["--block-tokens", str(block_tokens), "--token-ids", "3..256"])
    finally:
        stop_pair(work, "vllm")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] in ("start", "restart", "stop"):
        state = Path(sys.argv[2])
        {"start": start, "restart": restart, "stop": stop}[sys.argv[1]](state)
        return 0
    ap = argparse.ArgumentParser(prog="scripts/bench-trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvtier", required=True, help="the kvtier binary")
    ap.add_argument("--trace", required=True, help="the trace (default in scripts/bench-trace)")
    ap.add_argument("--parts", default="kvtier,vllm", help="comma-separated: kvtier, vllm")
    ap.add_argument("--sample", default="1/48", help="share of the trace's conversations replayed")
    ap.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help="tokens a trace block becomes (Mooncake's 512 x 1/32); also the servers' block size",
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=0.15,
        help="multiplies the trace's arrival gaps (0.15: more than the no-reuse server keeps up with)",
    )
    ap.add_argument("--max-requests", type=int, default=100, help="at most this many requests (0: the whole sample)")
    ap.add_argument("--max-output-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=4096, help="vLLM's context length (the 100 M model's)")
    ap.add_argument("--restart-at", type=float, default=0.5)
    ap.add_argument("--work-dir", type=Path, default=None, help="models, caches, logs, results (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the reports as one JSON object on stdout")
    a = ap.parse_args()
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="kvtier-bench-trace-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    block_tokens = a.block_tokens
    parts = {"kvtier": kvtier_part, "vllm": vllm_part}
    reports: dict[str, Any] = {}
    for name in a.parts.split(","):
        if name not in parts:
            ap.error(f"unknown part {name!r}")
        reports[name] = parts[name](a.kvtier, a.trace, work, a, block_tokens)
        for line in (Path(reports[name]["results"]) / "report.txt").read_text().splitlines():
            print(f"[bench-trace] {name}: {line}", file=sys.stderr)
    if a.json:
        print(json.dumps(reports, indent=2))
    print(f"[bench-trace] work dir: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
