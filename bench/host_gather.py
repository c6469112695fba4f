"""Host time of dtq's FSDP2 pre-all-gather hook per weight and gather, on any machine: two gloo
ranks train a stack of dtq Linears under FSDP2 with quantized gathers (high-precision shards) and
``precompute_amax`` after each step, as the trainer does; the hook's quantization is replaced by its
first result per (quantizer, directions, shard shape), so what is timed is the Python around it
(gather planning, reuse checks, packing, byte records). On a GPU lease the same Python costs
10-15x more (CONTRIBUTING, "Host time"); use this to compare a change of the hooks before and after.

    torchrun --standalone --nproc-per-node 2 bench/host_gather.py [--steps 50] [--profile 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.distributed import gather


def stub_quantization() -> None:
    """The hook's ``quantize_payloads`` returns its first result per (quantizer, directions, shape)."""
    real, cache = gather.quantize_payloads, {}

    def quantize(quantizer, x, dirs, **kw):
        key = (quantizer, tuple(dirs), tuple(x.shape), x.dtype)
        if key not in cache:
            cache[key] = real(quantizer, x, dirs, **kw)
        return cache[key]

    gather.quantize_payloads = quantize


def timed_hook() -> list:
    """Wrap the hook: its host time per call (seconds) goes into the returned list."""
    real, spent = gather.high_precision_pre_all_gather, []

    def hook(*args, **kwargs):
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        return out

    gather.high_precision_pre_all_gather = hook
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--profile", type=int, default=0, metavar="TOP", help="also cProfile's TOP functions under the hook")
    args = p.parse_args()
    dist.init_process_group("gloo")
    stub_quantization()
    spent = timed_hook()
    torch.manual_seed(0)
    h = args.hidden
    blocks = [
        torch.nn.Sequential(
            torch.nn.Linear(h, 2 * h, bias=False), torch.nn.ReLU(), torch.nn.Linear(2 * h, h, bias=False)
        )
        for _ in range(args.blocks)
    ]
    model = dtq.convert(torch.nn.Sequential(*blocks).to(torch.bfloat16))
    recipe = dtq.Float8CurrentScaling()
    for block in model:
        fully_shard(block)  # reshard after forward: a forward and a backward gather per weight
    fully_shard(model)
    x = torch.randn(64, h, dtype=torch.bfloat16)

    def step():
        with dtq.autocast(recipe):
            y = model(x)
        y.float().pow(2).mean().backward()
        for w in model.parameters():
            w.grad = None
        dtq.parallel.precompute_amax(model, recipe)

    dtq.parallel.precompute_amax(model, recipe)
    for _ in range(5):
        step()
    spent.clear()
    for _ in range(args.steps):
        step()
    calls = len(spent) / args.steps
    per_call = sorted(spent)[len(spent) // 2] * 1e6
    if dist.get_rank() == 0:
        print(f"pre-all-gather hook: {calls:.0f} calls per step, median {per_call:.1f} us of host time a call")
    if args.profile:
        prof = cProfile.Profile()
        real = gather.high_precision_pre_all_gather

        def profiled(*a, **kw):
            prof.enable()
            try:
                return real(*a, **kw)
            finally:
                prof.disable()

        gather.high_precision_pre_all_gather = profiled
        for _ in range(args.steps):
            step()
        if dist.get_rank() == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
            print(out.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
