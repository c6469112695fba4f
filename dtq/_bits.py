"""Bit-level building blocks shared by the format references.

Everything here is plain PyTorch on fp32 values and defines bits exactly: the CUDA kernels in
``csrc/`` reproduce these functions, so each step is written as a fixed sequence of IEEE fp32
operations (no reductions whose order could vary, no fused multiply-adds).
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Largest unbiased exponent of a normal number in each element format (448 = 1.75 * 2**8).
FP8_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
FP8_NAN_CODE = 0x7F  # canonical NaN code written for NaN inputs, whatever their sign
FLT_MAX = torch.finfo(torch.float32).max

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even decision points between neighbouring E2M1 magnitudes: a value exactly on
# a midpoint goes to the neighbour whose code is even, so the comparison is ">" when the lower
# neighbour is even and ">=" when the upper one is.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

E8M0_BIAS = 127
E8M0_NAN = 0xFF


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """1-byte float codes (FP8) viewed as uint8: collectives (gloo has no FP8) and checkpoints
    move them as bytes. Other tensors are returned as they are."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def check_fp8_dtype(dtype: torch.dtype, owner: str) -> None:
    if dtype not in FP8_MAX:
        raise ValueError(
            f"{owner}: dtype={dtype} is not an FP8 element type; use torch.float8_e4m3fn or torch.float8_e5m2"
        )


def cast_fp8(x: torch.Tensor, dtype: torch.dtype, traced: bool = False, triton: bool = False) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of fp32 values; NaN becomes the code 0x7F.
    ``traced``: for a graph (no data-dependent branch). ``triton``: for a graph inductor compiles
    to Triton on sm_89 or later, whose fp32 -> fp8 conversion (PTX ``cvt.rn.satfinite``) is this
    cast by itself: it saturates, and makes every NaN 0x7F (checked on all 2^32 fp32 inputs by
    ``tests/kernels/test_gpu_compile.py``). The plain conversion then spares the clamp and the NaN
    fix-up, which made inductor's cast kernels up to 1.8x slower (ATen's conversion, in eager
    and on the CPU, keeps a NaN's sign and turns large values into NaN: it needs both)."""
    if triton:
        return x.to(dtype)
    fmax = FP8_MAX[dtype]
    q = x.clamp(-fmax, fmax).to(dtype)
    nan = torch.isnan(x)
    # On a GPU the fix-up always runs: asking whether it is needed would stall the host.
    if traced or x.is_cuda or bool(nan.any()):
        q = torch.where(nan, torch.full_like(q.view(torch.uint8), FP8_NAN_CODE), q.view(torch.uint8)).view(dtype)
    return q


def canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """NaNs replaced by the one canonical quiet NaN of x's dtype (reductions and casts on different
    devices produce different NaN payload bits; stored payloads must not depend on the device)."""
    nan = torch.isnan(x)
    return torch.where(nan, torch.full_like(x, float("nan")), x)


def floor_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(v)) for positive finite fp32 values (subnormals included), as int32."""
    _, e = torch.frexp(v)
    return e - 1


def ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(v)) for positive finite fp32 values: one less than frexp's exponent only
    when v is a power of two (mantissa exactly 0.5)."""
    m, e = torch.frexp(v)
    return torch.where(m == 0.5, e - 1, e)


def round_down_pow2(v: torch.Tensor) -> torch.Tensor:
    """Largest power of two not above v (v positive finite fp32)."""
    return torch.ldexp(torch.ones_like(v), floor_log2(v).to(torch.float32))


def per_tensor_scale(amax: torch.Tensor, fmax: float, pow2: bool, traced: bool = False) -> torch.Tensor:
    """``fmax / amax`` in fp32, 1 where amax is 0 or non-finite, capped at the fp32 max (a tiny
    amax would otherwise give +inf), optionally rounded down to a power of two. ``traced``: for a
    graph a compiler generates code from, the division in fp64 (see :func:`fp32_quotient`)."""
    amax = amax.to(torch.float32)
    # Six small kernels, not eight: the emulated GEMMs compute this per operand per call, where each
    # launch is host time. NaN and +inf become 0, and every amax not above 0 divides fmax by itself
    # (exactly 1), so the one division gives every case's bits.
    finite = torch.nan_to_num(amax, nan=0.0, posinf=0.0)
    divisor = torch.where(finite > 0, finite, fmax)
    if traced:
        scale = fp32_quotient(fmax, divisor)
    else:
        # new_full: a fill on amax's device (torch.tensor(fmax, device=...) would be a blocking copy)
        scale = torch.clamp(amax.new_full((), fmax) / divisor, max=FLT_MAX)
    if pow2:
        scale = round_down_pow2(scale)
    return scale


