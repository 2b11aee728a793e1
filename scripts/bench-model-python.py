#!/usr/bin/env python3
"""Python contenders of `kvtier model bench`: one timed load of a model's
safetensors shards, with the loader's own timing printed as JSON.

Embedded in the kvtier binary (include_str!) and written next to the bench
files at run time; it can also be run by hand.

Loaders:
  safetensors  safetensors.numpy.load_file on every shard (torch-free)
  runai        runai_model_streamer.SafetensorsStreamer over all shards,
               every tensor read (owned tensors, the default)

Protocol (so that the parent process makes the page cache cold right before
the timed load, after Python and its modules have started):
  1. import the loader; in --warm mode, load everything once untimed and
     free it (with MALLOC_MMAP_MAX_=0 set by the parent, glibc keeps the
     freed memory, so the timed load writes into resident RAM);
  2. print {"ready": true} on stdout and wait for one line on stdin;
  3. load every shard, touch one byte per 4 KiB of every tensor, and print
     {"loader", "bytes", "seconds", "gbps", "tensors"}.
Any failure prints {"error": "..."} and exits with status 2.

Usage: bench-model-python.py --loader safetensors|runai [--warm] FILE...
"""

import argparse
import gc
import json
import os
import sys
import time


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def touch_np(arr, np):
    """Sum one byte per 4 KiB of `arr`'s bytes (and its last byte)."""
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size == 0:
        return 0
    return int(flat[::4096].sum(dtype=np.uint64)) + int(flat[-1])


def load_safetensors(files):
    import numpy as np
    from safetensors.numpy import load_file

    keep, nbytes, ntensors, acc = [], 0, 0, 0
    for f in files:
        tensors = load_file(f)
        for arr in tensors.values():
            nbytes += arr.nbytes
            ntensors += 1
            acc += touch_np(arr, np)
        keep.append(tensors)
    return keep, nbytes, ntensors, acc


def load_runai(files):
    import numpy as np
    from runai_model_streamer import SafetensorsStreamer

    keep, nbytes, ntensors, acc = [], 0, 0, 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(list(files))
        for _name, tensor in streamer.get_tensors():
            nbytes += tensor.numel() * tensor.element_size()
            ntensors += 1
            acc += touch_np(tensor.numpy(), np)
            keep.append(tensor)
    return keep, nbytes, ntensors, acc


LOADERS = {"safetensors": load_safetensors, "runai": load_runai}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loader", choices=sorted(LOADERS), required=True)
    ap.add_argument("--warm", action="store_true",
                    help="load once untimed first, so the timed load reuses resident RAM")
    ap.add_argument("--no-wait", action="store_true",
                    help="do not wait for a line on stdin before the timed load")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    load = LOADERS[args.loader]
    try:
        if args.loader == "safetensors":
            import safetensors.numpy  # noqa: F401
        else:
            import runai_model_streamer  # noqa: F401
        if args.warm:
            keep = load(args.files)
            del keep
            gc.collect()
    except Exception as e:  # report, do not crash the parent's bench
        emit({"error": f"{type(e).__name__}: {e}"})
        return 2
    emit({"ready": True, "pid": os.getpid()})
    if not args.no_wait and not sys.stdin.readline():
        emit({"error": "parent closed stdin before the timed load"})
        return 2
    try:
        t0 = time.perf_counter()
        keep, nbytes, ntensors, acc = load(args.files)
        secs = time.perf_counter() - t0
    except Exception as e:
        emit({"error": f"{type(e).__name__}: {e}"})
        return 2
    file_bytes = sum(os.path.getsize(f) for f in args.files)
    emit({
        "loader": args.loader,
        "warm": args.warm,
        "bytes": file_bytes,
        "tensor_bytes": nbytes,
        "tensors": ntensors,
        "seconds": secs,
        "gbps": file_bytes / secs / 1e9 if secs > 0 else 0.0,
        "checksum": acc,
    })
    del keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
