"""The example trainer's model step without its FSDP2 wrapping, on one GPU: forward, loss,
backward and fused AdamW on BF16 parameters, for BF16 and FP8 (per tensor), eager and with each
block compiled; prints ms per step (wall and device) and each variant's costliest kernels (ms per
step, calls per step, µs per call). Set beside the trainer's own step time (``launch/train.py``,
which wraps even one rank in FSDP2 with FP32 master weights), it shows what the wrapping costs.

    python bench/model_step.py --config launch/configs/llama1b_1gpu.toml bf16e bf16c fp8e fp8c
    python bench/model_step.py fp8c --set model.layers=2 --top 40   # one block's kernels, quickly
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import dtq
from dtq.launch import config
from dtq.launch.model import build_model

VARIANTS = {"bf16e": (None, False), "bf16c": (None, True), "fp8e": ("fp8", False), "fp8c": ("fp8", True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    p.add_argument("--config", default="launch/configs/llama1b_1gpu.toml")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, as the trainer's")
    args = p.parse_args()
    cfg = config.load(args.config, args.set)
    for variant in args.variants:
        run(variant, cfg, args)


def run(variant: str, cfg, args) -> None:
    tokens, seq = cfg.train.batch_size, cfg.model.seq_len
    name, compiled = VARIANTS[variant]
    recipe = dtq.Float8CurrentScaling() if name == "fp8" else None
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = build_model(cfg.model).cuda().to(torch.bfloat16)
    if compiled:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.model.vocab, (tokens, seq), device="cuda")
    y = torch.randint(0, cfg.model.vocab, (tokens, seq), device="cuda")

    def step():
        with dtq.autocast(recipe, enabled=recipe is not None):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    device_ms = sum(e.self_device_time_total for e in events) / 2e3
    print(f"== {variant}: {ms:.1f} ms/step wall, {device_ms:.1f} ms/step device", flush=True)
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[: args.top]:
        per_call = e.self_device_time_total / max(e.count, 1)
        print(f"   {e.self_device_time_total / 2e3:8.3f} ms {e.count / 2:5.0f}x {per_call:8.1f} us  {e.key[:100]}")


if __name__ == "__main__":
    main()
