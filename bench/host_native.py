"""Host time of a planned FP8 ``dtq.nn.Linear`` step run by the C++ autograd function
(``dtq/nn/linear_native.py``), against torch's Linear, in one process: the module's step, the
same with a plain Parameter weight, the library's ``native_linear`` called directly (no module
Python), forwards alone, and single ops; with backward on autograd's worker thread, then on the
calling thread. Best of ``--rounds`` rounds of ``--n`` steps. GPU only.

    python bench/host_native.py [--size 256] [--n 1500] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
from host_overhead import linear_step

import dtq
from dtq import kernels

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--size", type=int, default=256)
p.add_argument("--n", type=int, default=1500)
p.add_argument("--rounds", type=int, default=2)
args = p.parse_args()
n = args.size
x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
r = dtq.Float8CurrentScaling()


def host_us(fn, iters=args.n):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return best


def fwd_of(layer, recipe):
    def f():
        with dtq.autocast(recipe, enabled=recipe is not None):
            layer(x)

    return f


ref = nn.Linear(n, n, bias=False, dtype=torch.bfloat16, device="cuda")
hp = dtq.nn.Linear(n, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
plain = dtq.nn.Linear(n, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
plain.weight = nn.Parameter(plain.weight.detach().__dtq_unwrap__().clone())
with dtq.autocast(r):
    hp(x)
    plain(x)
((_, plan),) = hp._slots(r, 0).plans.values()
if plan.native is None:
    raise SystemExit("the FP8 plan does not run the C++ function here (no GPU kernel library?)")
ext = kernels.extension()
w = hp.weight
wd = w._data


def direct():
    y = ext.native_linear(x, w, wd, None, None, plan.native)
    y.backward(torch.ones_like(y))
    w.grad = None
    x.grad = None


def direct_fwd():
    ext.native_linear(x, w, wd, None, None, plan.native)


xs = x.detach()
s = torch.ones((), device="cuda")
x8 = xs.to(torch.float8_e4m3fn)
rows = {
    "torch.nn.Linear": linear_step(ref, x, None),
    "dtq fp8 (HighPrecisionWeight)": linear_step(hp, x, r),
    "dtq fp8 (plain Parameter)": linear_step(plain, x, r),
    "ext.native_linear direct": direct,
    "fwd: torch.nn.Linear": fwd_of(ref, None),
    "fwd: dtq fp8": fwd_of(hp, r),
    "fwd: ext.native_linear direct": direct_fwd,
    "torch._scaled_mm": lambda: torch._scaled_mm(x8, x8.t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16),
    "torch.mm": lambda: torch.mm(xs, xs),
    "torch.empty": lambda: torch.empty(n, n, device="cuda"),
}
for threads in (True, False):
    with torch.autograd.set_multithreading_enabled(threads):
        print("worker thread" if threads else "calling thread")
        base = None
        for k, fn in rows.items():
            us = host_us(fn)
            base = base or us
            print(f"  {k:36s} {us:8.1f} us {us / base:5.2f}x", flush=True)