def fp32_quotient(num: float, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` for fp32 ``den``, correctly rounded to fp32 and capped at the fp32 max, in a form
    whose bits no compiler changes: the quotient in fp64, rounded once (innocuous double rounding:
    53 bits hold the 2 * 24 + 2 an exact fp32 quotient's rounding needs). Triton's fp32 division,
    which inductor emits for ``/``, is approximate."""
    return torch.clamp(num / den.double(), max=FLT_MAX).float()


# ---------------------------------------------------------------------------------------------
# E2M1 (FP4)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """RNE, saturating fp32 -> E2M1 codes (uint8, one code per element, sign in bit 3).

    NaN has no E2M1 encoding: like the hardware's ``satfinite`` conversion it becomes +6 (0x7).
    """
    v = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for point, inclusive in _E2M1_MIDPOINTS:
        mag += (v >= point if inclusive else v > point).to(torch.uint8)
    nan = torch.isnan(x)
    sign = (torch.signbit(x) & ~nan).to(torch.uint8) << 3
    mag = torch.where(nan, torch.full_like(mag, 7), mag)
    return mag | sign


def e2m1_encode_stochastic(x: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding to E2M1: between the two neighbouring magnitudes lo <= |x| <= hi, round
    up iff ``u < (|x| - lo) / (hi - lo)`` where ``u = (rand >> 8) * 2**-24``. Every step is exact in
    fp32, so a kernel reproduces it bit for bit. Saturates at 6; NaN becomes +6."""
    v = x.abs().clamp(max=E2M1_MAX)
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    lo_idx = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    for g in E2M1_VALUES[1:]:
        lo_idx += (v >= g).to(torch.int64)
    hi_idx = torch.clamp(lo_idx + 1, max=7)
    lo, hi = grid[lo_idx], grid[hi_idx]
    frac = torch.where(hi > lo, (v - lo) / (hi - lo), torch.zeros_like(v))
    u = (rand >> 8).to(torch.float32) * (2.0**-24)
    mag = torch.where(u < frac, hi_idx, lo_idx).to(torch.uint8)
    nan = torch.isnan(x)
    mag = torch.where(nan, torch.full_like(mag, 7), mag)
    sign = (torch.signbit(x) & ~nan).to(torch.uint8) << 3
    return mag | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes; element 2i in the low nibble (float4_e2m1fn_x2 order)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------
# Counter-based random bits (reproducible on CPU and GPU, independent of torch's RNG algorithm)

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 without int64 overflow: split x into 16-bit halves.
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + ((hi * (c & 0xFFFF)) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift-multiply) on int64 tensors holding values < 2**32."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(seed: torch.Tensor, stream: int, numel: int, device: torch.device) -> torch.Tensor:
    """32 random bits per element index ``i``: ``hash32(i ^ hash32(seed ^ stream * 0x9E3779B9))``."""
    key = hash32((seed.to(device=device, dtype=torch.int64) ^ ((stream * 0x9E3779B9) & _M32)) & _M32)
    idx = torch.arange(numel, dtype=torch.int64, device=device) & _M32
    return hash32(idx ^ key)


# ---------------------------------------------------------------------------------------------
# 16-point randomized Hadamard transform


def hadamard_signs(seed: int | None, device: torch.device) -> torch.Tensor:
    """The +-1 diagonal of the randomized transform: sign j is bit 0 of ``hash32(seed * 16 + j)``
    (the random sign mask); all +1 for ``seed=None`` (a plain Hadamard transform)."""
    if seed is None:
        return torch.ones(16, dtype=torch.float32, device=device)
    bits = hash32(torch.arange(16, dtype=torch.int64, device=device) + (seed & _M32) * 16) & 1
    return 1.0 - 2.0 * bits.to(torch.float32)


def _walsh16(x: torch.Tensor) -> torch.Tensor:
    # Unnormalized Sylvester-ordered Walsh-Hadamard along dim -2 (size 16), as four butterfly
    # stages of fp32 add/sub (a fixed order, so a kernel can reproduce it exactly).
    rows, cols = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    h = 1
    while h < 16:
        y = x.reshape(*lead, 16 // (2 * h), 2, h, cols)
        a, b = y[..., 0, :, :], y[..., 1, :, :]
        x = torch.stack((a + b, a - b), dim=-3).reshape(*lead, rows, cols)
        h *= 2
    return x


def hadamard_rows(x: torch.Tensor, seed: int | None, inverse: bool = False) -> torch.Tensor:
    """Apply T = H16 . diag(signs) / 4 (orthogonal) to every group of 16 rows of a [M, K] fp32
    tensor; ``inverse`` applies T^T. M must be a multiple of 16."""
    m, k = x.shape
    signs = hadamard_signs(seed, x.device).view(1, 16, 1)
    blocks = x.reshape(m // 16, 16, k)
    if inverse:
        out = _walsh16(blocks) * 0.25 * signs
    else:
        out = _walsh16(blocks * signs) * 0.25
    return out.reshape(m, k)


# ---------------------------------------------------------------------------------------------
# Block helpers (partial edge blocks allowed)


_SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def stored_amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` over the values ``x`` holds, as a 0-dim fp32 tensor, taken on their bit patterns
    (sign bit cleared: non-negative floats order as their bits do, NaN above inf). Why bits: a
    compiler that fuses this reduction into the kernel producing ``x`` (inductor) would take the
    max of its unrounded fp32 intermediate instead; a bitcast makes it round to ``x``'s dtype."""
    int_dtype = _SAME_SIZE_INT.get(x.dtype)
    if int_dtype is None:
        return x.abs().amax().float()
    magnitude = x.view(int_dtype) & torch.iinfo(int_dtype).max
    if x.dim() >= 2:
        # Row by row first, then over the rows (the same max): where inductor cannot fuse the
        # reduction into x's producer (an opaque op's output), its own split of one flat reduction
        # can be unaligned and read x at a third of the bandwidth (2026-11-28, H200: a [8192, 16384]
        # gradient split 528 x 254201, 172 us); a row reduction fuses with row-wise producers too.
        magnitude = magnitude.amax(dim=-1)
    return magnitude.amax().view(x.dtype).float()


def axis_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max|x| along ``dim`` of a [M, K] tensor (kept as a size-1 dim), NaN canonical; 0 over an empty dim."""
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    return canonical_nan(x.abs().amax(dim=dim, keepdim=True).to(torch.float32))


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max|x| over each (br, bc) tile of a [M, K] tensor -> [ceil(M/br), ceil(K/bc)]; NaN propagates."""
    br, bc = block
    m, k = x.shape
    mb, kb = -(-m // br), -(-k // bc)
    a = x.abs()
    if mb * br != m or kb * bc != k:
        a = torch.nn.functional.pad(a, (0, kb * bc - k, 0, mb * br - m))
    return a.reshape(mb, br, kb, bc).amax(dim=(1, 3))


def block_sum(r: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Sum over each (br, bc) tile of a [M, K] fp32 tensor (br, bc in {1, 16}; whole tiles) in the
    order the kernels add: each 8-row x 8-column quarter (1 x 8 / 8 x 1 halves of a 1-D tile)
    sequentially in row-major order, then the two column halves, then the two row halves:
    ``(q00 + q01) + (q10 + q11)``. fp32 addition is commutative, so either lane of a shuffle may
    add its partner's sum to its own."""
    br, bc = block
    m, k = r.shape
    hr, ir = (2, 8) if br == 16 else (1, 1)
    hc, ic = (2, 8) if bc == 16 else (1, 1)
    v = r.reshape(m // br, hr, ir, k // bc, hc, ic)
    acc = None
    for i in range(ir):
        for j in range(ic):
            t = v[:, :, i, :, :, j]
            acc = t if acc is None else acc + t
    rows = acc[..., 0] if hc == 1 else acc[..., 0] + acc[..., 1]  # [m/br, hr, k/bc]
    return rows[:, 0] if hr == 1 else rows[:, 0] + rows[:, 1]


def expand_blocks(s: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast one value per tile back to a [M, K] element grid (cropping edge tiles)."""
    br, bc = block
    m, k = shape
    return s.repeat_interleave(br, dim=0)[:m].repeat_interleave(bc, dim=1)[:, :k]
