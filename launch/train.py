"""The example training job (single process for now; the FSDP2 trainer replaces it).

Trains a small MLP regressor, converted with ``dtq.convert``, under ``dtq.autocast``: fprop runs
on rowwise payloads, dgrad on the weight's columnwise payload and the gradient's rowwise one,
wgrad on columnwise payloads of gradient and input (DESIGN section 1). The default recipe is a
hybrid: MXFP8 rowwise / NVFP4 columnwise for inputs and weights, NVFP4 with stochastic rounding
for gradients.

    python launch/train.py --recipe hybrid --steps 60
"""

from __future__ import annotations

import argparse
import time

import torch

import dtq

RECIPES = {
    "bf16": lambda: None,  # no quantization: the high-precision baseline (parameters in --dtype)
    "fp8": dtq.Float8CurrentScaling,
    "fp8-delayed": dtq.DelayedScaling,
    "fp8-block": dtq.Float8BlockScaling,
    "mxfp8": dtq.MXFP8BlockScaling,
    "nvfp4": dtq.NVFP4BlockScaling,
    # MXFP8 for the forward GEMM, NVFP4 (16x16 weights, stochastic rounding on gradients) for
    # the backward GEMMs.
    "hybrid": lambda: dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()),
}


def build(width: int) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width))
    return dtq.convert(model)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="hybrid", choices=sorted(RECIPES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter and activation dtype")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh(),
                                  torch.nn.Linear(args.width, args.width))
    dtype = getattr(torch, args.dtype)
    model = build(args.width).to(dtype)
    recipe = RECIPES[args.recipe]()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(f"dtq {dtq.__version__}: training a {sum(p.numel() for p in model.parameters())}-parameter MLP, "
          f"recipe={args.recipe}, {args.steps} steps of {args.batch} samples on CPU", flush=True)
    t0, loss = time.perf_counter(), torch.tensor(float("nan"))
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.width)
        with torch.no_grad():
            target = teacher(x).to(dtype)
        x = x.to(dtype)
        with dtq.autocast(recipe, enabled=recipe is not None):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            rate = step * args.batch / (time.perf_counter() - t0)
            print(f"step {step:4d}/{args.steps}  loss {loss.item():.4f}  {rate:,.0f} samples/s", flush=True)
    return loss.item()


if __name__ == "__main__":
    main()
