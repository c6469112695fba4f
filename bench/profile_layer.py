"""Where the time of one dtq layer step goes: torch.profiler over forward + backward of a
Llama-3-8B-shaped Linear under a recipe, the top CUDA kernels and CPU ops by time.

    python bench/profile_layer.py --recipe fp8 [--tokens 8192 --hidden 4096 --ffn 14336]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import dtq
from bench_layers import recipes, step_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="fp8", help=f"one of {sorted(recipes())} or bf16")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    recipe = None if args.recipe == "bf16" else recipes()[args.recipe]
    lin = torch.nn.Linear(args.hidden, args.ffn, bias=False, dtype=torch.bfloat16, device="cuda")
    model = lin if recipe is None else dtq.convert(lin)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step = step_fn(model, x, recipe)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
