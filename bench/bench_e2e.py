"""End-to-end benchmark: a plain PyTorch Llama-style decoder stack, as users write it, trained one
step at a time (forward, backward, fused AdamW) in BF16, under torchao float8, and under every dtq
recipe after ``dtq.convert``, eager and compiled, all in one run; prints ms/step, tokens/s and
ratios to BF16 and to torchao.

    python bench/bench_e2e.py                                  # hidden 2048 (4 layers) and 4096 (2)
    python bench/bench_e2e.py --hidden 1024 --layers 8 --seq 2048
    python bench/bench_e2e.py --recipes fp8 mxfp8 --no-eager --out bench/results/e2e.json
    python bench/bench_e2e.py --hidden 1024 --layers 8 --seq 2048 --size-rule   # + dtq.SizeRule rows
    python bench/bench_e2e.py --hidden 2048 --recipes fp8 --gaps 15   # + where each variant's GPU idles
    python bench/bench_e2e.py --smoke                           # tiny, any device: the script runs

Each layer: RMSNorm, q/k/v/o ``nn.Linear`` (head dim 128), causal SDPA, residual, RMSNorm, SwiGLU
MLP (gate/up/down ``nn.Linear``, FFN 8/3 x hidden rounded up to 256), residual. The input is a
random BF16 ``[batch, seq, hidden]`` tensor (no embedding); loss = mean of the squared output.
Compiled variants compile each decoder block (``torch.compile(block)``, as torchtitan and the dtq
trainer do); dtq's GEMMs are custom ops inside those graphs. torchao rows use
``convert_to_float8_training`` (tensorwise and rowwise recipes), compiled the same way. Timing:
CUDA events around ``--inner`` back-to-back steps after ``--warmup`` steps, median of ``--iters``
samples (with ``--rounds R``: every variant built first, then timed in turn R times, all at once
in memory). GiB: each variant's own peak, above what was allocated before it was built. A variant
that fails prints its error in its row; the others still run.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layers import recipes  # noqa: E402

import dtq  # noqa: E402


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, head_dim: int, dtype, device):
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        ffn = -(-8 * hidden // 3 // 256) * 256
        self.heads, self.head_dim = hidden // head_dim, head_dim
        self.attn_norm = torch.nn.RMSNorm(hidden, dtype=dtype, device=device)
        self.q, self.k = torch.nn.Linear(hidden, hidden, **kw), torch.nn.Linear(hidden, hidden, **kw)
        self.v, self.o = torch.nn.Linear(hidden, hidden, **kw), torch.nn.Linear(hidden, hidden, **kw)
        self.mlp_norm = torch.nn.RMSNorm(hidden, dtype=dtype, device=device)
        self.gate, self.up = torch.nn.Linear(hidden, ffn, **kw), torch.nn.Linear(hidden, ffn, **kw)
        self.down = torch.nn.Linear(ffn, hidden, **kw)

    def forward(self, x):
        b, s, h = x.shape
        n = self.attn_norm(x)
        q, k, v = (p(n).view(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(a)
        n = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(n)) * self.up(n))


class Stack(torch.nn.Module):
    def __init__(self, hidden: int, layers: int, head_dim: int, dtype, device):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Layer(hidden, head_dim, dtype, device) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(hidden, dtype=dtype, device=device)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def compile_blocks(model: Stack, mode: str | None = None) -> Stack:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, mode=mode)
    return model


CUDAGRAPHS = "reduce-overhead"  # --cudagraphs: the same variants, each block under CUDA graphs


def graphed(model: Stack) -> Stack:
    """Mark a model whose blocks run under CUDA graphs: its step starts a new cudagraph-trees step."""
    model.cudagraphs = True
    return model


def torchao_variants(base: Stack, mode: str | None = None) -> dict:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        print(f"torchao not importable ({e}); skipping the torchao rows")
        return {}
    out = {}
    for label, cfg in (
        ("tensorwise", Float8LinearConfig()),
        ("rowwise", Float8LinearConfig.from_recipe_name("rowwise")),
    ):
        suffix = ", cudagraphs" if mode == CUDAGRAPHS else ""
        out[f"torchao float8 {label} compiled{suffix}"] = (
            lambda cfg=cfg: compile_blocks(convert_to_float8_training(copy.deepcopy(base), config=cfg), mode),
            None,
        )
    return out


def prepare(build, recipe, x, args, device):
    """Build a variant and run its warm-up steps; returns its step function."""
    model = build()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")

    graphs = getattr(model, "cudagraphs", False)

    def step():
        if graphs:  # a new iteration: cudagraph trees may reuse the last step's output buffers
            torch.compiler.cudagraph_mark_step_begin()
        with record_function("forward"), dtq.autocast(recipe, enabled=recipe is not None):
            loss = model(x).float().square().mean()
        with record_function("backward"), torch.autograd.set_multithreading_enabled(args.backward_thread == "autograd"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    return step


def sample(step, args, device, host: list | None = None) -> list[float]:
    """``--iters`` timings (ms per step) of ``--inner`` back-to-back steps each; ``host`` collects
    the host's time per step to issue them (CUDA: well below the step time, the host ran ahead and
    waited only at the end; near it, either the host is the bound or it blocked on a full launch
    queue, about a thousand pending launches: ``host_step.py`` at few tokens tells which)."""
    samples = []
    for _ in range(args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(args.inner):
                step()
            end.record()
            if host is not None:
                host.append((time.perf_counter() - t0) * 1e3 / args.inner)
            end.synchronize()
            samples.append(start.elapsed_time(end) / args.inner)
        else:
            t0 = time.perf_counter()
            for _ in range(args.inner):
                step()
            samples.append((time.perf_counter() - t0) * 1e3 / args.inner)
    return samples


def memory_mark(device) -> int:
    """Start a variant's peak-memory window: bytes allocated now (the input, the base model and,
    in an interleaved run, every variant built before, which stays alive to be timed in turn)."""
    if device.type != "cuda":
        return 0
    gc.collect()  # (an earlier variant's model left in a reference cycle would be freed inside the window)
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def own_peak_gib(device, mark: int) -> float:
    """The variant's own peak since ``memory_mark``: its model copy, optimizer state, activations
    and workspaces, without what was allocated before it (which, counted in, made every later
    variant of an interleaved run look larger by the earlier variants' models)."""
    return (torch.cuda.max_memory_allocated() - mark) / 2**30 if device.type == "cuda" else 0.0


def time_variant(build, recipe, x, args, device) -> dict:
    mark = memory_mark(device)
    step = prepare(build, recipe, x, args, device)
    host: list[float] = []
    samples = sample(step, args, device, host)
    peak = own_peak_gib(device, mark)
    if args.profile:
        print_kernels(step, device, args.profile)
    if args.gaps and device.type == "cuda":
        print_gaps(step, args.gaps)
    row = {"ms": statistics.median(samples), "peak_gib": peak}
    if host:
        row["host_ms"] = statistics.median(host)
    return row


def time_interleaved(variants: dict, x, args, device) -> dict:
    """``--rounds`` > 1: every variant is built and warmed up first, then timed in turn, round after
    round, so that drift (clocks, temperature, the allocator) spreads over all of them alike; the
    median over all rounds' samples. Peak memory is each variant's own during its warm-up
    (:func:`own_peak_gib`)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    steps, rows = {}, {}
    for name, (build, recipe) in variants.items():
        mark = memory_mark(device)
        try:
            steps[name] = prepare(build, recipe, x, args, device)
            peak = own_peak_gib(device, mark)
            rows[name] = {"samples": [], "peak_gib": peak}
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    for _ in range(args.rounds):
        for name, step in steps.items():
            rows[name]["samples"] += sample(step, args, device)
    for name in steps:
        rows[name]["ms"] = statistics.median(rows[name].pop("samples"))
        print(f"  {name}: {rows[name]}", flush=True)
        if args.gaps and device.type == "cuda":
            print_gaps(steps[name], args.gaps)
    return rows


def print_kernels(step, device, top: int) -> None:
    """The ``top`` GPU kernels of two steps by total time (ms per step), to see where a variant
    spends its device time beyond the GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == ("CUDA" if device.type == "cuda" else "CPU")]
    total = sum(e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total for e in events)
    print(f"    device time per step {total / 2e3:.2f} ms; top kernels (ms/step, calls/step):")
    events.sort(key=lambda e: -(e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total))
    for e in events[:top]:
        t = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        print(f"    {t / 2e3:8.3f} {e.count / 2:6.0f}  {e.key[:110]}")


