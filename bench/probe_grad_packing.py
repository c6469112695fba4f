"""FSDP2's gradient packing (each unit's BF16 gradients copied into its FP32 reduce-scatter buffer)
at a trainer config's shapes: torch's ways against dtq's kernel (``dtq.kernels.chunk_cat``), GPU
time per call (CUDA events over many calls), the bandwidth that makes, and the host's time per
call (best of five rounds of calls issued back to back, GPU work too small to wait on: one
[64]-element gradient per parameter). Rows: one decoder block (a per-block FSDP2 unit) and the
whole model (one unit over one rank, ``parallel.fsdp_units = "root"``), world sizes 1 and 2.

    python bench/probe_grad_packing.py [--config launch/configs/llama1b_1gpu.toml]
"""

from __future__ import annotations

import argparse
import math

import torch
from probe_gemm_host import us_per_call

from dtq import kernels
from dtq.launch import config
from dtq.launch.model import build_model


def gpu_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def ways(grads: list[torch.Tensor], world: int) -> dict:
    padded = sum(-(-g.shape[0] // world) * world * math.prod(g.shape[1:]) for g in grads)
    out = torch.empty(padded, dtype=torch.float32, device="cuda")
    found = {
        "torch._chunk_cat (FSDP2's)": lambda: torch._chunk_cat(grads, 0, world, out=out.view(world, -1)),
        "dtq chunk_cat": lambda: kernels.chunk_cat(grads, out, world),
    }
    if world == 1:
        found["torch.cat (dtq's one-rank copy-in before)"] = lambda: torch.cat([g.reshape(-1) for g in grads], out=out)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="launch/configs/llama1b_1gpu.toml")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and kernels.available("cuda")):
        raise SystemExit("probe_grad_packing.py times CUDA kernels: run it on an sm_90+ GPU")
    cfg = config.load(args.config, [])
    with torch.device("meta"):
        model = build_model(cfg.model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    units = {
        "one block": [s for n, s in shapes.items() if n.startswith("layers.0.")],
        "whole model": list(shapes.values()),
    }
    for unit, unit_shapes in units.items():
        grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in unit_shapes]
        tiny = [torch.randn(64, device="cuda", dtype=torch.bfloat16) for _ in unit_shapes]
        moved = sum(g.numel() for g in grads) * 6  # bytes: 2 read, 4 written
        for world in (1, 2):
            gpu = {name: gpu_ms(fn) for name, fn in ways(grads, world).items()}
            host = {name: us_per_call(fn, 200) for name, fn in ways(tiny, world).items()}
            for name in gpu:
                print(
                    f"{unit} ({len(grads)} gradients, {moved / 1e6:.0f} MB moved), world {world}, {name}: "
                    f"GPU {gpu[name] * 1e3:.1f} us ({moved / gpu[name] / 1e9:.2f} TB/s), "
                    f"host {host[name]:.1f} us a call"
                )
        print(f"{unit}: dtq chunk_cat's bits equal torch._chunk_cat's at world 1 and 2: {_same_bits(grads)}")
        del grads


def _same_bits(grads: list[torch.Tensor]) -> bool:
    for world in (1, 2):
        padded = sum(-(-g.shape[0] // world) * world * math.prod(g.shape[1:]) for g in grads)
        want = torch.full((world, padded // world), float("nan"), device="cuda")
        got = torch.full((padded,), float("nan"), device="cuda")
        torch._chunk_cat(grads, 0, world, out=want)
        taken = kernels.chunk_cat(grads, got, world)
        if not (taken and torch.equal(got.view(torch.int32), want.view(-1).view(torch.int32))):
            return False
    return True


if __name__ == "__main__":
    main()
