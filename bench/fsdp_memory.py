"""FSDP2 parameter memory, peak step memory, step time and all-gathered bytes per parameter mode.

    torchrun --nproc-per-node 2 bench/fsdp_memory.py [--out bench/results/fsdp_memory.json]

Modes: BF16 parameters without quantization (the baseline), BF16 high-precision shards gathered
as FP8, FP8 quantized parameters, MXFP8/NVFP4 hybrid quantized parameters. Forward + backward of a
stack of SwiGLU MLPs (no optimizer: parameter and activation memory only)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import dtq


def param_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        t = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(t, dtq.QuantizedTensor):
            seen = set()
            for d in t.directions:
                for v in t.payload(d).values():
                    if v.data_ptr() not in seen:
                        seen.add(v.data_ptr())
                        total += v.numel() * v.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def build(args, recipe, quantized):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            dtq.nn.LayerNormMLP(
                args.hidden,
                args.ffn,
                activation="swiglu",
                normalization="RMSNorm",
                params_dtype=torch.bfloat16,
                name=f"layers.{i}",
            )
            for i in range(args.layers)
        ]
    ).cuda()
    if quantized:
        dtq.convert(model, recipe=recipe, quantized_params=True)
    for m in model:
        fully_shard(m)
    fully_shard(model)
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "fsdp_memory.json"))
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    modes = {
        "bf16": (None, False),
        "fp8_hp_shards": (dtq.Float8CurrentScaling(), False),
        "fp8_quantized_params": (dtq.Float8CurrentScaling(), True),
        "hybrid_quantized_params": (dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()), True),
    }
    results = {}
    for name, (recipe, quantized) in modes.items():
        model = build(args, recipe, quantized)
        x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        times, peaks = [], []
        dtq.parallel.comm_stats(reset=True)
        for step in range(args.steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with dtq.autocast(recipe, enabled=recipe is not None):
                loss = model(x).float().square().mean()
            loss.backward()
            for q in model.parameters():
                q.grad = None
            if recipe is not None and not quantized:
                dtq.parallel.precompute_amax(model, recipe)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated())
            if step == 0:
                dtq.parallel.comm_stats(reset=True)
        stats = dtq.parallel.comm_stats(reset=True)
        results[name] = {
            "param_bytes_per_rank": param_bytes(model),
            "peak_step_bytes": max(peaks[1:]),
            "step_ms_median": 1e3 * statistics.median(times[1:]),
            "gathered_bytes_per_step": {k: v // (args.steps - 1) for k, v in stats.items()},
            "memory_allocated_after_steps": torch.cuda.memory_allocated(),
        }
        del model
        torch.cuda.empty_cache()
    if rank == 0:
        base = results["bf16"]["param_bytes_per_rank"]
        print(f"{'mode':26s} {'params/rank MiB':>16s} {'vs bf16':>8s} {'peak MiB':>9s} {'step ms':>8s}  gathered/step")
        for name, r in results.items():
            print(
                f"{name:26s} {r['param_bytes_per_rank'] / 2**20:16.1f} {r['param_bytes_per_rank'] / base:8.2f} "
                f"{r['peak_step_bytes'] / 2**20:9.0f} {r['step_ms_median']:8.1f}  {r['gathered_bytes_per_step']}"
            )
        with open(args.out, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "device": torch.cuda.get_device_name(),
                    "world_size": dist.get_world_size(),
                    "torch": torch.__version__,
                    "results": results,
                },
                f,
                indent=1,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