HOST_PREFIXES = ("FSDP", "Optimizer", "CompiledFunction", "## Call", "autograd::engine", "dtq::", "c10d::", "aten::_sc")


def print_host(step, top: int, steps: int = 2, trace: str = "") -> None:
    """Where the host's time goes in ``steps`` steps: the ``top`` host regions and ops (FSDP2's
    hooks, compiled graph calls, dtq's ops, collectives, the optimizer) by inclusive time, ms per
    step. ``trace``: also write the chrome trace there, with Python stacks (a timeline to read)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU], with_stack=bool(trace)) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    events = [e for e in prof.key_averages() if e.key.startswith(HOST_PREFIXES)]
    events.sort(key=lambda e: -e.cpu_time_total)
    print("    host time per step, ms (inclusive, self, calls per step):")
    for e in events[:top]:
        total, own = e.cpu_time_total / steps / 1e3, e.self_cpu_time_total / steps / 1e3
        print(f"    {total:8.2f} {own:7.2f} {e.count / steps:5.0f}  {e.key[:90]}")


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_gaps(trace: dict, top: int) -> tuple[float, list[dict]]:
    """From a torch.profiler chrome trace: the GPU's idle time (µs, summed over the gaps between
    device activities, any stream) and the ``top`` largest gaps. Each gap names the step phase
    (``record_function``) and the host ops (outermost first) that launched the activity ending it,
    and ``late_us``: how long after the GPU went idle the host launched it (positive: the host fell
    behind; negative: launched in time, the wait is a dependency or a synchronisation)."""
    events = trace["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in _DEVICE_CATS and e.get("ph") == "X"), key=lambda e: e["ts"])
    launches = {  # runtime launches, and the driver's (inductor's Triton kernels launch through it)
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X"]
    gaps, idle, end = [], 0.0, None
    for e in device:
        if end is not None and e["ts"] > end:
            idle += e["ts"] - end
            gaps.append((e["ts"] - end, end, e))
        end = max(end or e["ts"], e["ts"] + e["dur"])
    gaps.sort(key=lambda g: -g[0])
    out = []
    for length, start, e in gaps[:top]:
        launch = launches.get(e.get("args", {}).get("correlation"))
        row = {"gap_us": length, "next": e["name"][:60], "phase": "?", "ops": [], "late_us": None}
        if launch is not None:
            t = launch["ts"]
            row["late_us"] = t - start
            around = [h for h in host if h["tid"] == launch["tid"] and h["ts"] <= t <= h["ts"] + h["dur"]]
            around.sort(key=lambda h: -h["dur"])  # outermost first
            phases = [h["name"] for h in around if h.get("cat") == "user_annotation"]
            row["phase"] = phases[0] if phases else "?"
            row["ops"] = [h["name"] for h in around if h.get("cat") == "cpu_op"]
        out.append(row)
    return idle, out


def print_gaps(step, top: int, steps: int = 2) -> None:
    """Where the GPU idles in ``steps`` steps: the idle time per step and the ``top`` largest gaps
    (see :func:`idle_gaps`)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    idle, gaps = idle_gaps(trace, top)
    print(f"    GPU idle {idle / steps / 1e3:.2f} ms per step (profiled); largest gaps (us, host late by us):")
    for g in gaps:
        late = "-" if g["late_us"] is None else f"{g['late_us']:.0f}"
        ops = " > ".join(g["ops"][-3:])
        print(f"    {g['gap_us']:8.1f} {late:>7s}  {g['phase']:9s} {ops[:90]}  -> {g['next']}")


