#!/usr/bin/env python3
"""Two `kvtier serve` processes share one G4 pool (a redis-server this script
starts on 127.0.0.1): server A serves a long prompt, server B (its own G2/G3)
then gets the same prompt and restores its KV from G4. B's TTFT restored from
G4 is printed beside B's TTFT recomputing a prompt of the same length, and
A's and B's greedy outputs are compared.

    cargo build --release -p kvtier
    python3 scripts/bench-g4-ttft.py [--tokens 4096] [--preset small]

Needs redis-server on PATH (./scripts/test installs it). Everything lives in
a temporary directory, removed at the end. TTFT is the server's own figure
(`kvtier.ttft_seconds`: request admitted to first token), so HTTP client
overhead is not in it.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_cmd(port, *args):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        msg = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
        s.sendall(msg.encode())
        return s.recv(4096).decode(errors="replace")


def start_serve(binary, model, cache, url, block_tokens, log):
    p = subprocess.Popen(
        [binary, "serve", "--model", model, "--cache-dir", cache, "--port", "0",
         "--block-tokens", str(block_tokens), "--max-seq-tokens", "8192",
         "--remote", url],
        stdout=subprocess.PIPE, stderr=log, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("listening on http://"):
        p.kill()
        sys.exit(f"server did not start: {line!r}; see {log.name}")
    return p, line.removeprefix("listening on ")


def complete(base, prompt):
    body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def prompt_of(tag, tokens):
    # The small preset's tokenizer is byte-level: one byte is one token.
    base = f"[{tag}] The quick brown fox jumps over the lazy dog; kvtier keeps KV. "
    return (base * (tokens // len(base) + 1))[:tokens]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/kvtier"))
    a = ap.parse_args()
    redis_bin = shutil.which("redis-server") or shutil.which("valkey-server")
    if not redis_bin:
        sys.exit("redis-server not found (./scripts/test installs it)")
    tmp = tempfile.mkdtemp(prefix="kvtier-g4-ttft-")
    procs = []
    try:
        model = os.path.join(tmp, "model")
        subprocess.run([a.binary, "model", "init", "--preset", a.preset, model],
                       check=True, stdout=subprocess.DEVNULL)
        rport = free_port()
        procs.append(subprocess.Popen(
            [redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for _ in range(100):
            try:
                if "PONG" in redis_cmd(rport, "PING"):
                    break
            except OSError:
                time.sleep(0.05)
        url = f"redis://127.0.0.1:{rport}"
        logs = [open(os.path.join(tmp, f"serve-{n}.log"), "w") for n in "ab"]
        pa, base_a = start_serve(a.binary, model, os.path.join(tmp, "cache-a"), url,
                                 a.block_tokens, logs[0])
        procs.append(pa)
        pb, base_b = start_serve(a.binary, model, os.path.join(tmp, "cache-b"), url,
                                 a.block_tokens, logs[1])
        procs.append(pb)

        recompute = complete(base_b, prompt_of("B alone", a.tokens))
        served_a = complete(base_a, prompt_of("shared", a.tokens))
        full_blocks = a.tokens // a.block_tokens
        deadline = time.time() + 120
        while int(redis_cmd(rport, "DBSIZE").strip(":\r\n") or 0) < full_blocks:
            if time.time() > deadline:
                sys.exit("A never wrote its blocks to G4")
            time.sleep(0.1)
        restored = complete(base_b, prompt_of("shared", a.tokens))

        kb = restored["kvtier"]
        rows = [
            ("B recompute", recompute["kvtier"]),
            ("A compute (writes G4)", served_a["kvtier"]),
            ("B restored from G4", kb),
        ]
        print(f"prompt: {a.tokens} tokens, preset {a.preset}, {a.block_tokens}-token blocks")
        print(f"{'run':<24} {'TTFT s':>8} {'cached g4':>10} {'restored MiB':>13}")
        for name, k in rows:
            print(f"{name:<24} {k['ttft_seconds']:>8.3f} {k['cached_tokens']['g4']:>10} "
                  f"{k['restored_bytes'] / 2**20:>13.1f}")
        ratio = recompute["kvtier"]["ttft_seconds"] / kb["ttft_seconds"]
        same = served_a["choices"][0]["text"] == restored["choices"][0]["text"]
        print(f"B: recompute / restored TTFT = {ratio:.1f}x; "
              f"greedy output identical to A's: {same}")
        print(json.dumps({"tokens": a.tokens, "preset": a.preset,
                          "b_recompute_ttft_s": recompute["kvtier"]["ttft_seconds"],
                          "b_restored_ttft_s": kb["ttft_seconds"],
                          "b_cached_g4_tokens": kb["cached_tokens"]["g4"],
                          "restored_bytes": kb["restored_bytes"],
                          "identical_output": same}))
        if not same:
            sys.exit(1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
