"""Layer benchmark: Llama-3-8B-shaped Linear and SwiGLU MLP, forward + backward, BF16 vs every dtq
recipe, two hybrids, and torchao float8 (tensorwise and rowwise, eager and torch.compile'd), in one run;
on a GPU also BF16 and dtq FP8 under torch.compile (dtq's GEMMs eager, the rest fused). The MLP
also runs as ``dtq.nn.LayerNormMLP`` (fused SwiGLU kernels that also hand the next quantization
its amax), and in BF16 with that fused SwiGLU alone ("+fused swiglu").

    python bench/bench_layers.py --out bench/results/layers.json
    python bench/bench_layers.py --smoke        # tiny shapes, any device: checks the script runs

It first measures the device's ceilings (BF16 GEMM, FP8 per-tensor, row-wise and 1x128 x 128x128
blockwise scaled GEMMs at 8192^3, copy bandwidth), then times each layer (CUDA events around --inner
back-to-back steps, median of --iters samples after warm-up) and prints speed-ups over BF16 and
the fraction of the BF16 GEMM ceiling reached (model FLOPs: 6 * tokens * params, fwd + bwd).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

import dtq


class SwiGLU(torch.nn.Module):
    """RMSNorm, then down(silu(gate(x)) * up(x)) with gate and up fused in one Linear; ``fused``:
    the activation by ``dtq.nn.functional.swiglu`` (one kernel each way) instead of eager ops."""

    def __init__(self, hidden: int, ffn: int, dtype, device, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.norm = torch.nn.RMSNorm(hidden, dtype=dtype, device=device)
        self.fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype, device=device)
        self.fc2 = torch.nn.Linear(ffn, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        if self.fused:
            return self.fc2(dtq.nn.functional.swiglu(h))
        a, b = h.chunk(2, dim=-1)
        return self.fc2(F.silu(a) * b)


def layernorm_mlp(base: SwiGLU) -> dtq.nn.LayerNormMLP:
    """``base`` as one dtq.nn.LayerNormMLP (same weights; gate and up as its two halves)."""
    fc1, fc2 = base.fc1.weight, base.fc2.weight
    mlp = dtq.nn.LayerNormMLP(
        fc1.shape[1],
        fc2.shape[1],
        bias=False,
        normalization="RMSNorm",
        activation="swiglu",
        eps=base.norm.eps or torch.finfo(fc1.dtype).eps,
        params_dtype=fc1.dtype,
        device=fc1.device,
        name="mlp",
    )
    with torch.no_grad():
        mlp.norm.weight.copy_(base.norm.weight)
        mlp.fc1_weight.copy_(fc1)
        mlp.fc2_weight.copy_(fc2)
    return mlp


def recipes() -> dict:
    return {
        "fp8": dtq.Float8CurrentScaling(),
        "fp8-delayed": dtq.DelayedScaling(),
        "fp8-block": dtq.Float8BlockScaling(),
        "fp8-row": dtq.Float8RowwiseScaling(),
        "mxfp8": dtq.MXFP8BlockScaling(),
        "nvfp4": dtq.NVFP4BlockScaling(),
        "hybrid mxfp8/nvfp4": dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling()),
        "hybrid fp8-block/mxfp8": dtq.hybrid_recipe(dtq.Float8BlockScaling(), dtq.MXFP8BlockScaling()),
    }


def timer(fn, iters: int, warmup: int, device: torch.device, inner: int = 1) -> float:
    """Median milliseconds of ``fn()``; each sample times ``inner`` back-to-back calls (the host
    queues the next step while the GPU runs this one, as in training) and divides."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


