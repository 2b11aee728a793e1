"""``python -m kvtier.bench {load,restore,gpu-restore}``: see :mod:`kvtier.bench`."""

from __future__ import annotations

import argparse
import sys

from . import gpu_restore, load, restore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    load.add_arguments(sub.add_parser("load", help=load.__doc__.splitlines()[0] if load.__doc__ else None))
    restore.add_arguments(sub.add_parser("restore", help=restore.__doc__.splitlines()[0] if restore.__doc__ else None))
    gpu_restore.add_arguments(
        sub.add_parser("gpu-restore", help=gpu_restore.__doc__.splitlines()[0] if gpu_restore.__doc__ else None)
    )
    child = sub.add_parser("_child", help=argparse.SUPPRESS)
    child.add_argument("loader")
    child.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    if args.command == "load":
        return load.run(args)
    if args.command == "restore":
        return restore.run(args)
    if args.command == "gpu-restore":
        return gpu_restore.run(args)
    return load.child(args.loader, args.files)


if __name__ == "__main__":
    sys.exit(main())
