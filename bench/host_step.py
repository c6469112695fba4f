"""Host time of a whole training step of ``bench_e2e.py``'s Llama-style stack, at so few tokens
that the GPU never holds the host back: what a step costs to issue, per variant, and with
``--profile`` cProfile's top functions of each dtq variant (ms per step; cProfile makes Python
about 1.5x slower, so read the rows relative to each other).

    python bench/host_step.py                                   # bf16 / fp8, eager and compiled
    python bench/host_step.py --variants fp8_compiled --profile 40
    python bench/host_step.py --variants fp8_eager --recipe "hybrid mxfp8/nvfp4" --profile 40  # fp8_*: any dtq recipe

At the step sizes of ``bench_e2e.py`` (16,384 tokens) a variant whose host time here comes near
its GPU time there is partly host-bound.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import Stack, compile_blocks  # noqa: E402

import dtq  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["bf16_eager", "bf16_compiled", "fp8_eager", "fp8_compiled"])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's N top functions of dtq variants")
    p.add_argument("--recipe", default="fp8", help="the dtq variants' recipe, a name of bench_layers.recipes()")
    p.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"], help="the profile's order")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head_dim = 128 if args.hidden >= 1024 else 64
    torch.manual_seed(0)
    base = Stack(args.hidden, args.layers, head_dim, torch.bfloat16, dev)
    x = torch.randn(1, args.tokens, args.hidden, dtype=torch.bfloat16, device=dev)
    from bench_layers import recipes

    recipe = recipes()[args.recipe]
    for variant in args.variants:
        torch._dynamo.reset()
        bf16 = variant.startswith("bf16")
        model = copy.deepcopy(base) if bf16 else dtq.convert(copy.deepcopy(base))
        if variant.endswith("compiled"):
            model = compile_blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")

        def step(model=model, opt=opt, rec=None if bf16 else recipe):
            with dtq.autocast(rec, enabled=rec is not None):
                y = model(x)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(5):
            step()
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        label = variant if bf16 else f"{variant} ({args.recipe})"
        print(f"{label:16s} {ms:8.2f} ms/step ({args.tokens} tokens, hidden {args.hidden}, {args.layers} layers)")
        if args.profile and not bf16:
            prof = cProfile.Profile()
            with torch.autograd.set_multithreading_enabled(False):  # backward on this thread, where cProfile looks
                prof.enable()
                for _ in range(args.steps):
                    step()
                sync()
                prof.disable()
            stats = pstats.Stats(prof).sort_stats(args.sort)
            print(f"    {'self ms':>8s} {'cum ms':>8s} {'calls':>6s}  function (per step)")
            for func in stats.fcn_list[: args.profile]:
                _, nc, tt, ct, _ = stats.stats[func]
                name = f"{func[0].split('/')[-1]}:{func[1]}({func[2]})" if func[0] != "~" else func[2]
                n = args.steps
                print(f"    {tt / n * 1e3:8.3f} {ct / n * 1e3:8.3f} {nc / n:6.1f}  {name}")


if __name__ == "__main__":
    main()
