"""scripts/bench-vllm: the cold-recovery workload on a real vLLM, three ways
in one run.

Sessions as ``kvtier bench`` makes them: a shared system prefix, the
session's own history and a short question (about 2k tokens). Every
(mode, concurrency) row is measured on a vLLM started for it, after the
page cache was dropped, with its own set of sessions, none of which that
server has seen (nothing of another row in vLLM's own cache, G1): the
burst of a level is the first traffic after a restart, as when a node
comes back. The ways:

- ``recompute``: vLLM alone (prefix caching on): everything is computed;
- ``example``: vLLM's in-tree ExampleConnector, filled by an earlier vLLM
  process, restoring after the restart;
- ``kvtier``: kvtier's connector, filled by an earlier vLLM process,
  restoring from G3 after the restart;
- ``local`` (not in the default ``--modes``): the floor, vLLM alone with
  the level's sessions already in its own prefix cache (sent once, one at
  a time, before the burst), so only the uncached tail of each prompt is
  computed;
- ``kvtier-sync`` and ``kvtier-layerwise`` (not in the default
  ``--modes``): kvtier restoring inside the step that needs the KV
  (``load_async`` false), whole before the forward pass, or layer by layer
  with each layer's attention waiting for that layer only. The kvtier
  modes of one run share one fill.

``--repeat N`` measures every row N times, the modes of a level one after
the other (interleaved), and reports each row's median and spread. Each row
says how many prompt tokens came from the connector
(``external_hit_tokens``) and how many vLLM found in its own cache
(``local_hit_tokens``). Energy is modelled as in kvtier-energy (40 W idle +
10 W per busy core, from /proc/stat over each batch): an assumption,
labelled so.

``--model-kind`` picks the model (make_model.py, at ``--size``): ``llama``
(the default, today's model), ``hybrid`` (Gemma-2: sliding-window and
full-attention layers alternating, a 64-token window; servers with
kvtier's connector run vLLM's hybrid KV cache manager, which vLLM turns
off for ExampleConnector) or ``mla`` (DeepSeek-V2 with ``kv_lora_rank``
512: vLLM turns its own prefix cache off for MLA on the CPU, so the
``local_hit_tokens`` are 0 and ``local`` is recompute). ``--tp N`` runs
every server at tensor-parallel degree N. Both are in the JSON's
``workload`` and the table's header, with notes on what they change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))

from make_model import SIZES, SLIDING_WINDOW, make, text
from vllm_server import Reply, VllmServer, example_transfer_config, kvtier_transfer_config

#: The kvtier modes: connector settings of each (``--kvtier-config`` is
#: merged over them).
KVTIER_MODES: dict[str, dict[str, Any]] = {
    "kvtier": {},
    "kvtier-sync": {"load_async": False, "layerwise_load": False},
    "kvtier-layerwise": {"load_async": False},
}

#: ``--model-kind``: make_model's arch of each.
MODEL_KINDS = {"llama": "llama", "hybrid": "gemma2", "mla": "deepseek_v2"}

IDLE_WATTS = 40.0
WATTS_PER_BUSY_CORE = 10.0


@dataclass
class Result:
    """One (mode, concurrency) batch."""

    mode: str
    concurrency: int
    #: Which repetition (0-based) of the row this is.
    run: int
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float
    #: Prompt tokens the connector provided.
    external_hit_tokens: int
    #: Prompt tokens vLLM found in its own prefix cache (G1).
    local_hit_tokens: int
    restored_gb: float
    restore_gb_s: float
    joules_per_token: float
    wall_s: float


def sessions(first: int, count: int, shared_words: int, history_words: int, question_words: int) -> list[str]:
    """``count`` session prompts; ids from ``first``. One word is about one
    token with make_model's tokenizer."""
    shared = "System: you answer questions about storage for inference. " + text(7, shared_words)
    return [
        f"{shared}\nSession {i} history: {text(1000 + i, history_words)}\nQuestion: {text(5000 + i, question_words)}"
        for i in range(first, first + count)
    ]


