"""Where the example trainer's step time goes on the host: runs ``launch/train.py`` (same
arguments) under cProfile and prints the functions with the most time per training step, so a
host-bound step (GPU idle between kernels) shows what to cut.

    python bench/profile_train.py --top 40 -- --config launch/configs/llama300m.toml --recipe fp8 \\
        --set train.steps=20 --out-dir /tmp/prof

Profiling slows Python code about twofold; read the rows relative to each other.
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--dump", default="", help="also write the raw pstats here")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: launch/train.py's arguments")
    args = p.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    from dtq.launch import train

    prof = cProfile.Profile()
    prof.enable()
    train.main(train_args)
    prof.disable()
    if args.dump:
        prof.dump_stats(args.dump)
    stats = pstats.Stats(prof)
    for key in ("cumulative", "tottime"):
        print(f"\n=== by {key}")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
