"""Whether each variant's compiled blocks really run under CUDA graphs (``mode="reduce-overhead"``):
inductor skips them silently for a graph it cannot capture (logged only under
``TORCH_LOGS=perf_hints``). Prints inductor's cudagraph counters and the host time per step (a
replayed graph costs almost none).

    TORCH_LOGS=perf_hints python bench/probe_cudagraphs.py --hidden 1024
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import CUDAGRAPHS, Stack, compile_blocks, graphed, prepare  # noqa: E402

import dtq  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--whole", action="store_true", help="compile the whole model (fullgraph) instead of each block")
    args = p.parse_args()
    torch.manual_seed(0)
    base = Stack(args.hidden, args.layers, 128, torch.bfloat16, torch.device("cuda"))
    x = torch.randn(1, args.tokens, args.hidden, dtype=torch.bfloat16, device="cuda")
    variants = {
        "bf16": (lambda: copy.deepcopy(base), None),
        "dtq fp8": (lambda: dtq.convert(copy.deepcopy(base)), dtq.Float8CurrentScaling()),
        "dtq fp8, plain weights": (lambda: plain_weights(dtq.convert(copy.deepcopy(base))), dtq.Float8CurrentScaling()),
    }
    for name, (build, recipe) in variants.items():
        torch._dynamo.reset()
        counters.clear()

        def compiled(build=build):
            model = build()
            if args.whole:
                return graphed(torch.compile(model, mode=CUDAGRAPHS, fullgraph=True))
            return graphed(compile_blocks(model, CUDAGRAPHS))

        step_args = argparse.Namespace(warmup=4, backward_thread="autograd")
        step = prepare(compiled, recipe, x, step_args, torch.device("cuda"))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        host = (time.perf_counter() - t0) / 10 * 1e3
        torch.cuda.synchronize()
        seen = {f"{g}.{k}": v for g, c in counters.items() for k, v in c.items() if "graph" in k or "skip" in k}
        print(f"{name:24s} host {host:6.2f} ms/step  counters {seen}", flush=True)


def plain_weights(model: torch.nn.Module) -> torch.nn.Module:
    """The dtq Linears' weights as plain parameters (no HighPrecisionWeight wrapper)."""
    from dtq.weights import unwrap

    for m in model.modules():
        if isinstance(m, dtq.nn.Linear):
            m.weight = torch.nn.Parameter(unwrap(m.weight.data).clone())
    return model


if __name__ == "__main__":
    main()
