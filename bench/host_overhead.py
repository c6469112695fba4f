"""Host (Python + launch) time of a dtq GEMM step and of the operations it is made of, on tensors
small enough that the GPU never holds the host back: where per-layer overhead comes from.

    python bench/host_overhead.py [--n 2000] [--profile]

The ``Linear fwd+bwd`` rows run what a training step runs per layer (forward under the recipe,
backward, gradients set to None) for ``torch.nn.Linear`` and ``dtq.nn.Linear`` side by side, with
and without a bias; ``ratio`` is the host time over torch's own. ``--profile`` adds cProfile's
top functions of each dtq row, in microseconds per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import dtq
import dtq.nn.module as nn_module
from dtq import kernels
from dtq.gemm import Operand, mm
from dtq.nn import linear_native

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script (references, not speed)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def host_us(fn, n: int) -> float:
    for _ in range(10):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    sync()
    return us


def profile(fn, n: int, rows: int = 30) -> None:
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # backward on this thread, where cProfile looks
        for _ in range(10):
            fn()
        sync()
        prof.enable()
        for _ in range(n):
            fn()
        sync()
        prof.disable()
    stats = pstats.Stats(prof).sort_stats("tottime")
    print(f"    {'us/step self':>12s} {'us/step cum':>11s} {'calls/step':>10s}  function")
    for func in stats.fcn_list[:rows]:
        cc, nc, tt, ct, _ = stats.stats[func]
        name = f"{func[0].split('/')[-1]}:{func[1]}({func[2]})" if func[0] != "~" else func[2]
        print(f"    {tt / n * 1e6:12.1f} {ct / n * 1e6:11.1f} {nc / n:10.1f}  {name}")


def linear_step(layer, x, recipe):
    def step():
        with dtq.autocast(recipe, enabled=recipe is not None):
            y = layer(x)
        y.backward(torch.ones_like(y))
        for p in layer.parameters():
            p.grad = None
        x.grad = None

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="cProfile's top functions of each dtq Linear row")
    p.add_argument("--recipes", nargs="*", default=["fp8", "mxfp8", "fp8-block", "nvfp4"])
    p.add_argument("--compile", action="store_true", help="also torch.compile(fullgraph=True) each layer")
    p.add_argument(
        "--variants",
        action="store_true",
        help="also each dtq row through the general (unplanned) GEMM path and through a plan run in Python "
        "(not dtq.nn.linear_native's C++ function), and every row with backward "
        "run on the calling thread (torch.autograd.set_multithreading_enabled(False))",
    )
    args = p.parse_args()
    n = args.size
    x = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    quantizers = {
        "fp8": dtq.Float8Quantizer(),
        "fp8_block": dtq.Float8BlockQuantizer(),
        "mxfp8": dtq.MXFP8Quantizer(),
        "nvfp4": dtq.NVFP4Quantizer(),
    }
    s = torch.ones((), device=DEV)
    x8 = x.to(torch.float8_e4m3fn)
    cases = {
        "torch.mm bf16": lambda: torch.mm(x, x),
        "torch.mm bf16 -> fp32 out": lambda: torch.mm(x, x, out_dtype=torch.float32),
        "torch._scaled_mm fp8": lambda: torch._scaled_mm(x8, x8.t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16),
        "torch.empty": lambda: torch.empty(n, n, device=DEV),
        "kernels.available": lambda: kernels.available(x.device),
    }
    for name, q in quantizers.items():
        t = q.quantize(x)
        cases[f"quantize {name} (both dirs)"] = lambda q=q: q.quantize(x)
        cases[f"quantize {name} (rowwise)"] = lambda q=q: q.quantize(x, columnwise=False)
        cases[f"mm {name} fprop"] = lambda t=t: mm(Operand(t), Operand(t, transpose=True), torch.bfloat16)
        cases[f"mm {name} wgrad"] = lambda t=t: mm(
            Operand(t, "columnwise", True), Operand(t, "columnwise"), torch.bfloat16
        )
    for name, fn in cases.items() if DEV == "cuda" else ():
        print(f"{name:44s} {host_us(fn, args.n):8.1f} us", flush=True)

    all_recipes = {
        "fp8": dtq.Float8CurrentScaling(),
        "mxfp8": dtq.MXFP8BlockScaling(),
        "fp8-block": dtq.Float8BlockScaling(),
        "nvfp4": dtq.NVFP4BlockScaling(),
        "fp8-row": dtq.Float8RowwiseScaling(),
        "fp8-delayed": dtq.DelayedScaling(),
    }
    xg = x.clone().requires_grad_()
    print(f"\nLinear {n}x{n} fwd+bwd, host us per step (ratio: over torch.nn.Linear with the same bias)")
    for bias in (False, True):
        ref_layer = torch.nn.Linear(n, n, bias=bias, dtype=torch.bfloat16, device=DEV)
        ref = host_us(linear_step(ref_layer, xg, None), args.n)
        print(f"  {'torch.nn.Linear bias=' + str(bias):36s} {ref:8.1f} us", flush=True)
        layer = dtq.nn.Linear(n, n, bias=bias, params_dtype=torch.bfloat16, device=DEV)
        for name in ["none", *args.recipes]:
            recipe = None if name == "none" else all_recipes[name]
            step = linear_step(layer, xg, recipe)
            us = host_us(step, args.n)
            print(f"  {'dtq.nn.Linear ' + name + ' bias=' + str(bias):36s} {us:8.1f} us  {us / ref:5.2f}x", flush=True)
            if args.profile and not bias:
                profile(step, min(args.n, 500))
            if args.variants and recipe is not None:
                real, nn_module.plan_for = nn_module.plan_for, lambda *a: None
                us = host_us(step, args.n)
                nn_module.plan_for = real
                label = f"dtq.nn.Linear {name} bias={bias} general"
                print(f"  {label:36s} {us:8.1f} us  {us / ref:5.2f}x", flush=True)
                # the planned call in Python (a fresh module: a plan takes the native function or
                # not at its first eager call)
                was, linear_native.enabled = linear_native.enabled, False
                py_layer = dtq.nn.Linear(n, n, bias=bias, params_dtype=torch.bfloat16, device=DEV)
                us = host_us(linear_step(py_layer, xg, recipe), args.n)
                linear_native.enabled = was
                label = f"dtq.nn.Linear {name} bias={bias} python plan"
                print(f"  {label:36s} {us:8.1f} us  {us / ref:5.2f}x", flush=True)
        if args.variants:  # the backward of a Python autograd.Function on autograd's device thread
            with torch.autograd.set_multithreading_enabled(False):
                ref1 = host_us(linear_step(ref_layer, xg, None), args.n)
                print(f"  {'torch.nn.Linear 1 thread bias=' + str(bias):36s} {ref1:8.1f} us", flush=True)
                for name in args.recipes:
                    us = host_us(linear_step(layer, xg, all_recipes[name]), args.n)
                    label = f"dtq.nn.Linear {name} 1 thread bias={bias}"
                    print(f"  {label:36s} {us:8.1f} us  {us / ref1:5.2f}x", flush=True)
        if args.compile:
            ref_c = host_us(linear_step(torch.compile(ref_layer, fullgraph=True), xg, None), args.n)
            print(f"  {'torch.nn.Linear compiled bias=' + str(bias):36s} {ref_c:8.1f} us", flush=True)
            for name in ["none", *args.recipes]:
                recipe = None if name == "none" else all_recipes[name]
                torch._dynamo.reset()
                step = linear_step(torch.compile(layer, fullgraph=True), xg, recipe)
                us = host_us(step, args.n)
                print(
                    f"  {'dtq.nn.Linear compiled ' + name + ' bias=' + str(bias):36s} {us:8.1f} us  {us / ref_c:5.2f}x",
                    flush=True,
                )
                if args.profile and not bias and name == "fp8":
                    profile(step, min(args.n, 500))


if __name__ == "__main__":
    main()
