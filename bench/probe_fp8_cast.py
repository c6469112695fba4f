"""GPU time of inductor's per-tensor FP8 cast kernels, one formulation against another: the
reference cast (clamp, conversion, NaN fix-up on a byte view), the clamp alone, Triton's plain
conversion (what ``Float8Codec.traced_quantize`` compiles on CUDA), and BF16 out for scale; each
on a contiguous [8192, 2048] BF16 tensor and on the assembly of attention's q, k and v gradients
into a QKV projection's [8192, 6144] dy (a permuting copy, as the trainer's backward does). Then
the plain conversion with the scale computed in the kernel from the amax against the scale given.
Kernel times from torch's profiler, µs per call (the host is not timed).

    python bench/probe_fp8_cast.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from dtq import _bits

E4 = torch.float8_e4m3fn


def kernel_us(fn, *args, n: int = 50) -> str:
    """Each CUDA kernel's time per call of the compiled ``fn``, costliest first."""
    f = torch.compile(fn)
    for _ in range(5):
        f(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            f(*args)
        torch.cuda.synchronize()
    times = sorted(
        (e.self_device_time_total / n for e in prof.key_averages() if e.device_type.name == "CUDA"), reverse=True
    )
    return " + ".join(f"{t:.1f}" for t in times if t > 0)


def assemble(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """[batch, heads, seq, head_dim] x 3 -> [seq * batch, heads * 3 * head_dim] (head-major q|k|v)."""
    s = torch.stack([dq, dk, dv], dim=3)
    b, h, t, _, d = s.shape
    return s.permute(2, 0, 1, 3, 4).reshape(t * b, h * 3 * d)


CASTS = {
    "reference cast": lambda v: _bits.cast_fp8(v, E4, traced=True),
    "clamp + conversion": lambda v: v.clamp(-448.0, 448.0).to(E4),
    "plain conversion": lambda v: _bits.cast_fp8(v, E4, triton=True),
    "BF16 out": lambda v: v.to(torch.bfloat16),
}


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = (torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    amax = _bits.stored_amax(x)
    scale = _bits.per_tensor_scale(amax, 448.0, False, traced=True)
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__}; µs per call, scale given")
    for name, cast in CASTS.items():
        flat = kernel_us(lambda x, s, c=cast: c(x.float() * s), x, scale)
        qkv = kernel_us(lambda a, b, c, s, cast=cast: cast(assemble(a, b, c).float() * s), dq, dk, dv, scale)
        print(f"  {name:20s} [8192, 2048]: {flat:>12s}   qkv dy [8192, 6144]: {qkv}")

    def from_amax(t, a):  # the scale from the amax inside the graph, as the traced quantization has it
        s = _bits.per_tensor_scale(a, 448.0, False, traced=True)
        return _bits.cast_fp8(t.float() * s, E4, triton=True), _bits.fp32_quotient(1.0, s)

    print("plain conversion, scale from the amax in the kernel:")
    print(f"  [8192, 2048]: {kernel_us(from_amax, x, amax)}   qkv dy: ", end="")
    print(kernel_us(lambda a, b, c, m: from_amax(assemble(a, b, c), m), dq, dk, dv, amax))


if __name__ == "__main__":
    main()
