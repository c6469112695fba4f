"""Which GEMM sizes gain from quantization, measured as a model runs them: a stack of Linear
pairs (``K -> N``, then ``N -> K``), forward + backward + fused AdamW, in BF16 and under dtq
recipes (eager, and compiled for ``--compiled`` recipes), over a grid of N and K at ``--tokens``
tokens per GEMM; prints each recipe's speed relative to BF16 (eager to eager, compiled to
compiled) and the :class:`dtq.SizeRule` the grid supports: the thresholds (from the grid's
values) that convert the most grid points while every converted one runs at least ``--margin`` x
BF16's speed.

    python bench/gemm_sizes.py --out bench/results/sizes.json
    python bench/gemm_sizes.py --sizes 1024 2048 4096 --tokens 16384 --recipes fp8 mxfp8
    python bench/gemm_sizes.py --smoke           # tiny, any device: the script runs

A pair of sizes {a, b} times both orientations (a -> b and b -> a) in one stack, so each grid
point is an unordered pair and the rule is stated on min(N, K) and N * K, both symmetric.
``dtq.SizeRule.measured`` holds what this script printed on the devices named there.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import run_header, time_variant  # noqa: E402
from bench_layers import recipes  # noqa: E402

import dtq  # noqa: E402


def pair_stack(a: int, b: int, pairs: int, device) -> torch.nn.Sequential:
    layers = []
    for _ in range(pairs):
        layers += [torch.nn.Linear(a, b, bias=False), torch.nn.Linear(b, a, bias=False)]
    return torch.nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)


def loosest_rule(points: dict, margin: float) -> tuple[int, int] | None:
    """``(min_features, min_weight_numel)`` from the grid's values that converts the most grid
    points ``(a, b)`` (those with ``a >= min_features`` and ``a * b >= min_weight_numel``), every
    one of them at ratio >= margin; ties go to the smaller thresholds. None: no point gains."""
    best, best_count = None, 0
    for f in sorted({a for a, _ in points}):
        for s in sorted({a * b for a, b in points}):
            kept = [r for (a, b), r in points.items() if a >= f and a * b >= s]
            if kept and min(kept) >= margin and len(kept) > best_count:
                best, best_count = (f, s), len(kept)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--pairs", type=int, default=2, help="Linear pairs in the stack")
    p.add_argument("--recipes", nargs="*", default=["fp8", "fp8-row", "fp8-block", "mxfp8", "hybrid mxfp8/nvfp4"])
    p.add_argument("--compiled", nargs="*", default=["fp8"], help="recipes also timed compiled (with BF16 compiled)")
    p.add_argument("--margin", type=float, default=1.05, help="speed over BF16 a converted point must reach")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    args.profile = 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.sizes, args.tokens, args.pairs, args.recipes, args.compiled = [128, 256], 128, 1, ["fp8"], ["fp8"]
        args.warmup, args.iters, args.inner = 1, 1, 1
    table = recipes()
    unknown = sorted(set(args.recipes + args.compiled) - set(table))
    if unknown:
        p.error(f"unknown recipes {unknown}; choose from {sorted(table)}")
    header = run_header(device, tokens=args.tokens, pairs=args.pairs)
    results = []
    ratios: dict[str, dict] = {}
    for a, b in itertools.combinations_with_replacement(sorted(args.sizes), 2):
        torch.manual_seed(0)
        base = pair_stack(a, b, args.pairs, device)
        x = torch.randn(args.tokens, a, device=device, dtype=torch.bfloat16, requires_grad=True)
        variants = {"bf16 eager": (lambda: copy.deepcopy(base), None, None)}
        for name in args.recipes:
            variants[f"{name} eager"] = (lambda: dtq.convert(copy.deepcopy(base)), table[name], "bf16 eager")
        if args.compiled:
            variants["bf16 compiled"] = (lambda: torch.compile(copy.deepcopy(base)), None, None)
        for name in args.compiled:
            variants[f"{name} compiled"] = (
                lambda: torch.compile(dtq.convert(copy.deepcopy(base))),
                table[name],
                "bf16 compiled",
            )
        rows = {}
        for label, (build, recipe, ref) in variants.items():
            torch._dynamo.reset()
            try:
                rows[label] = time_variant(build, recipe, x, args, device)
            except Exception as e:  # noqa: BLE001 - report and go on with the other variants
                rows[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            r = rows[label]
            ratio = rows[ref]["ms"] / r["ms"] if ref and "ms" in r and "ms" in rows.get(ref, {}) else None
            if ref is not None and ratio is not None:
                ratios.setdefault(label, {})[(a, b)] = ratio
            results.append({"a": a, "b": b, "variant": label, **r, "vs_bf16": ratio})
            shown = f"{r['ms']:8.3f} ms" if "ms" in r else r["error"]
            print(f"  [{a:5d} x {b:5d}] {label:22s} {shown}" + (f"  {ratio:.2f}x" if ratio else ""), flush=True)
    print(f"\nspeed over BF16, {args.tokens} tokens, pairs {{a, b}} (rows a, columns b):")
    sizes = sorted(args.sizes)
    rules = {}
    for label, pts in ratios.items():
        print(f"\n{label}\n{'':>7s}" + "".join(f"{s:>8d}" for s in sizes))
        for a in sizes:
            cells = [f"{pts[(a, b)]:7.2f}x" if (a, b) in pts else f"{'':>8s}" for b in sizes]
            print(f"{a:>7d}" + "".join(cells))
        rules[label] = loosest_rule(pts, args.margin)
        rule = rules[label]
        print(
            f"  size rule (>= {args.margin}x): "
            + ("none gains" if rule is None else f"dtq.SizeRule(min_features={rule[0]}, min_weight_numel={rule[1]})")
        )
    if args.out:
        Path(args.out).write_text(json.dumps({**header, "results": results, "rules": rules}, indent=1))


if __name__ == "__main__":
    main()