def ceilings(device: torch.device, n: int, iters: int) -> dict:
    """Measured peaks: TFLOP/s of BF16 / FP8 GEMMs, GB/s of a copy (read + write)."""
    out = {}
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out["bf16_gemm_tflops"] = 2 * n**3 / timer(lambda: a @ b, iters, 3, device) / 1e9
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out["copy_gbps"] = 2 * src.numel() / timer(lambda: dst.copy_(src), iters, 3, device) / 1e6
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        out["fp8_tensorwise_tflops"] = (
            2
            * n**3
            / timer(
                lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters, 3, device
            )
            / 1e9
        )
        rows, cols = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
        if torch.cuda.get_device_capability(device)[0] == 9:
            out["fp8_rowwise_tflops"] = (
                2
                * n**3
                / timer(
                    lambda: torch._scaled_mm(a8, b8, scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16),
                    iters,
                    3,
                    device,
                )
                / 1e9
            )
        if torch.cuda.get_device_capability(device)[0] == 9 and hasattr(F, "scaled_mm"):
            sa = torch.ones(n // 128, n, device=device).t()  # [n, n/128] column-major
            sb = torch.ones(n // 128, n // 128, device=device).t().contiguous().t()
            out["fp8_blockwise_tflops"] = (
                2
                * n**3
                / timer(
                    lambda: F.scaled_mm(
                        a8,
                        b8,
                        sa,
                        F.ScalingType.BlockWise1x128,
                        sb,
                        F.ScalingType.BlockWise128x128,
                        output_dtype=torch.bfloat16,
                    ),
                    iters,
                    3,
                    device,
                )
                / 1e9
            )
    return out


def step_fn(model, x, recipe):
    def step():
        with dtq.autocast(recipe, enabled=recipe is not None):
            y = model(x)
        y.backward(torch.ones_like(y))
        for p in model.parameters():
            p.grad = None

    return step


def torchao_models(model):
    """torchao float8, tensorwise and rowwise dynamic scaling, eager and compiled; {} without
    torchao/CUDA."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        print(f"torchao not importable ({e}); skipping the torchao rows")
        return {}
    out = {}
    for label, config in (("", None), (" rowwise", Float8LinearConfig.from_recipe_name("rowwise"))):
        out[f"torchao float8{label}"] = convert_to_float8_training(copy.deepcopy(model), config=config)
        out[f"torchao float8{label} compiled"] = torch.compile(
            convert_to_float8_training(copy.deepcopy(model), config=config)
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--inner", type=int, default=4, help="back-to-back steps per timed sample")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 iteration: check the script runs")
    p.add_argument("--only", default="", help="comma-separated row names to run (default: all)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.tokens, args.hidden, args.ffn, args.iters, args.warmup = 256, 256, 512, 1, 1
    torch.manual_seed(0)
    ceil = ceilings(device, 256 if args.smoke else 8192, args.iters)
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()}, flush=True)

    dtype = torch.bfloat16
    layers = {
        "linear": torch.nn.Linear(args.hidden, args.ffn, bias=False, dtype=dtype, device=device),
        "swiglu_mlp": SwiGLU(args.hidden, args.ffn, dtype, device),
    }
    wanted = set(filter(None, args.only.split(",")))
    rows = []
    for lname, base in layers.items():
        x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
        n_params = sum(p.numel() for n, p in base.named_parameters() if "norm" not in n)
        flops = 6 * args.tokens * n_params
        candidates = {"bf16": (base, None)}
        for name, recipe in recipes().items():
            candidates[f"dtq {name}"] = (dtq.convert(copy.deepcopy(base)), recipe)
        if isinstance(base, SwiGLU):
            # BF16 with dtq's fused SwiGLU (what the fusion alone buys), and the same MLP as
            # dtq.nn.LayerNormMLP: fused SwiGLU whose kernels also hand over the amaxes
            fused = copy.deepcopy(base)
            fused.fused = True
            candidates["bf16 +fused swiglu"] = (fused, None)
            for name in ("fp8", "fp8-block", "mxfp8", "nvfp4"):
                candidates[f"dtq {name} LayerNormMLP"] = (layernorm_mlp(base), recipes()[name])
        if device.type == "cuda":
            # torch.compile around dtq's (eager) GEMMs fuses the rest, e.g. SwiGLU's silu * up:
            # beside the BF16 model compiled the same way
            candidates["bf16 compiled"] = (torch.compile(copy.deepcopy(base)), None)
            candidates["dtq fp8 compiled"] = (torch.compile(dtq.convert(copy.deepcopy(base))), recipes()["fp8"])
            candidates.update({k: (m, None) for k, m in torchao_models(base).items()})
        bf16_ms = None
        for name, (model, recipe) in candidates.items():
            if wanted and name not in wanted and name != "bf16":
                continue
            try:
                ms = timer(step_fn(model, x, recipe), args.iters, args.warmup, device, args.inner)
            except Exception as e:  # report and go on: one failing row must not hide the others
                print(f"{lname:10s} {name:28s} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append({"layer": lname, "name": name, "error": f"{type(e).__name__}: {e}"})
                continue
            bf16_ms = bf16_ms or ms
            tflops = flops / ms / 1e9
            row = {
                "layer": lname,
                "name": name,
                "ms": ms,
                "speedup_vs_bf16": bf16_ms / ms,
                "tflops": tflops,
                "frac_bf16_ceiling": tflops / ceil["bf16_gemm_tflops"],
            }
            rows.append(row)
            print(
                f"{lname:10s} {name:28s} {ms:8.3f} ms  {bf16_ms / ms:5.2f}x BF16  {tflops:7.1f} TFLOP/s "
                f"({row['frac_bf16_ceiling']:.2f} of the BF16 GEMM ceiling)",
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
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
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
            "tokens": args.tokens,
            "hidden": args.hidden,
            "ffn": args.ffn,
            "iters": args.iters,
            "inner": args.inner,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
