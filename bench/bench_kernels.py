"""Quantize-kernel throughput against the measured copy ceiling (issue 6, part 3: kernels).

    python bench/bench_kernels.py --out bench/results/kernels.json [--sizes 16 64 256 1024] [--iters 20]

1. Copy ceiling: ``dst.copy_(src)`` of a 1 GiB buffer, (bytes read + bytes written) / time.
2. For every format, direction set and a few hybrids, at each bf16 input size (MiB), the time of
   ``quantizer.quantize(x, ...)`` on the kernel path, captured once in a CUDA graph and replayed
   (CUDA events, warm-up, median of ``--iters``), so Python overhead is not in the number.
   GB/s = (input bytes + payload bytes written) / time: the useful traffic. Formats that need a
   tensor-wide amax (FP8 per-tensor, NVFP4) or per-row / per-column amaxes (FP8 row-wise) read
   the input twice (amax pass, then the fused pass), so their ceiling on this metric is below 1.0
   of copy: the table prints it as ``ideal``.
3. The reference path (``DTQ_DISABLE_KERNELS=1``, eager) at one size, for contrast; with
   ``--generic``, also the generic fused kernel (``DTQ_GENERIC_QUANTIZE=1``) at every size.
4. The amax passes alone (max|x|, max|T x| for the random Hadamard, and FP8 row-wise's per-row
   and per-column maxima): input bytes over time, against the copy ceiling (a pure read).
5. The FP8 code transpose the native GEMMs need (``kernels.transposed``) of codes with the input's
   element count, beside torch's ``.t().contiguous()``.
6. The elementwise kernels: fused SwiGLU forward / backward with the input as the [T, 2F] gate/up
   tensor, and the emulated GEMMs' epilogue (fp32 output times two factors, cast to bf16), each
   beside the eager torch ops it replaces (``reference us``).
7. Dequantize to bf16 as the emulated GEMMs read their operands (per-tensor factor split off) of
   MXFP8, NVFP4 and FP8 1x128 payloads, each direction, in a CUDA graph: payload bytes read plus
   the bf16 written, over time.
8. FP8 per-tensor, both directions, with the columnwise codes written transposed by the same launch
   (``quantize_plan(..., transposed=True)``, what planned GEMM calls use), against the plain launch
   followed by ``kernels.transposed`` (``reference us``), amax pass included, in a CUDA graph.
Prints a table and writes JSON (device, torch, copy ceiling, every row) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dtq  # noqa: E402
from dtq import kernels  # noqa: E402
from dtq.codec import COLUMNWISE, DIRECTIONS, quantize_plan  # noqa: E402

H = dtq.HybridQuantizer
CONFIGS = [
    ("fp8", dtq.Float8Quantizer(), ("r", "c", "rc")),
    ("fp8b_1x128", dtq.Float8BlockQuantizer(), ("r", "c", "rc")),
    ("fp8b_128x128", dtq.Float8BlockQuantizer((128, 128)), ("rc",)),
    ("mxfp8", dtq.MXFP8Quantizer(), ("r", "c", "rc")),
    ("fp8 row-wise", dtq.Float8RowwiseQuantizer(), ("r", "c", "rc")),
    ("nvfp4", dtq.NVFP4Quantizer(), ("r", "c", "rc")),
    ("nvfp4_16x16", dtq.NVFP4Quantizer((16, 16)), ("rc",)),
    ("nvfp4_sr_rht", dtq.NVFP4Quantizer(stochastic_rounding=True, random_hadamard=True), ("c", "rc")),
    ("nvfp4_row_scaled", dtq.NVFP4Quantizer(row_scaled=True), ("r", "rc")),
    ("nvfp4_4over6", dtq.NVFP4Quantizer(four_over_six=True, e4m3_max=256), ("r", "c", "rc")),
    ("nvfp4_16x16_4over6", dtq.NVFP4Quantizer((16, 16), four_over_six=True, e4m3_max=256), ("rc",)),
    (
        "nvfp4_sr_rht_4over6",
        dtq.NVFP4Quantizer(stochastic_rounding=True, random_hadamard=True, four_over_six=True),
        ("rc",),
    ),
    ("identity", dtq.IdentityQuantizer(), ("rc",)),
    (
        "hyb mxfp8/nvfp4_sr_rht",
        H(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer(stochastic_rounding=True, random_hadamard=True)),
        ("rc",),
    ),
    (
        "hyb fp8b_1x128/nvfp4_16x16",
        H(rowwise=dtq.Float8BlockQuantizer(), columnwise=dtq.NVFP4Quantizer((16, 16))),
        ("rc",),
    ),
    ("hyb mxfp8/fp8b_1x128", H(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.Float8BlockQuantizer()), ("rc",)),
    (
        "hyb fp8b_1x128/fp8b_128x128",
        H(rowwise=dtq.Float8BlockQuantizer(), columnwise=dtq.Float8BlockQuantizer((128, 128))),
        ("rc",),
    ),
]
K = 4096


def _time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _graph_ms(call, iters: int) -> float:
    """Median time of ``call`` captured once in a CUDA graph and replayed: the kernels alone."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        call()
        with torch.cuda.graph(g, stream=s):
            call()
    torch.cuda.current_stream().wait_stream(s)
    return _time_ms(g.replay, iters)