def _busy_core_s() -> float:
    with open("/proc/stat") as f:
        cpu = f.readline().split()[1:]
    v = [int(x) for x in cpu]
    # user nice system idle iowait irq softirq steal
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def run_batch(
    server: VllmServer, mode: str, run: int, prompts: list[str], concurrency: int, max_tokens: int, bytes_per_token: int
) -> tuple[Result, list[str]]:
    """Sends ``prompts`` with ``concurrency`` in flight; one Result and the
    outputs in prompt order."""
    before = server.metrics()
    busy0, t0 = _busy_core_s(), time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        replies: list[Reply] = list(pool.map(lambda p: server.complete(p, max_tokens=max_tokens), prompts))
    wall = time.monotonic() - t0
    busy = _busy_core_s() - busy0
    time.sleep(1.5)  # the API server's stats interval
    after = server.metrics()
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out_tokens = sum(r.completion_tokens for r in replies)
    ttfts = [r.ttft_s for r in replies]
    ext = int(d.get("vllm:external_prefix_cache_hits_total", 0))
    local = int(d.get("vllm:prefix_cache_hits_total", 0))
    restored_gb = ext * bytes_per_token / 1e9
    load_s = d.get("vllm:kvtier_load_s_total", 0.0)
    joules = IDLE_WATTS * wall + WATTS_PER_BUSY_CORE * busy
    res = Result(
        mode=mode,
        concurrency=concurrency,
        run=run,
        ttft_p50_s=statistics.median(ttfts),
        ttft_p99_s=_pct(ttfts, 0.99),
        throughput_tok_s=out_tokens / wall if wall > 0 else 0.0,
        external_hit_tokens=ext,
        local_hit_tokens=local,
        restored_gb=restored_gb,
        restore_gb_s=(restored_gb / load_s) if load_s > 0 else 0.0,
        joules_per_token=joules / out_tokens if out_tokens else 0.0,
        wall_s=wall,
    )
    return res, [r.text for r in replies]


