"""``python -m dtq.kernels build`` compiles the CUDA kernels ahead of time (needs nvcc, no GPU);
``python -m dtq.kernels info`` prints where they are built. A module of its own: ``import dtq``
has already imported ``dtq.kernels`` by the time runpy would run it as ``__main__``."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from dtq import kernels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtq.kernels", description="Build dtq's CUDA kernels ahead of time.")
    p.add_argument("command", choices=["build", "info"])
    args = p.parse_args(argv)
    if args.command == "info":
        prebuilt = os.environ.get("DTQ_KERNEL_LIBRARY") or "unset (build here)"
        print(
            f"build dir: {kernels.build_dir()}\nDTQ_KERNEL_LIBRARY: {prebuilt}\ndisabled: {kernels.disabled()}\n"
            f"torch CUDA: {torch.version.cuda}"
        )
        return 0
    if torch.version.cuda is None:
        print("this torch has no CUDA support: nothing to build", file=sys.stderr)
        return 1
    ext = kernels._load(verbose=True)
    print(f"built {ext.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
