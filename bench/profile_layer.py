"""Where the time of one dtq layer step goes: torch.profiler over forward + backward of a
Llama-3-8B-shaped Linear or SwiGLU MLP under a recipe, the top CUDA kernels and CPU ops by time.

    python bench/profile_layer.py --recipe fp8 [--layer mlp] [--tokens 8192 --hidden 4096 --ffn 14336]
    python bench/profile_layer.py --recipe fp8 --python     # where the host (Python) time goes
    python bench/profile_layer.py --recipe fp8 --compile    # the layer under torch.compile

With ``--python`` it reports the host time of a step (launches only, not waiting for the GPU)
against the GPU time, then cProfile's top functions: a step whose host time exceeds its GPU time
is bound by Python overhead, not by kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from bench_layers import SwiGLU, recipes, step_fn
from torch.profiler import ProfilerActivity, profile

import dtq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="fp8", help=f"one of {sorted(recipes())} or bf16")
    p.add_argument("--layer", choices=("linear", "mlp"), default="linear")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--python", action="store_true", help="host time and cProfile instead of torch.profiler")
    p.add_argument("--compile", action="store_true", help="torch.compile the layer, as bench_layers.py does")
    args = p.parse_args()
    recipe = None if args.recipe == "bf16" else recipes()[args.recipe]
    if args.layer == "mlp":
        base = SwiGLU(args.hidden, args.ffn, torch.bfloat16, "cuda")
    else:
        base = torch.nn.Linear(args.hidden, args.ffn, bias=False, dtype=torch.bfloat16, device="cuda")
    model = base if recipe is None else dtq.convert(base)
    if args.compile:
        model = torch.compile(model)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step = step_fn(model, x, recipe)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.python:
        host_vs_gpu(step, args.rows)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


def host_vs_gpu(step, rows: int, n: int = 10) -> None:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / n
    print(f"per step: host {host * 1e3:.3f} ms (launch side), wall {total * 1e3:.3f} ms")
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # backward on this thread, where cProfile looks
        prof.enable()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


if __name__ == "__main__":
    main()
