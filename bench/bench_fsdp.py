"""FSDP2 benchmark: step time, all-gathered / reduce-scattered bytes and peak memory of a small
Llama-style model (attention + SwiGLU blocks, AdamW) per parameter mode, in one run:

* ``bf16``: BF16 parameters, no quantization (the baseline);
* ``dtq fp8 (hp shards)``: BF16 shards, gathered as FP8 (``Float8CurrentScaling``, amaxes
  precomputed in one all-reduce after each optimizer step);
* ``dtq fp8 (quantized params)``: FP8 parameters with FP32 masters (``MasterWeightOptimizer``);
* ``dtq hybrid (quantized params)``: MXFP8 rowwise / NVFP4 columnwise parameters;
* ``dtq fp8 (bf16 gather)``: ``dtq.parallel.gather_high_precision``: FSDP2 gathers BF16 weights
  and each GEMM quantizes its gathered weight;
* ``torchao float8``: tensorwise float8 with FP8 all-gather and precomputed scales;
* ``torchao float8 (bf16 gather)``: the same without FP8 all-gather (torchtitan's default).

A mode ending in `` compiled`` compiles each block (``torch.compile(block)``) before
``fully_shard``, as torchtitan does. ``--preset 1b`` takes the shapes of
``launch/configs/llama1b.toml`` (16 layers, hidden 2048, FFN 8192, 4 x 2048 tokens per rank).

    torchrun --nproc-per-node 4 bench/bench_fsdp.py --out bench/results/fsdp_h200x4.json
    torchrun --nproc-per-node 2 bench/bench_fsdp.py --preset 1b --modes "$(python bench/bench_fsdp.py --compiled-modes)"

Bytes are counted at the collectives (every all-gather output and reduce-scatter input FSDP2
issues, per rank: ``dtq.launch.metrics.CollectiveBytes``), so every mode is measured the same way.
Each step starts on an idle GPU; ``host ms by rank`` is the median time each rank's host takes to
issue a step (a step near it is host-bound, and a collective waits for the slowest rank).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.launch.metrics import CollectiveBytes  # counts bytes at torch.distributed's collectives

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import print_gaps, print_host, print_kernels  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):  # [B, S, H]
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(o)
        a, g = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(a) * g)


MODES = (
    "bf16",
    "dtq fp8 (hp shards)",
    "dtq fp8 (bf16 gather)",
    "dtq fp8 (quantized params)",
    "dtq hybrid (quantized params)",
    "torchao float8",
    "torchao float8 (bf16 gather)",
)
# The issue-16 row: BF16 and dtq FP8 eager and compiled against torchao float8 compiled.
COMPILED_MODES = (
    "bf16",
    "bf16 compiled",
    "torchao float8 compiled",
    "dtq fp8 (hp shards)",
    "dtq fp8 (hp shards) compiled",
    "dtq fp8 (bf16 gather) compiled",  # (its per-tensor FP8 GEMMs run from the compiled graph)
    "dtq fp8 (quantized params) compiled",
)
PRESETS = {"1b": {"layers": 16, "hidden": 2048, "heads": 16, "ffn": 8192, "batch": 4, "seq": 2048}}


def build(args, mode: str):
    compiled = mode.endswith(" compiled")
    mode = mode.removesuffix(" compiled")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = torch.nn.Sequential(*[Block(args.hidden, args.heads, args.ffn) for _ in range(args.layers)])
    model = model.to(torch.bfloat16)
    recipe, opt = None, None
    if mode.startswith("dtq"):
        recipe = (
            dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling())
            if "hybrid" in mode
            else dtq.Float8CurrentScaling()
        )
        quantized = "quantized params" in mode
        dtq.convert(model, recipe=recipe if quantized else None, quantized_params=quantized)
        if "bf16 gather" in mode:
            dtq.parallel.gather_high_precision(model)
    elif mode.startswith("torchao float8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        fp8_gather = "bf16 gather" not in mode
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather))
    for i, block in enumerate(model):
        if compiled:
            block = model[i] = torch.compile(block)
        fully_shard(block)
    fully_shard(model)
    if "quantized params" in mode:
        opt = dtq.optim.MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, recipe, opt


def after_step(model, mode: str) -> None:
    mode = mode.removesuffix(" compiled")
    if mode == "torchao float8":  # (with FP8 all-gather)
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
    elif mode == "dtq fp8 (hp shards)":
        dtq.parallel.precompute_amax(model)


def dynamo_counts() -> dict:
    """What dynamo did during the timed steps: frames it set out to compile and graphs it compiled
    (a steady step compiles none; a recompile shows here, and a frame past its recompile limit,
    which dynamo then runs eagerly, warns in the log)."""
    c = torch._dynamo.utils.counters
    return {"frames": c["frames"].get("total", 0), "graphs": c["stats"].get("unique_graphs", 0)}


_ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counts() -> dict:
    """The CUDA caching allocator's counters that mean host stalls: cudaMalloc / cudaFree calls
    (a free synchronizes the device), retries after an out-of-memory (free everything cached, then
    allocate again) and whole-device synchronizations. A steady step makes none; a step that does
    waits on the GPU, which shows as a slow step in the spread."""
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in _ALLOCATOR_KEYS}


def make_step(model, recipe, opt, x, mode: str, backward_thread: str = "autograd"):
    def train_step():
        with dtq.autocast(recipe, enabled=recipe is not None):
            loss = model(x).float().square().mean()
        with torch.autograd.set_multithreading_enabled(backward_thread == "autograd"):
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_step(model, mode)

    return train_step


def profile_mode(args, mode: str, rank: int) -> None:
    """Kernels, GPU idle gaps and host regions of ``mode``'s step (a fresh model, two warm-up steps);
    every rank steps (collectives), rank 0 prints (and writes the trace, with ``--trace``)."""
    model, recipe, opt = build(args, mode)
    x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16)
    train_step = make_step(model, recipe, opt, x, mode, args.backward_thread)
    for _ in range(2):
        train_step()
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(sys.stdout if rank == 0 else null):
        print(f"{mode}:")
        print_kernels(train_step, torch.device("cuda"), args.profile)
        print_gaps(train_step, args.profile)
        name = "".join(c if c.isalnum() else "_" for c in mode)
        print_host(train_step, args.profile, trace=f"{args.trace}/{name}.json" if args.trace and rank == 0 else "")
    del model, opt, train_step
    torch.cuda.empty_cache()


def python_profile(args, mode: str, rank: int, steps: int = 3) -> None:
    """cProfile of ``steps`` of ``mode``'s steps on every rank (a fresh model, two warm-up steps),
    printed by rank 0: the ``--python`` functions with the most time of their own and the most
    inclusive time, seconds over the ``steps``. Backward runs on the calling thread, where cProfile
    looks; cProfile slows Python several-fold, so read the rows against each other."""
    import cProfile
    import io
    import pstats

    model, recipe, opt = build(args, mode)
    x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16)
    train_step = make_step(model, recipe, opt, x, mode, "caller")  # backward on this thread: where cProfile looks
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(2):
            train_step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            train_step()
        torch.cuda.synchronize()
        prof.disable()
    if rank == 0:
        if args.python_dump:
            os.makedirs(args.python_dump, exist_ok=True)
            prof.dump_stats(os.path.join(args.python_dump, "".join(c if c.isalnum() else "_" for c in mode) + ".prof"))
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats(key).print_stats(args.python)
            print(f"{mode}: Python by {key} ({steps} steps; divide by {steps} for per step)")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-12000:])
    del model, opt, train_step
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--preset", choices=sorted(PRESETS), help="shapes of a trainer config (overrides the above)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated; a mode + ' compiled' compiles each block")
    p.add_argument("--compiled-modes", action="store_true", help="print the eager-vs-compiled mode list and exit")
    p.add_argument(
        "--profile", type=int, default=0, metavar="TOP", help="after timing: each mode's TOP kernels, gaps, host"
    )
    p.add_argument("--trace", default="", help="with --profile: a folder for rank 0's host traces (Python stacks)")
    p.add_argument(
        "--python", type=int, default=0, metavar="TOP", help="after timing: each mode's TOP Python functions (cProfile)"
    )
    p.add_argument("--python-dump", default="", help="with --python: a folder for rank 0's raw pstats files")
    p.add_argument(
        "--backward-thread",
        choices=["autograd", "caller"],
        default="autograd",
        help="where backward runs: torch's worker thread per device (its default) or the calling thread "
        "(torch.autograd.set_multithreading_enabled(False), the trainer's default)",
    )
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.compiled_modes:
        print(",".join(COMPILED_MODES))
        return
    for k, v in PRESETS.get(args.preset, {}).items():
        setattr(args, k, v)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    results = []
    with CollectiveBytes() as counter:  # for the whole run: every mode is counted alike
        for mode in args.modes.split(","):
            try:
                model, recipe, opt = build(args, mode)
            except ImportError as e:
                if rank == 0:
                    print(f"{mode}: skipped ({e})")
                continue
            n_params = sum(p.numel() for p in model.parameters())
            x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16)
            train_step = make_step(model, recipe, opt, x, mode, args.backward_thread)
            times, host = [], []
            torch.cuda.reset_peak_memory_stats()
            for step in range(args.steps):
                if step == args.steps // 2:  # steady state: count the second half only
                    counter.take()
                    dtq.parallel.comm_stats(reset=True)
                    torch._dynamo.utils.counters.clear()
                    alloc0 = allocator_counts()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                train_step()
                host.append(time.perf_counter() - t0)  # issued: what the host needed (GPU not waited on)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            counted, moved = args.steps - args.steps // 2, counter.take()
            step_s = statistics.median(times[args.steps // 2 :])
            # each rank's host time per step: a collective's kernel waits for the slowest rank's launch
            host_ms = [None] * world
            dist.all_gather_object(host_ms, statistics.median(host[args.steps // 2 :]) * 1e3)
            row = {
                "mode": mode,
                "world": world,
                "params": n_params,
                "step_ms": step_s * 1e3,
                "timed_steps_ms": [t * 1e3 for t in times[args.steps // 2 :]],  # the spread, not only the median
                "tokens_per_s": world * args.batch * args.seq / step_s,
                "all_gather_mb_per_step": moved.get("all_gathered", 0) / counted / 1e6,
                "reduce_scatter_mb_per_step": moved.get("reduce_scattered", 0) / counted / 1e6,
                "dtq_comm_stats_mb_per_step": {k: v / counted / 1e6 for k, v in dtq.parallel.comm_stats().items()},
                "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20,
                "host_ms_by_rank": host_ms,
                "dynamo": dynamo_counts(),
                "allocator": {k: v - alloc0[k] for k, v in allocator_counts().items()},  # over the timed steps
            }
            results.append(row)
            if rank == 0:
                print(
                    f"{mode:32s} {row['step_ms']:8.1f} ms/step  {row['tokens_per_s']:10,.0f} tok/s  "
                    f"AG {row['all_gather_mb_per_step']:8.1f} MB  RS {row['reduce_scatter_mb_per_step']:8.1f} MB  "
                    f"peak {row['peak_mem_mib']:7.0f} MiB  host ms by rank "
                    f"{'/'.join(f'{h:.1f}' for h in host_ms)}  (steps {min(row['timed_steps_ms']):.1f}-"
                    f"{max(row['timed_steps_ms']):.1f} ms; dynamo {row['dynamo']}; allocator {row['allocator']})",
                    flush=True,
                )
            del model, opt, train_step
            torch.cuda.empty_cache()
    if args.profile:  # after every timing: a profiler session slows the launches of the steps after it
        for mode in [r["mode"] for r in results]:
            profile_mode(args, mode, rank)
    if args.python:
        for mode in [r["mode"] for r in results]:
            python_profile(args, mode, rank)
    if rank == 0 and results:
        base = results[0]
        for r in results:
            r["step_vs_first"] = r["step_ms"] / base["step_ms"]
            r["all_gather_vs_first"] = r["all_gather_mb_per_step"] / max(base["all_gather_mb_per_step"], 1e-9)
        print("\nratios to", base["mode"] + ":")
        for r in results:
            print(f"  {r['mode']:32s} step {r['step_vs_first']:.2f}x  all-gather bytes {r['all_gather_vs_first']:.2f}x")
        if args.out:
            commit = (
                os.environ.get("DTQ_COMMIT")
                or subprocess.run(  # the device's copy may carry a stale .git
                    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
                ).stdout.strip()
            )
            meta = {
                "date": time.strftime("%Y-%m-%d"),
                "commit": commit,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(),
                "world": world,
                **vars(args),
            }
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
