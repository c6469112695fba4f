"""Host (Python + launch) time of the operations a dtq GEMM step is made of, on tensors small
enough that the GPU never holds the host back: where per-layer overhead comes from.

    python bench/host_overhead.py [--n 2000]
"""

from __future__ import annotations

import argparse
import time

import torch

import dtq
from dtq import kernels
from dtq.gemm import Operand, mm


def host_us(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    args = p.parse_args()
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    quantizers = {"fp8": dtq.Float8Quantizer(), "fp8_block": dtq.Float8BlockQuantizer(), "mxfp8": dtq.MXFP8Quantizer(),
                  "nvfp4": dtq.NVFP4Quantizer()}
    cases = {
        "torch.mm bf16": lambda: torch.mm(x, x),
        "torch.mm bf16 -> fp32 out": lambda: torch.mm(x, x, out_dtype=torch.float32),
        "torch.empty": lambda: torch.empty(256, 256, device="cuda"),
        "kernels.available": lambda: kernels.available(x.device),
    }
    for name, q in quantizers.items():
        t = q.quantize(x)
        cases[f"quantize {name} (both dirs)"] = lambda q=q: q.quantize(x)
        cases[f"mm {name} fprop"] = lambda t=t: mm(Operand(t), Operand(t, transpose=True), torch.bfloat16)
        cases[f"mm {name} wgrad"] = lambda t=t: mm(Operand(t, "columnwise", True), Operand(t, "columnwise"), torch.bfloat16)
    lin = dtq.nn.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    xg = x.clone().requires_grad_()
    for name, recipe in (("bf16", None), ("fp8", dtq.Float8CurrentScaling()), ("mxfp8", dtq.MXFP8BlockScaling())):
        def step(recipe=recipe):
            with dtq.autocast(recipe, enabled=recipe is not None):
                y = lin(xg)
            y.sum().backward()
        cases[f"dtq.nn.Linear fwd+bwd {name}"] = step
    for name, fn in cases.items():
        print(f"{name:36s} {host_us(fn, args.n):8.1f} us")


if __name__ == "__main__":
    main()