def commit() -> str:
    if os.environ.get("DTQ_COMMIT"):
        return os.environ["DTQ_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_header(device: torch.device, **fields) -> dict:
    """What a benchmark run records first (device, versions, commit, date, then ``fields``), printed
    as one line."""
    header = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        **fields,
    }
    print(" | ".join(f"{k} {v}" for k, v in header.items()), flush=True)
    return header


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--layers", type=int, default=None, help="default: 4 up to hidden 2048, else 2")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--recipes", nargs="*", default=None, help=f"subset of {list(recipes())}")
    p.add_argument("--no-eager", action="store_true", help="skip the eager dtq rows")
    p.add_argument("--no-compile", action="store_true", help="skip every compiled row")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument(
        "--cudagraphs",
        action="store_true",
        help="also BF16, torchao tensorwise and every dtq recipe with each block compiled under CUDA graphs "
        "(mode='reduce-overhead'; inductor drops CUDA graphs silently where it cannot capture a graph, as for "
        "dtq's under torch 2.11: a host time near the compiled row's says so, bench/probe_cudagraphs.py tells)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="> 1: build every variant first, then time them in turn this many rounds (drift spreads evenly)",
    )
    p.add_argument(
        "--profile", type=int, default=0, metavar="N", help="also print each variant's N most expensive GPU kernels"
    )
    p.add_argument(
        "--gaps",
        type=int,
        default=0,
        metavar="N",
        help="also print where the GPU idles in each variant's steps: its N largest gaps and what the host was "
        "doing (CUDA only)",
    )
    p.add_argument(
        "--size-rule",
        action="store_true",
        help="also each dtq recipe converted with dtq.SizeRule.measured(recipe, tokens=batch*seq): GEMMs too "
        "small to gain kept in BF16",
    )
    p.add_argument(
        "--backward-thread",
        choices=["autograd", "caller"],
        default="autograd",
        help="where backward runs: torch's worker thread per device (its default, as most loops run it) or the "
        "calling thread (torch.autograd.set_multithreading_enabled(False), the trainer's default)",
    )
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.hidden, args.layers, args.batch, args.seq, args.head_dim = [256], 1, 2, 64, 64
        args.warmup, args.iters, args.inner = 1, 1, 1
    chosen = recipes() if args.recipes is None else {k: recipes()[k] for k in args.recipes}
    try:
        import torchao

        ao_version = torchao.__version__
    except ImportError:
        ao_version = "absent"
    header = run_header(device, torchao=ao_version, batch=args.batch, seq=args.seq)
    results = []
    for hidden in args.hidden:
        layers = args.layers or (4 if hidden <= 2048 else 2)
        torch.manual_seed(0)
        base = Stack(hidden, layers, args.head_dim, torch.bfloat16, device)
        x = torch.randn(args.batch, args.seq, hidden, device=device, dtype=torch.bfloat16)
        variants = {"bf16 eager": (lambda: copy.deepcopy(base), None)}
        if not args.no_compile:
            variants["bf16 compiled"] = (lambda: compile_blocks(copy.deepcopy(base)), None)
            if not args.no_torchao and device.type == "cuda":
                variants.update(torchao_variants(base))
        if args.cudagraphs and device.type == "cuda":
            variants["bf16 compiled, cudagraphs"] = (
                lambda: graphed(compile_blocks(copy.deepcopy(base), CUDAGRAPHS)),
                None,
            )
            if not args.no_torchao:
                for name, (build, _) in torchao_variants(base, CUDAGRAPHS).items():
                    if "tensorwise" in name:
                        variants[name] = (lambda build=build: graphed(build()), None)
            for name, recipe in chosen.items():
                variants[f"dtq {name} compiled, cudagraphs"] = (
                    lambda: graphed(compile_blocks(dtq.convert(copy.deepcopy(base)), CUDAGRAPHS)),
                    recipe,
                )
        for name, recipe in chosen.items():
            if not args.no_eager:
                variants[f"dtq {name} eager"] = (lambda: dtq.convert(copy.deepcopy(base)), recipe)
            if not args.no_compile:
                variants[f"dtq {name} compiled"] = (lambda: compile_blocks(dtq.convert(copy.deepcopy(base))), recipe)
            if args.size_rule:
                rule = dtq.SizeRule.measured(recipe, tokens=args.batch * args.seq)
                ruled = lambda recipe=recipe, rule=rule: dtq.convert(copy.deepcopy(base), recipe=recipe, size_rule=rule)  # noqa: E731
                if not args.no_eager:
                    variants[f"dtq {name} eager, size rule"] = (ruled, recipe)
                if not args.no_compile:
                    variants[f"dtq {name} compiled, size rule"] = (lambda ruled=ruled: compile_blocks(ruled()), recipe)
        rows = time_interleaved(variants, x, args, device) if args.rounds > 1 else {}
        for name, (build, recipe) in variants.items() if args.rounds == 1 else ():
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                rows[name] = time_variant(build, recipe, x, args, device)
            except Exception as e:  # noqa: BLE001 - report and go on with the other variants
                rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            print(f"  {name}: {rows[name]}", flush=True)
        tokens = args.batch * args.seq
        ref = rows["bf16 eager"].get("ms")
        ref_c = rows.get("bf16 compiled", {}).get("ms")
        ao = rows.get("torchao float8 tensorwise compiled", {}).get("ms")
        print(f"\nhidden {hidden}, {layers} layers, {tokens} tokens/step")
        print(
            f"{'variant':40s} {'ms/step':>8s} {'tok/s':>10s} {'vs bf16':>8s} {'vs bf16 c':>9s} {'vs ao tw':>8s} "
            f"{'GiB':>6s} {'host ms':>7s}"
        )
        for name, r in rows.items():
            results.append({"hidden": hidden, "layers": layers, "tokens": tokens, "variant": name, **r})
            if "error" in r:
                print(f"{name:40s} failed: {r['error']}")
                continue
            ms = r["ms"]

            def ratio(other):
                return f"{other / ms:.2f}x" if other else "-"

            print(
                f"{name:40s} {ms:8.2f} {tokens / ms * 1e3:10.0f} {ratio(ref):>8s} {ratio(ref_c):>9s} "
                f"{ratio(ao) if name.startswith('dtq') else '':>8s} {r['peak_gib']:6.1f} "
                f"{r['host_ms'] if 'host_ms' in r else float('nan'):7.2f}"
            )
            results[-1].update({"tokens_per_s": tokens / ms * 1e3, "vs_bf16": ref / ms if ref else None})
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
