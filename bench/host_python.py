"""dtq's own Python per GEMM step, on any machine: a planned ``dtq.nn.Linear`` forward + backward
with its quantize launches and GEMMs replaced by their first call's results, so what is timed is
the Python around them (module, recipe resolution, plan lookup, autograd Function, payload
dicts). The C++ calls it leaves out (``quantize_alloc``, ``torch._scaled_mm``) are timed by
``bench/host_overhead.py`` on a GPU; together they are the eager host time issue 16 bounds.

    python bench/host_python.py [--recipe fp8] [--bias] [--n 2000] [--profile 30] [--compiled] [--layers 1]

``--compiled``: the module compiled (``fullgraph``, backend ``aot_eager``: dtq's custom ops run
as they do under inductor, without inductor's code generation), so what is timed is the Python
of the ops' bodies and torch's dispatch into them. ``--layers N``: N Linears in a row in one module
(one graph when compiled), timed per Linear: what a graph's own overhead costs each GEMM of a block.

Use it to compare a change of that Python without a GPU: the same machine, before and after.
On the CPU the stubbed results come from the reference codecs (computed once, then reused).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from bench_layers import recipes

import dtq
from dtq import codec
from dtq.nn import linear_plan


def stub_kernels() -> None:
    """Quantize plans and bound GEMMs return what their first call returned (per plan and shape)."""
    call, cache = codec.QuantizePlan.__call__, {}

    def quantize(self, x, given, seed):
        key = (id(self), tuple(x.shape))
        if key not in cache:
            cache[key] = call(self, x, given, seed)
        return cache[key]

    codec.QuantizePlan.__call__ = quantize
    bind = linear_plan.bind

    def bind_once(a, b, out_dtype, fast_accum=False):
        run, kept = bind(a, b, out_dtype, fast_accum), []

        def gemm(pa, pb):
            if not kept:
                kept.append(run(pa, pb))
            return kept[0]

        return gemm

    linear_plan.bind = bind_once


def step_us(module, recipe, x: torch.Tensor, n: int):
    """Microseconds of host time per forward + backward (gradients set to None), and the step."""

    def step():
        with dtq.autocast(recipe):
            y = module(x)
        y.backward(torch.ones_like(y))
        for p in module.parameters():
            p.grad = None
        x.grad = None

    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n * 1e6, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="fp8", choices=sorted(recipes()))
    p.add_argument("--bias", action="store_true")
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--profile", type=int, default=0, metavar="TOP", help="also cProfile's TOP functions by own time")
    p.add_argument("--compiled", action="store_true", help="compile the module (fullgraph, aot_eager)")
    p.add_argument("--backend", default="aot_eager", help="torch.compile's backend with --compiled")
    p.add_argument("--layers", type=int, default=1, help="Linears in a row (timed per Linear)")
    args = p.parse_args()
    stub_kernels()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    recipe = recipes()[args.recipe]
    kw = dict(bias=args.bias, params_dtype=torch.bfloat16, device=device)
    module = torch.nn.Sequential(*(dtq.nn.Linear(256, 256, **kw) for _ in range(args.layers)))
    x = torch.randn(64, 256, dtype=torch.bfloat16, device=device, requires_grad=True)
    if args.compiled:
        module = torch.compile(module, fullgraph=True, backend=args.backend)
    with torch.autograd.set_multithreading_enabled(False):  # backward on this thread (and cProfile's)
        us, step = step_us(module, recipe, x, args.n)
        what = f"compiled, {args.backend}" if args.compiled else "eager"
        name = f"dtq.nn.Linear {args.recipe} (bias={args.bias}, {what}, {args.layers} in a row)"
        print(f"{name}, kernels stubbed: {us / args.layers:.1f} us of host time per Linear step")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.n):
                step()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
            print(out.getvalue())


if __name__ == "__main__":
    main()