def copy_ceiling(iters: int) -> float:
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda d=dst, s=src: d.copy_(s), iters)
    del src, dst
    return 2 * n / ms / 1e6  # GB/s


def _payload_bytes(t: dtq.QuantizedTensor) -> int:
    seen, total = set(), 0
    for d in t.directions:
        for v in t.payload(d).values():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    return total


def _needs_amax(q, dirs, x) -> bool:
    """Whether the kernels read the input twice: a tensor amax pass, or FP8 row-wise's axis amaxes."""

    def two_reads(codec):
        spec = codec.kernel_spec(tuple(x.shape), x.dtype)
        return codec.needs_amax() or (spec is not None and spec.amax_vector is not None)

    return any(two_reads(q.codec(d)) for d in dirs)


def bench_one(q, x, dirs: str, iters: int, seed: torch.Tensor) -> dict:
    kw = dict(rowwise="r" in dirs, columnwise="c" in dirs, seed=seed)
    t = q.quantize(x, **kw)
    out_bytes, in_bytes = _payload_bytes(t), x.numel() * x.element_size()
    del t
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q.quantize(x, **kw)  # warm-up off the capture (build, first launches)
        with torch.cuda.graph(g, stream=s):
            held = q.quantize(x, **kw)
    torch.cuda.current_stream().wait_stream(s)
    ms = _time_ms(g.replay, iters)
    del g, held
    dirnames = [d for d, on in zip(dtq.DIRECTIONS, (kw["rowwise"], kw["columnwise"])) if on]
    amax_pass = _needs_amax(q, dirnames, x)
    ideal = (in_bytes + out_bytes) / (in_bytes * (2 if amax_pass else 1) + out_bytes)
    return {
        "ms": ms,
        "in_bytes": in_bytes,
        "out_bytes": out_bytes,
        "amax_pass": amax_pass,
        "gbps": (in_bytes + out_bytes) / ms / 1e6,
        "ideal_fraction": ideal,
    }


def bench_amax(x, iters: int) -> list[dict]:
    rows = []
    ext = kernels.extension()
    m, k = x.shape
    per_row, per_col = (torch.empty(n, dtype=torch.int32, device=x.device) for n in (m, k))
    buf = torch.zeros(2, dtype=torch.int32, device=x.device)
    passes = {
        "amax x": lambda: ext.amax(x, buf, True, -1),
        "amax Tx": lambda: ext.amax(x, buf, False, 0x5A5A),
        "axis amax rows+cols": lambda: ext.axis_amax(x, per_row, per_col),
    }
    for name, call in passes.items():
        ms = _graph_ms(call, iters)  # the kernel call alone (its memsets included)
        rows.append(
            {
                "format": name,
                "dirs": "-",
                "ms": ms,
                "in_bytes": x.numel() * x.element_size(),
                "out_bytes": 0,
                "amax_pass": False,
                "gbps": x.numel() * x.element_size() / ms / 1e6,
                "ideal_fraction": 1.0,
            }
        )
    return rows


def bench_transpose(x, iters: int) -> dict:
    codes = torch.randint(0, 256, x.shape, dtype=torch.uint8, device=x.device).view(torch.float8_e4m3fn)
    ms = _time_ms(lambda: kernels.transposed(codes), iters)
    torch_ms = _time_ms(lambda: codes.t().contiguous(), iters)
    n = codes.numel()
    return {
        "format": "transpose fp8 codes",
        "dirs": "-",
        "ms": ms,
        "in_bytes": n,
        "out_bytes": n,
        "amax_pass": False,
        "gbps": 2 * n / ms / 1e6,
        "ideal_fraction": 1.0,
        "torch_ms": torch_ms,
    }