def kv_bytes_per_token(kind: str, size: str) -> int:
    """The f32 KV bytes a prompt token takes in vLLM's cache (one copy, all
    layers): ``llama`` K and V of every layer; ``hybrid`` the
    full-attention layers only (the sliding ones keep one window per
    request with the hybrid manager, whatever the prompt: restored GB is
    then a lower bound);
    ``mla`` one latent row of 576 values per layer."""
    dims = SIZES[size]
    layers = dims["num_hidden_layers"]
    if kind == "mla":
        return layers * (512 + 64) * 4
    if kind == "hybrid":
        # make_model's gemma2: head_dim 64, layers sliding, full, sliding, ...
        return (layers // 2) * 2 * dims["num_key_value_heads"] * 64 * 4
    head = dims["hidden_size"] // dims["num_attention_heads"]
    return layers * 2 * dims["num_key_value_heads"] * head * 4


def kind_notes(kind: str, tp: int, modes: list[str]) -> tuple[dict[str, str], list[str]]:
    """What ``--model-kind`` and ``--tp`` change: vLLM's hybrid KV cache
    manager in each mode (hybrid only) and notes for the report."""
    hybrid: dict[str, str] = {}
    notes: list[str] = []
    if kind == "hybrid":
        for m in modes:
            if m in KVTIER_MODES:
                hybrid[m] = "on (--no-disable-hybrid-kv-cache-manager)"
            elif m == "example":
                hybrid[m] = "off (vLLM turns it off: ExampleConnector does not support it)"
            else:
                hybrid[m] = "on (vLLM's default, no connector)"
        notes.append(
            f"hybrid: Gemma-2, sliding window {SLIDING_WINDOW} tokens on every other layer; "
            "kv_bytes_per_token counts the full-attention layers only (a lower bound of restored GB; "
            "ExampleConnector, without the hybrid manager, restores every layer: twice that)"
        )
    if kind == "mla":
        notes.append(
            "mla: vLLM turns its own prefix cache (and chunked prefill) off for MLA on the CPU: "
            "local_hit_tokens are 0 by construction and the local mode is recompute"
        )
    if tp > 1:
        notes.append(f"tp {tp}: one CPU per rank (VLLM_CPU_OMP_THREADS_BIND)")
        if "example" in modes and kind != "mla":
            notes.append(
                "ExampleConnector names its files by layer, not by rank: at tp > 1 the ranks' "
                "halves of a layer overwrite each other, so its restores may differ"
            )
    return hybrid, notes


def drop_caches() -> bool:
    """Drops the page cache (root only); whether it could."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@dataclass
class Row:
    """One (mode, concurrency) over its runs: TTFT p50 median and spread."""

    mode: str
    concurrency: int
    runs: int
    ttft_p50_median_s: float
    ttft_p50_min_s: float
    ttft_p50_max_s: float
    throughput_median_tok_s: float


def summarize(results: list[Result]) -> list[Row]:
    """Each (mode, concurrency)'s runs as one :class:`Row`, in first-seen
    order."""
    keys = list(dict.fromkeys((r.mode, r.concurrency) for r in results))
    rows = []
    for mode, c in keys:
        rs = [r for r in results if r.mode == mode and r.concurrency == c]
        p50 = [r.ttft_p50_s for r in rs]
        rows.append(Row(mode, c, len(rs), statistics.median(p50), min(p50), max(p50),
                        statistics.median(r.throughput_tok_s for r in rs)))  # fmt: skip
    return rows


def gates(rows: list[Row], levels: list[int], identical: bool) -> list[dict[str, Any]]:
    """The gates, on the medians: at the top concurrency recompute / kvtier
    above the brief's 12.6 and kvtier within 1.2x of vLLM's own cache
    (``local``); at every level kvtier below ExampleConnector; identical
    greedy outputs."""

    def get(mode: str, c: int) -> Row | None:
        return next((r for r in rows if r.mode == mode and r.concurrency == c), None)

    out: list[dict[str, Any]] = []
    top = max(levels)
    k, rc, loc = get("kvtier", top), get("recompute", top), get("local", top)
    if k and rc:
        ratio = rc.ttft_p50_median_s / k.ttft_p50_median_s
        name = f"TTFT p50 at concurrency {top}: recompute / kvtier > 12.6 (the brief's 149.5 s -> 11.85 s)"
        out.append({"name": name, "value": ratio, "passed": ratio > 12.6})
    for c in levels:
        k, ex = get("kvtier", c), get("example", c)
        if k and ex:
            ratio = ex.ttft_p50_median_s / k.ttft_p50_median_s
            out.append({"name": f"TTFT p50 at concurrency {c}: ExampleConnector / kvtier > 1",
                        "value": ratio, "passed": ratio > 1.0})  # fmt: skip
    k = get("kvtier", top)
    if k and loc:
        ratio = k.ttft_p50_median_s / loc.ttft_p50_median_s
        out.append({"name": f"TTFT p50 at concurrency {top}: kvtier / vLLM's own cache (local) <= 1.2",
                    "value": ratio, "passed": ratio <= 1.2})  # fmt: skip
    out.append({"name": "identical greedy outputs in every mode", "value": identical, "passed": identical})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="scripts/bench-vllm",
        description="Cold recovery on a real vLLM: recompute vs ExampleConnector vs kvtier's connector, "
        "every row on a vLLM just restarted.",
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    ap.add_argument("--size", choices=sorted(SIZES), default="100m", help="model size (make_model.py)")
    ap.add_argument(
        "--model-kind",
        choices=sorted(MODEL_KINDS),
        default="llama",
        help="llama: today's model (100m: 12 layers, hidden 768, about 76 M parameters); "
        "hybrid: Gemma-2, sliding-window (64 tokens) and full-attention layers alternating, "
        "the same dims (100m: about 76 M), vLLM's hybrid KV cache manager on with kvtier's connector "
        "(vLLM turns it off for ExampleConnector); "
        "mla: DeepSeek-V2 MLA, kv_lora_rank 512 + rope 64 (vLLM's CPU MLA takes no other), "
        "the same layers, hidden and MLP (100m: about 94 M), vLLM's own prefix cache off on the CPU "
        "(default: llama)",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of every server (default: 1)")
    ap.add_argument("--concurrency", default="1,8,16", help="comma-separated concurrencies")
    ap.add_argument("--sessions", type=int, default=16, help="sessions per concurrency")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every row (the modes of a level interleaved); medians and spread reported",
    )
    ap.add_argument("--shared-words", type=int, default=1000)
    ap.add_argument("--history-words", type=int, default=900)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--modes",
        default="recompute,example,kvtier",
        help="comma-separated: recompute, example, kvtier, kvtier-sync, kvtier-layerwise, local",
    )
    ap.add_argument("--work-dir", type=Path, default=None, help="where the model and caches go (default: a temp dir)")
    ap.add_argument(
        "--kvtier-config",
        default="{}",
        help="JSON merged into the connector's kv_connector_extra_config, e.g. '{\"load_async\": false}'",
    )
    ap.add_argument(
        "--example-prefix-caching",
        action="store_true",
        help="run ExampleConnector with vLLM's prefix caching on (it crashes vLLM at concurrency > 1)",
    )
    ap.add_argument("--enforce-gates", action="store_true", help="exit 1 if a gate fails")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    if a.tp < 1:
        ap.error("--tp must be at least 1")

    work = a.work_dir or Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    # The kind (and for the caches the degree) in every name: a reused
    # --work-dir never mixes models or layouts.
    tag = f"{a.model_kind}-{a.size}"
    model = work / f"model-{tag}"
    if not (model / "config.json").exists():
        if a.model_kind == "llama":
            make(model, a.size, seed=0)
        else:
            make(model, a.size, seed=0, arch=MODEL_KINDS[a.model_kind])
    bytes_per_token = kv_bytes_per_token(a.model_kind, a.size)
    levels = [int(c) for c in a.concurrency.split(",")]
    modes = a.modes.split(",")
    hybrid_manager, notes = kind_notes(a.model_kind, a.tp, modes)
    sets = {c: sessions(i * a.sessions, a.sessions, a.shared_words, a.history_words, a.question_words)
            for i, c in enumerate(levels)}  # fmt: skip
    all_prompts = [p for c in levels for p in sets[c]]
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    kv_space = 4
    results: list[Result] = []
    outputs: dict[str, list[str]] = {}
    dropped = True

    def log(msg: str) -> None:
        print(f"[bench-vllm] {msg}", file=sys.stderr, flush=True)

    def server_args(mode: str) -> tuple[str | None, list[str]]:
        """A mode's ``--kv-transfer-config`` and extra flags."""
        cfg: str | None
        if mode in ("recompute", "local"):
            cfg = None
        elif mode == "example":
            cfg = example_transfer_config(str(work / f"example-cache-{tag}-tp{a.tp}"))
        elif mode in KVTIER_MODES:
            cfg = kvtier_transfer_config(
                {
                    "cache_dir": str(work / f"kvtier-cache-{tag}-tp{a.tp}"),
                    "g3_bytes": 16 << 30,
                    **KVTIER_MODES[mode],
                    **json.loads(a.kvtier_config),
                }
            )
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        # ExampleConnector with vLLM's prefix caching crashes the engine as
        # soon as a request's prefix is partly in vLLM's own cache and
        # partly in its files (seen here: "shape mismatch: value tensor of
        # shape [1152, 2, 128] cannot be broadcast to indexing result of
        # shape [1920, 2, 128]" at concurrency 4); without prefix caching
        # it loads each whole prompt from its file.
        args = ["--no-enable-prefix-caching"] if mode == "example" and not a.example_prefix_caching else []
        return cfg, args

    def server(mode: str, log_name: str, cfg: str | None, args: list[str]) -> VllmServer:
        """A mode's vLLM at ``--tp``; with kvtier's connector on the hybrid
        model, vLLM's hybrid KV cache manager on (vLLM decides otherwise)."""
        hybrid = True if a.model_kind == "hybrid" and mode in KVTIER_MODES else None
        return VllmServer(str(model), logs / log_name, cfg, kv_space_gb=kv_space, extra_args=args, tp=a.tp,
                          hybrid=hybrid)  # fmt: skip

    # Fill each connector's store once, every level's sessions, in a vLLM
    # process of its own.
    filled: set[str] = set()
    for mode in modes:
        cfg, args = server_args(mode)
        kind = "kvtier" if mode in KVTIER_MODES else mode
        if cfg is None or kind in filled:
            continue
        filled.add(kind)
        log(f"{mode}: filling ({len(all_prompts)} sessions)")
        # A clean stop (vLLM kills its worker at once on SIGTERM without
        # --shutdown-timeout): kvtier's connector then waits for the last
        # request's save, which a kill could lose (recomputed, not restored).
        stop = ["--shutdown-timeout", "60"] if kind == "kvtier" else []
        with server(mode, f"{kind}-fill.log", cfg, args + stop) as s:
            # One at a time: ExampleConnector saves a prompt whose
            # prefill was split across steps as its first chunk only,
            # and then crashes vLLM loading it ("shape mismatch: value
            # tensor of shape [128, 2, 128] cannot be broadcast to
            # indexing result of shape [1920, 2, 128]", seen here).
            for p in all_prompts:
                s.complete(p, max_tokens=1)

    outs: dict[tuple[str, int], list[str]] = {}
    for run in range(a.repeat):
        for c in levels:
            for mode in modes:
                cfg, args = server_args(mode)
                dropped = drop_caches() and dropped
                log(f"{mode} c={c} run {run + 1}/{a.repeat}: measuring after a restart")
                name = f"{mode}-c{c}-run{run}.log"
                with server(mode, name, cfg, args) as s:
                    s.complete(text(99, 100), max_tokens=1)  # the first request's one-off delay
                    if mode == "local":
                        # The floor: the level's sessions already in vLLM's
                        # own prefix cache (G1), nothing to restore.
                        for p in sets[c]:
                            s.complete(p, max_tokens=1)
                    r, o = run_batch(s, mode, run, sets[c], c, a.max_tokens, bytes_per_token)
                log(f"{mode} c={c}: TTFT p50 {r.ttft_p50_s:.3f} s, {r.throughput_tok_s:.1f} tok/s, "
                    f"external hits {r.external_hit_tokens}, local hits {r.local_hit_tokens}")  # fmt: skip
                results.append(r)
                outs.setdefault((mode, c), o)
    for mode in modes:
        outputs[mode] = [t for c in levels for t in outs[(mode, c)]]
    identical = all(outputs[m] == outputs[modes[0]] for m in modes)
    # Which modes gave the same greedy outputs (vLLM's CPU MLA path is not
    # batch-invariant, and ExampleConnector mixes ranks at TP > 1: the
    # groups say which modes agree where not all do).
    agree: list[list[str]] = []
    for m in modes:
        same = next((g for g in agree if outputs[g[0]] == outputs[m]), None)
        if same is None:
            agree.append([m])
        else:
            same.append(m)
    rows = summarize(results)
    gate_list = gates(rows, levels, identical)

    report = {
        "results": [asdict(r) for r in results],
        "rows": [asdict(r) for r in rows],
        "identical_outputs": identical,
        "modes_with_equal_outputs": agree,
        "gates": gate_list,
        "page_cache_dropped": dropped,
        "energy": f"modelled: {IDLE_WATTS:.0f} W idle + {WATTS_PER_BUSY_CORE:.0f} W per busy core",
        "workload": {
            "model": a.size, "model_kind": a.model_kind, "arch": MODEL_KINDS[a.model_kind], "tp": a.tp,
            "hybrid_kv_cache_manager": hybrid_manager, "notes": notes,
            "sessions_per_concurrency": a.sessions, "repeat": a.repeat,
            "prompt_tokens_about": a.shared_words + a.history_words + a.question_words,
            "max_tokens": a.max_tokens, "kv_bytes_per_token": bytes_per_token,
            "every_row_after_a_restart": True,
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    lines = [f"model {a.size}, kind {a.model_kind} ({MODEL_KINDS[a.model_kind]}), tp {a.tp}"]
    lines += [f"hybrid KV cache manager, {m}: {v}" for m, v in hybrid_manager.items()]
    lines += [f"note: {n}" for n in notes]
    lines += ["",
              "| mode | conc | run | TTFT p50 s | TTFT p99 s | out tok/s | ext hit tokens | local hit tokens "
              "| restore GB/s | J/token |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r.mode} | {r.concurrency} | {r.run} | {r.ttft_p50_s:.3f} | {r.ttft_p99_s:.3f} | "
        f"{r.throughput_tok_s:.1f} | {r.external_hit_tokens} | {r.local_hit_tokens} | "
        f"{r.restore_gb_s:.2f} | {r.joules_per_token:.3f} |"
        for r in results
    ]
    if a.repeat > 1:
        lines += ["", "| mode | conc | runs | TTFT p50 median s | min | max |", "|---|---|---|---|---|---|"]
        for w in rows:
            lines.append(f"| {w.mode} | {w.concurrency} | {w.runs} | {w.ttft_p50_median_s:.3f} | "
                         f"{w.ttft_p50_min_s:.3f} | {w.ttft_p50_max_s:.3f} |")  # fmt: skip

    def row(mode: str, c: int) -> Row | None:
        return next((w for w in rows if w.mode == mode and w.concurrency == c), None)

    for c in levels:
        k, rc, ex, loc = row("kvtier", c), row("recompute", c), row("example", c), row("local", c)
        if not k:
            continue
        parts = []
        if rc:
            parts.append(f"recompute/kvtier x{rc.ttft_p50_median_s / k.ttft_p50_median_s:.2f}")
        if ex:
            parts.append(f"example/kvtier x{ex.ttft_p50_median_s / k.ttft_p50_median_s:.2f}")
        if loc:
            parts.append(f"kvtier/local x{k.ttft_p50_median_s / loc.ttft_p50_median_s:.2f}")
        if rc:
            parts.append(f"throughput kvtier/recompute x{k.throughput_median_tok_s / rc.throughput_median_tok_s:.2f}")
        if parts:
            lines.append(f"concurrency {c}: TTFT p50 " + ", ".join(parts))
    for c in levels:
        sync, lw = row("kvtier-sync", c), row("kvtier-layerwise", c)
        if sync and lw:
            lines.append(f"concurrency {c}: TTFT p50 kvtier-sync/kvtier-layerwise "
                         f"x{sync.ttft_p50_median_s / lw.ttft_p50_median_s:.3f}")  # fmt: skip
    lines.append(f"identical outputs: {identical}" + ("" if identical else f" (equal: {agree})"))
    for g in gate_list:
        lines.append(f"gate {'PASS' if g['passed'] else 'FAIL'}: {g['name']} ({g['value']})")
    print("\n".join(lines), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(report, indent=2))
    if a.enforce_gates and not all(g["passed"] for g in gate_list):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
