"""Host time of one GEMM call as torch runs it: ``torch.mm`` in BF16 against ``torch._scaled_mm``
with per-tensor FP8 scales (what dtq's compiled graphs call), and an elementwise add for scale.
At [256, 256] x [256, 256] the GPU finishes each call before the next is issued, so the time per
call is the host's; at [8192, 2048] x [2048, 2048] it is the GPU's. Best of five rounds.

    python bench/probe_gemm_host.py
"""

from __future__ import annotations

import time

import torch


def us_per_call(fn, n: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        best = min(best, elapsed)
    return best


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_gemm_host.py times CUDA calls: run it on a GPU")
    for m, k in ((256, 256), (8192, 2048)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        calls = {
            "add bf16": lambda: a.add(a),
            "mm bf16": lambda: torch.mm(a, b.t()),
            "_scaled_mm per-tensor": lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16),
            "_scaled_mm fast accum": lambda: torch._scaled_mm(
                a8, b8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True
            ),
        }
        bound = "host" if m == 256 else "GPU"
        for name, fn in calls.items():
            print(f"[{m}, {k}] {name}: {us_per_call(fn, 400 if m == 256 else 50):.1f} us a call ({bound}-bound)")


if __name__ == "__main__":
    main()