def bench_transposed_codes(x, iters: int) -> dict:
    q, dev, shape = dtq.Float8Quantizer(), x.device, tuple(x.shape)
    plain = quantize_plan(q, DIRECTIONS, shape, x.dtype, dev)
    fused = quantize_plan(q, DIRECTIONS, shape, x.dtype, dev, transposed=True)
    ms = _graph_ms(lambda: fused(x, {}, None), iters)
    ref = _graph_ms(lambda: kernels.transposed(plain(x, {}, None)[COLUMNWISE]["data"]), iters)
    n = x.numel()
    return {
        "format": "fp8 + transposed codes",
        "dirs": "rc",
        "ms": ms,
        "in_bytes": x.element_size() * n,
        "out_bytes": 2 * n,
        "amax_pass": True,
        "gbps": (x.element_size() + 2) * n / ms / 1e6,
        "ideal_fraction": (x.element_size() + 2) / (2 * x.element_size() + 2),
        "torch_ms": ref,
    }


def bench_elementwise(x, iters: int) -> list[dict]:
    """SwiGLU forward/backward of x as [T, 2F] and the scale_cast epilogue of an fp32 tensor of
    x's element count, each against the eager torch ops it replaces."""
    t, f2 = x.shape
    dh = torch.randn(t, f2 // 2, device=x.device, dtype=x.dtype)
    a, b = x.chunk(2, dim=-1)
    out32 = x.float()
    fa, fb = torch.tensor(0.5, device=x.device), torch.tensor(3.0, device=x.device)
    n = x.numel()

    def eager_bwd():
        da, db = dh * b, dh * torch.nn.functional.silu(a)  # MulBackward, then SiluBackward, then cat
        return torch.cat((torch.ops.aten.silu_backward(da, a), db), dim=-1)

    cases = [
        (
            "swiglu forward",
            lambda: kernels.swiglu(x, f2 // 2),
            lambda: torch.nn.functional.silu(a) * b,
            n * 2 + n,
        ),  # read [T, 2F], write [T, F] (bf16)
        ("swiglu backward", lambda: kernels.swiglu_backward(dh, x, f2 // 2), eager_bwd, n + 2 * n * 2),
        (
            "gemm epilogue fp32->bf16",
            lambda: kernels.scale_cast(out32, fa, fb, torch.bfloat16),
            lambda: (out32 * fa * fb).to(torch.bfloat16),
            n * 4 + n * 2,
        ),
    ]
    rows = []
    for name, fused, eager, nbytes in cases:  # both in CUDA graphs: kernel time only
        ms = _graph_ms(fused, iters)
        rows.append(
            {
                "format": name,
                "dirs": "-",
                "ms": ms,
                "in_bytes": nbytes,
                "out_bytes": 0,
                "amax_pass": False,
                "gbps": nbytes / ms / 1e6,
                "ideal_fraction": 1.0,
                "reference_ms": _graph_ms(eager, iters),
            }
        )
    return rows


def bench_dequantize(x, iters: int) -> list[dict]:
    """Dequantize of each direction of a few formats' payloads of x, as the emulated GEMMs read
    them (bf16 values, per-tensor factor split off), kernel time (CUDA graph)."""
    rows = []
    for name, q in (
        ("mxfp8", dtq.MXFP8Quantizer()),
        ("nvfp4", dtq.NVFP4Quantizer()),
        ("fp8b_1x128", dtq.Float8BlockQuantizer((1, 128))),
    ):
        t = q.quantize(x, rowwise=True, columnwise=True)
        for d in t.directions:
            codec, payload = q.codec(d), t.payload(d)
            nbytes = sum(v.numel() * v.element_size() for v in payload.values()) + x.numel() * 2
            ms = _graph_ms(
                lambda: codec.dequantize(payload, tuple(x.shape), torch.bfloat16, factored=True, kernel_only=True),
                iters,
            )
            rows.append(
                {
                    "format": f"dequantize {name} -> bf16",
                    "dirs": d[0],
                    "ms": ms,
                    "in_bytes": nbytes,
                    "out_bytes": 0,
                    "amax_pass": False,
                    "gbps": nbytes / ms / 1e6,
                    "ideal_fraction": 1.0,
                }
            )
    return rows


def bench_reference(q, x, dirs: str, seed: torch.Tensor) -> float:
    os.environ["DTQ_DISABLE_KERNELS"] = "1"
    try:
        kw = dict(rowwise="r" in dirs, columnwise="c" in dirs, seed=seed)
        return _time_ms(lambda: q.quantize(x, **kw), iters=3, warmup=1)
    finally:
        del os.environ["DTQ_DISABLE_KERNELS"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024], help="bf16 input sizes in MiB")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reference-size", type=int, default=64, help="MiB; 0 skips the reference timings")
    p.add_argument("--only", default="", help="substring filter on config names")
    p.add_argument("--generic", action="store_true", help="also time the generic fused kernel")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    t0 = time.time()
    if not kernels.available():
        print(f"kernels unavailable: {kernels.build_error()}", file=sys.stderr)
        return 1
    build_s = time.time() - t0
    dev = torch.cuda.get_device_name()
    ceiling = copy_ceiling(args.iters)
    print(f"device: {dev}  torch {torch.__version__}  kernel build/load {build_s:.1f}s")
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write, 1 GiB)")
    seed = torch.tensor(1234, dtype=torch.int64, device="cuda")
    rows = []
    for size in args.sizes:
        m = size * (1 << 20) // 2 // K
        x = (torch.randn(m, K, device="cuda") * 3).bfloat16()
        y = torch.empty_like(x)
        ms = _time_ms(lambda dst=y, src=x: dst.copy_(src), args.iters)
        rows.append(
            {
                "format": "copy (torch)",
                "dirs": "-",
                "ms": ms,
                "in_bytes": x.numel() * 2,
                "out_bytes": x.numel() * 2,
                "amax_pass": False,
                "gbps": 4 * x.numel() / ms / 1e6,
                "ideal_fraction": 1.0,
                "size_mib": size,
                "shape": [m, K],
                "fraction": 4 * x.numel() / ms / 1e6 / ceiling,
            }
        )
        del y
        for name, q, dirsets in CONFIGS:
            if args.only and args.only not in name:
                continue
            for dirs in dirsets:
                r = bench_one(q, x, dirs, args.iters, seed)
                r.update(format=name, dirs=dirs, size_mib=size, shape=[m, K], fraction=r["gbps"] / ceiling)
                if size == args.reference_size:
                    r["reference_ms"] = bench_reference(q, x, dirs, seed)
                if args.generic:
                    os.environ["DTQ_GENERIC_QUANTIZE"] = "1"
                    try:
                        r["generic_ms"] = bench_one(q, x, dirs, args.iters, seed)["ms"]
                    finally:
                        del os.environ["DTQ_GENERIC_QUANTIZE"]
                rows.append(r)
                torch.cuda.empty_cache()
        if not args.only or "transpose" in args.only:
            r = bench_transpose(x, args.iters)
            r.update(size_mib=size, shape=[m, K], fraction=r["gbps"] / ceiling, reference_ms=r["torch_ms"])
            rows.append(r)
        if not args.only or "transposed" in args.only:
            r = bench_transposed_codes(x, args.iters)
            r.update(size_mib=size, shape=[m, K], fraction=r["gbps"] / ceiling, reference_ms=r["torch_ms"])
            rows.append(r)
        if not args.only or "swiglu" in args.only or "epilogue" in args.only:
            for r in bench_elementwise(x, args.iters):
                r.update(size_mib=size, shape=[m, K], fraction=r["gbps"] / ceiling)
                rows.append(r)
        if not args.only or "dequantize" in args.only:
            for r in bench_dequantize(x, args.iters):
                r.update(size_mib=size, shape=[m, K], fraction=r["gbps"] / ceiling)
                rows.append(r)
        if not args.only or "amax" in args.only:
            for r in bench_amax(x, args.iters):
                r.update(size_mib=size, shape=[m, K], fraction=r["gbps"] / ceiling)
                rows.append(r)
        del x
        torch.cuda.empty_cache()
    hdr = (
        f"{'format':30s} {'dirs':4s} {'MiB':>5s} {'us':>9s} {'GB/s':>7s} {'of copy':>7s} {'ideal':>6s} "
        f"{'of ideal':>8s} "
        f"{'generic us':>10s} {'ref us':>9s} {'speedup':>7s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ref = r.get("reference_ms")
        ref_s = f"{ref * 1e3:9.0f} {ref / r['ms']:7.1f}" if ref else ""
        gen = r.get("generic_ms")
        gen_s = f"{gen * 1e3:10.1f}" if gen else f"{'':10s}"
        print(
            f"{r['format']:30s} {r['dirs']:4s} {r['size_mib']:5d} {r['ms'] * 1e3:9.1f} {r['gbps']:7.0f} "
            f"{r['fraction']:7.2f} {r['ideal_fraction']:6.2f} {r['fraction'] / r['ideal_fraction']:8.2f} "
            f"{gen_s} {ref_s}"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "device": dev,
                "torch": torch.__version__,
                "copy_gbps": ceiling,
                "input_dtype": "bfloat16",
                "k": K,
                "rows": rows,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
