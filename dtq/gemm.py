"""Quantized GEMM dispatch on (format of A, format of B, device).

``mm(a, b, ...)`` computes ``op(A) @ op(B)`` where each operand is a 2-D ``QuantizedTensor`` (one
of its directions) or a plain high-precision tensor. A native scaled GEMM runs where the hardware
has one for that pairing; everything else is emulated: dequantize (per-tensor factors split off),
multiply with fp32 accumulation, factors applied after. Any pairing therefore works. On CUDA,
operands whose values bf16 holds exactly (MXFP8, NVFP4, FP8 with power-of-two block scales, BF16)
are multiplied on BF16 tensor cores (fp32 accumulation and output); others in fp32 with TF32 off.
Native paths on Hopper: FP8 per-tensor, row-wise (one scale per row of op(A) / column of op(B))
and 1x128 / 128x128 blockwise, through torch's scaled GEMMs.
Operands that share NVFP4's random-Hadamard rotation along the contraction dim (wgrad) are
multiplied rotated, since ``(T a)^T (T b) = a^T b``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator

import torch

from dtq import kernels
from dtq.codec import QuantizedData, shape_2d
from dtq.tensor import QUANTIZED

_recorders: list[list[str]] = []  # open record_paths() blocks (a debugging aid, empty otherwise)
_lock = threading.Lock()


@contextlib.contextmanager
def record_paths() -> Iterator[list[str]]:
    """Collect the name of every GEMM path taken while the block is open, on any thread (CUDA
    backward passes run on autograd's own threads), with " fast_accum" appended where it
    accumulated fast. For tests and debugging."""
    rec: list[str] = []
    with _lock:
        _recorders.append(rec)
    try:
        yield rec
    finally:
        with _lock:
            _recorders.remove(rec)


class _PinnedFlag:
    """One process-wide torch flag held at the value dtq's emulated GEMMs need, only where the
    caller's value would change their bits, and only while one runs (a reusable context manager).
    torch offers no per-call switch for these (cuBLAS and oneDNN read the global context), so the
    first GEMM in flight sets the flag and the last one puts the caller's value back; GEMMs on other
    threads (autograd's) share the hold, so none restores while another still relies on it. A value
    someone else set meanwhile is left alone."""

    __slots__ = ("read", "write", "fine", "want", "restore_as", "users", "saved")

    def __init__(
        self,
        read: Callable[[], object],
        write: Callable[[object], None],
        want: object,
        fine: tuple = (),
        restore_as: Callable[[object], object] = lambda v: v,
    ):
        self.read, self.write, self.want, self.restore_as = read, write, want, restore_as
        self.fine = (want, *fine)  # values that compute the same bits: nothing to change
        self.users, self.saved = 0, None

    def __enter__(self) -> None:
        with _flag_lock:
            if not self.users:
                current = self.read()
                if current not in self.fine:
                    restore = self.restore_as(current)
                    self.write(self.want)
                    self.saved = restore  # set: this hold changed the flag (None: it did not)
            self.users += 1

    def __exit__(self, *exc) -> None:
        with _flag_lock:
            self.users -= 1
            if not self.users and self.saved is not None:
                if self.read() == self.want:
                    self.write(self.saved)
                self.saved = None


_flag_lock = threading.Lock()
_get_precision, _set_precision = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter


def _ieee_fp32(backend: str) -> _PinnedFlag:
    """Emulated GEMMs multiply in true fp32 whatever a user allowed for fp32 matmuls (TF32 in cuBLAS,
    BF16 / TF32 in oneDNN on CPU): those round the dequantized operands (any value, scales applied,
    not just the codes) to 10 or 7 mantissa bits, and dtq's results must not depend on the caller's
    setting. Read and set through ``fp32_precision`` (what cuBLAS and oneDNN read since torch 2.9;
    reading the legacy ``allow_tf32`` raises once a user set the new one). The caller's setting
    comes back as it was: "none" where the backend's ``all`` setting gives the same value (an
    explicit value equal to the inherited one reads the same)."""
    return _PinnedFlag(
        functools.partial(_get_precision, backend, "matmul"),
        functools.partial(_set_precision, backend, "matmul"),
        "ieee",
        fine=("none",),
        restore_as=lambda v: "none" if _get_precision(backend, "all") == v else v,
    )


# fp32 matmul precision per device type; other devices have no flag dtq knows to hold
_IEEE_FP32 = {"cuda": _ieee_fp32("cuda"), "cpu": _ieee_fp32("mkldnn")}
_NO_FLAG = contextlib.nullcontext()


class Operand:
    """One GEMM operand: a tensor (a ``QuantizedTensor``, dtq's internal ``QuantizedData``, or a
    plain high-precision tensor), which direction of it to read, and whether to transpose it.
    What the paths ask of it is read once here (host time is on every GEMM's critical path)."""

    __slots__ = (
        "tensor",
        "direction",
        "transpose",
        "quantized",
        "quantizer",
        "codec",
        "format",
        "payload",
        "shape2d",
        "device",
    )

    def __init__(self, tensor: torch.Tensor | QuantizedData, direction: str = "rowwise", transpose: bool = False):
        self.tensor, self.direction, self.transpose = tensor, direction, transpose
        self.device = tensor.device
        if type(tensor) is QuantizedData:  # dtq's own (the GEMM path's): its fields, without the properties
            self.quantized = True
            self.codec = c = tensor._quantizer.codec(direction)
            self.quantizer = c.q
            self.payload = tensor._payloads[direction]
            self.shape2d = tensor._shape2d
            self.format = c.name
        elif isinstance(tensor, QUANTIZED):
            self.quantized = True
            self.codec = c = tensor.quantizer.codec(direction)
            self.quantizer = c.q
            self.payload = tensor.payload(direction)
            self.shape2d = tensor.shape2d
            self.format = c.name
        else:
            self.quantized, self.quantizer, self.codec, self.payload, self.format = False, None, None, None, "hp"
            self.shape2d = shape_2d(tensor.shape)

    def with_payload(self, payload: dict | None) -> Operand:
        """This quantized operand with another payload of the same layout (and no tensor)."""
        op = Operand.__new__(Operand)
        op.tensor, op.direction, op.transpose, op.device = None, self.direction, self.transpose, self.device
        op.quantized, op.quantizer, op.codec, op.format = True, self.quantizer, self.codec, self.format
        op.payload, op.shape2d = payload, self.shape2d
        return op

    def logical_shape(self) -> tuple[int, int]:
        m, k = self.shape2d
        return (k, m) if self.transpose else (m, k)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def rotation(self):
        return self.codec.rotation() if self.quantized else None

    def key(self) -> tuple:
        """What a path's ``supports`` reads of this operand: format, quantizer, direction, transpose,
        logical shape, dtypes and device (never values)."""
        data = _codes_dtype(self.payload) if self.quantized else None
        return (self.quantizer, self.direction, self.transpose, self.shape2d, self.tensor.dtype, data, self.device)

    def exact_dtype(self, rotated: bool = False) -> torch.dtype:
        if self.quantized:
            return self.codec.exact_dtype(self.payload, rotated)
        return torch.bfloat16 if self.tensor.dtype == torch.bfloat16 else torch.float32

    def values(
        self, rotated: bool = False, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[rows, cols] of op(X) in ``dtype`` and its factor: per tensor (0-dim), or per row / column
        of op(X) along the output dims (NVFP4 row_scaled); ``rotated``: left in the payload's rotation."""
        if self.quantized:
            vals, factor = self.codec.dequantize(self.payload, self.shape2d, dtype, factored=True, rotated=rotated)
        else:
            vals, factor = self.tensor.reshape(-1, self.tensor.shape[-1]).to(dtype), None
        if self.transpose:
            return vals.t(), (factor.t() if factor is not None and factor.dim() == 2 else factor)
        return vals, factor


def _codes_dtype(payload: dict) -> torch.dtype:
    """The dtype of a payload's codes (a GEMM's columnwise operand may carry them as ``data_t`` only)."""
    return (payload["data"] if "data" in payload else payload["data_t"]).dtype


@dataclasses.dataclass(frozen=True)
class GemmPath:
    name: str
    supports: Callable[[Operand, Operand, torch.dtype], bool]
    run: Callable[[Operand, Operand, torch.dtype], torch.Tensor]
    # ``run`` on the operands' payloads and transpose flags alone (``pa, pb, ta, tb, out_dtype``),
    # for :func:`bind`: no Operand is built per call (host time)
    run_payloads: Callable[..., torch.Tensor] | None = None
    # whether ``run`` (and ``run_payloads``) take ``fast_accum``: cuBLAS's FP8 fast accumulation
    # (partial sums kept in the tensor core's reduced precision, never promoted to fp32 on the
    # way); paths without it accumulate as they always do
    fast_accum: bool = False
    # whether ``run_payloads`` is torch's own ops alone, given payloads whose transposed reads
    # come as ``data_t``: a compiled graph may then call it itself (``dtq.nn._fused_input``)
    traceable: bool = False


def _shared_rotation(a: Operand, b: Operand) -> bool:
    """Both operands hold their values rotated by the same orthogonal T along the contraction dim
    (the stored rows: A transposed, B not, as in wgrad): the product needs no inverse."""
    return a.transpose and not b.transpose and a.rotation is not None and a.rotation == b.rotation


def _apply_factors(out: torch.Tensor, fa, fb, out_dtype: torch.dtype) -> torch.Tensor:
    if fa is not None or fb is not None:
        fused = kernels.scale_cast(out, fa, fb, out_dtype)  # one pass on CUDA, same bits
        if fused is not None:
            return fused
    for f in (fa, fb):
        if f is not None:
            out = out * f
    return out.to(out_dtype)


def _emulated(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    rotated = _shared_rotation(a, b)
    va, fa = a.values(rotated)
    vb, fb = b.values(rotated)
    with _IEEE_FP32.get(va.device.type, _NO_FLAG):
        out = va @ vb
    return _apply_factors(out, fa, fb, out_dtype)


def _bf16_exact_ok(a: Operand, b: Operand, out_dtype: torch.dtype) -> bool:
    if not (a.is_cuda and b.is_cuda):
        return False
    rotated = _shared_rotation(a, b)
    return a.exact_dtype(rotated) == torch.bfloat16 and b.exact_dtype(rotated) == torch.bfloat16


def _full_precision_bf16_reduction() -> _PinnedFlag:
    """cuBLAS may reduce split-K partial sums in bf16 unless told not to. dtq's BF16 GEMMs run with
    reduced-precision reductions off and split-K allowed (torch's ``(False, True)``; a bare
    ``False`` before torch 2.10), whatever the caller's setting: the reduction options also narrow
    cuBLASLt's algorithm choice, hence the sum order, for fp32 outputs too."""
    read, write = (
        torch._C._get_cublas_allow_bf16_reduced_precision_reduction,
        torch._C._set_cublas_allow_bf16_reduced_precision_reduction,
    )
    if isinstance(read(), tuple):  # (allow reduced precision, allow split-K)
        return _PinnedFlag(read, lambda v: write(*v), (False, True))
    return _PinnedFlag(read, write, False)


_FULL_BF16_REDUCTION = _full_precision_bf16_reduction()


def _emulated_bf16(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    # Every value is exactly a bf16 number and every product of two is exact in fp32, so a BF16
    # tensor-core GEMM with fp32 accumulation and output computes what the fp32 emulation does, up
    # to the order of the fp32 sums: the cost over a BF16 GEMM is the dequantization traffic.
    rotated = _shared_rotation(a, b)
    va, fa = a.values(rotated, torch.bfloat16)
    vb, fb = b.values(rotated, torch.bfloat16)
    with _FULL_BF16_REDUCTION:
        if fa is None and fb is None and out_dtype == torch.bfloat16:
            return torch.mm(va, vb)  # fp32 sums rounded once, into the output: no fp32 pass
        out = torch.mm(va, vb, out_dtype=torch.float32)
    return _apply_factors(out, fa, fb, out_dtype)


def _sm_at_least(t: torch.Tensor, major: int, minor: int = 0) -> bool:
    return t.is_cuda and kernels.capability(t.device) >= (major, minor)


def _fp8_tensorwise_ok(a: Operand, b: Operand, out_dtype: torch.dtype) -> bool:
    if a.format != "fp8" or b.format != "fp8" or not _sm_at_least(a, 8, 9):
        return False
    if a.quantizer.dtype == torch.float8_e5m2 and b.quantizer.dtype == torch.float8_e5m2:
        return False  # no E5M2 x E5M2 kernel
    (m, k), (_, n) = a.logical_shape(), b.logical_shape()
    return m % 16 == 0 and k % 16 == 0 and n % 16 == 0 and out_dtype in (torch.float32, torch.bfloat16, torch.float16)


def _codes_t(payload: dict) -> torch.Tensor:
    """The payload's codes as [K, M]: its ``data_t`` where the quantize kernel wrote them so,
    else a transpose of the stored [M, K] ``data``."""
    t = payload.get("data_t")
    return kernels.transposed(payload["data"]) if t is None else t


def _row_major(payload: dict, transpose: bool) -> torch.Tensor:
    """op(X)'s codes row-major, from the payload's [M, K] codes. cuBLASLt FP8 wants A row-major and
    B column-major ("TN"): the codes are transposed where the layout does not fit (else views)."""
    return _codes_t(payload) if transpose else payload["data"].contiguous()


def _col_major(payload: dict, transpose: bool) -> torch.Tensor:
    """op(X)'s codes column-major (see _row_major)."""
    return payload["data"].contiguous().t() if transpose else _codes_t(payload).t()


def _scalar_fp32(s: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale as the 0-dim fp32 tensor scaled GEMMs take (as stored, usually: no op)."""
    return s if s.dim() == 0 and s.dtype == torch.float32 else s.reshape(()).float()


def _fp8_tensorwise_payloads(
    pa: dict, pb: dict, ta: bool, tb: bool, out_dtype: torch.dtype, fast_accum: bool = False
) -> torch.Tensor:
    return torch._scaled_mm(
        _row_major(pa, ta),
        _col_major(pb, tb),
        scale_a=_scalar_fp32(pa["scale_inv"]),
        scale_b=_scalar_fp32(pb["scale_inv"]),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def _fp8_tensorwise(a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    return _fp8_tensorwise_payloads(a.payload, b.payload, a.transpose, b.transpose, out_dtype, fast_accum)


def _row_scales(op: Operand, is_b: bool) -> bool:
    """The operand has one FP8 scale per row of op(A) / column of op(B), constant along the
    contraction (row-wise scaling): FP8 row-scaled codes whose scales span the contraction dim,
    or per-tensor FP8 (one scale broadcast)."""
    if op.format == "fp8":
        return True
    if op.format != "fp8_row":
        return False
    # the codec's block: one whole dim of the stored [M, K] by one of the other (which is which
    # depends on the direction); it must span the contraction dim
    shape = op.shape2d
    tile = op.codec.tile(shape)
    c = _contraction_dim(op, is_b)
    return tile[c] == shape[c] and tile[1 - c] == 1


@functools.cache
def _rowwise_cublas() -> bool:
    """Whether torch runs row-wise scaled GEMMs through cuBLAS (CUDA 12.9 and later) rather than
    its CUTLASS kernel, which takes fewer output and operand types."""
    return tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]) >= (12, 9)


def _rowwise_out_dtypes() -> tuple[torch.dtype, ...]:
    """Outputs of torch's row-wise scaled GEMM: BF16; also fp32 through cuBLAS."""
    return (torch.bfloat16, torch.float32) if _rowwise_cublas() else (torch.bfloat16,)


def _rowwise_pairs() -> frozenset:
    """FP8 (a, b) element types of torch's row-wise scaled GEMM on Hopper: E4M3 x E4M3 and E5M2 x
    E4M3 (an E5M2 gradient against an E4M3 operand); E4M3 x E5M2 only through cuBLAS
    (bench/probe_rowwise_mm.py, CUDA 13.0: all three)."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    return frozenset({(e4, e4), (e5, e4)} | ({(e4, e5)} if _rowwise_cublas() else set()))


def _fp8_rowwise_ok(a: Operand, b: Operand, out_dtype: torch.dtype) -> bool:
    # Hopper, the pairs above; everything else (E5M2 x E5M2, other outputs) is emulated.
    if "fp8_row" not in (a.format, b.format) or not _row_scales(a, False) or not _row_scales(b, True):
        return False
    if not _sm_at_least(a, 9) or kernels.capability(a.device)[0] != 9:
        return False
    if out_dtype not in _rowwise_out_dtypes():
        return False
    if (a.quantizer.dtype, b.quantizer.dtype) not in _rowwise_pairs():
        return False
    (m, k), (_, n) = a.logical_shape(), b.logical_shape()
    return m % 16 == 0 and k % 16 == 0 and n % 16 == 0


def _fp8_rowwise(a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    # scale_a [m, 1], scale_b [1, n], fp32: a stored fp8_row scale holds one value per
    # non-contraction index already (in either orientation); a per-tensor scale is broadcast.
    (m, _), (_, n) = a.logical_shape(), b.logical_shape()
    sa = a.payload["scale_inv"].float().reshape(-1, 1).expand(m, 1).contiguous()
    sb = b.payload["scale_inv"].float().reshape(1, -1).expand(1, n).contiguous()
    return torch._scaled_mm(
        _row_major(a.payload, a.transpose),
        _col_major(b.payload, b.transpose),
        scale_a=sa,
        scale_b=sb,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def _contraction_dim(op: Operand, is_b: bool) -> int:
    """Which dim of the stored [M, K] payload is this operand's contraction dim."""
    logical = 0 if is_b else 1
    return 1 - logical if op.transpose else logical


def _block_kind(op: Operand, is_b: bool) -> str | None:
    """'1x128' if the operand's 128-blocks run along its contraction dim, '128x128' for square
    tiles, else None."""
    if op.format != "fp8_block":
        return None
    tile = op.quantizer.tile(op.direction)
    if tile == (128, 128):
        return "128x128"
    return "1x128" if tile[_contraction_dim(op, is_b)] == 128 else None


def _fp8_blockwise_ok(a: Operand, b: Operand, out_dtype: torch.dtype) -> bool:
    if not _sm_at_least(a, 9) or kernels.capability(a.device)[0] != 9:
        return False  # cuBLAS's 1x128 / 128x128 FP8 kernels are Hopper's
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    if _block_kind(a, False) != "1x128" or _block_kind(b, True) is None:
        return False
    if a.quantizer.dtype == torch.float8_e5m2 and b.quantizer.dtype == torch.float8_e5m2:
        return False
    (m, k), (_, n) = a.logical_shape(), b.logical_shape()
    n_align = 128 if _block_kind(b, True) == "128x128" else 16
    return (
        m % 16 == 0
        and k % 128 == 0
        and n % n_align == 0
        and out_dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _scales_by_contraction(op: Operand, is_b: bool) -> torch.Tensor:
    """The operand's scale_inv as [non-contraction, contraction blocks]."""
    s = op.payload["scale_inv"]
    return s if _contraction_dim(op, is_b) == 1 else s.t()


def _colmajor(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _fp8_blockwise(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    # Layouts cuBLAS takes on sm_90 (probed with bench/probe_blockwise_mm.py): A row-major with
    # 1x128 scales [m, k/128] column-major; B column-major with 1x128 scales [n, k/128]
    # column-major, or 128x128 scales [k/128 padded to a multiple of 4, n/128] column-major.
    F = torch.nn.functional
    da, db = _row_major(a.payload, a.transpose), _col_major(b.payload, b.transpose)
    sa = _colmajor(_scales_by_contraction(a, False).float())
    sb = _scales_by_contraction(b, True).float()
    if _block_kind(b, True) == "128x128":
        pad = -sb.shape[1] % 4
        sb = F.pad(sb, (0, pad), value=1.0).contiguous().t()
        recipe_b = F.ScalingType.BlockWise128x128
    else:
        sb = _colmajor(sb)
        recipe_b = F.ScalingType.BlockWise1x128
    return F.scaled_mm(da, db, sa, F.ScalingType.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)


PATHS: list[GemmPath] = [
    GemmPath(
        "fp8_tensorwise_scaled_mm",
        _fp8_tensorwise_ok,
        _fp8_tensorwise,
        _fp8_tensorwise_payloads,
        fast_accum=True,
        traceable=True,
    ),
    GemmPath("fp8_blockwise_scaled_mm", _fp8_blockwise_ok, _fp8_blockwise),
    GemmPath("fp8_rowwise_scaled_mm", _fp8_rowwise_ok, _fp8_rowwise, fast_accum=True),
    GemmPath("emulated_bf16", _bf16_exact_ok, _emulated_bf16),
    GemmPath("emulated", lambda a, b, o: True, _emulated),
]


_chosen: dict = {}  # (operand keys, out dtype) -> the path; a GEMM's path is decided once (host time)


def select(a: Operand, b: Operand, out_dtype: torch.dtype) -> GemmPath:
    """The first path that supports this pairing (decided once per operand kind and shape)."""
    key = (a.key(), b.key(), out_dtype)
    path = _chosen.get(key)
    if path is None:
        (m, k), (k2, n) = a.logical_shape(), b.logical_shape()
        if k != k2:
            raise ValueError(
                f"GEMM shape mismatch: op(A) is [{m}, {k}] ({a.format} {a.direction}) but op(B) is "
                f"[{k2}, {n}] ({b.format} {b.direction}); the inner dimensions must agree"
            )
        path = next(p for p in PATHS if p.supports(a, b, out_dtype))  # the last one supports every pairing
        if len(_chosen) > 4096:
            _chosen.clear()
        _chosen[key] = path
    return path


def _record(name: str) -> None:
    with _lock:
        for rec in _recorders:
            rec.append(name)


def mm(a: Operand, b: Operand, out_dtype: torch.dtype = torch.float32, fast_accum: bool = False) -> torch.Tensor:
    """``op(A) @ op(B)`` through the first path that supports this pairing; ``fast_accum``: with
    FP8 fast accumulation where the path has it (see ``GemmPath.fast_accum``)."""
    path = select(a, b, out_dtype)
    fast = fast_accum and path.fast_accum
    if _recorders:
        _record(path.name + _FAST if fast else path.name)
    return path.run(a, b, out_dtype, True) if fast else path.run(a, b, out_dtype)


_FAST = " fast_accum"  # what record_paths() appends to a path that accumulated fast


# Paths that take op(A) / op(B) through _row_major / _col_major: they read a transposed operand's
# codes from its ``data_t`` field where it has one, and then never its ``data``.
_TRANSPOSED_CODES_PATHS = frozenset({"fp8_tensorwise_scaled_mm", "fp8_rowwise_scaled_mm"})


def transposed_reads(a: Operand, b: Operand, out_dtype: torch.dtype) -> tuple[bool, bool]:
    """Whether the path this pairing selects reads A's / B's codes as [K, M] (what a ``data_t``
    field holds, see ``Codec.transposed_codes_spec``): A when transposed, B when not (cuBLASLt's
    FP8 "TN" layout); False for paths that read values another way."""
    if select(a, b, out_dtype).name not in _TRANSPOSED_CODES_PATHS:
        return False, False
    return a.transpose, not b.transpose


def bind(
    a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool = False
) -> Callable[[dict, dict], torch.Tensor]:
    """:func:`mm` of operands like ``a`` and ``b`` (same formats, directions, transposes, shapes,
    dtypes and device) as a function of their two payloads, its path chosen now: what a GEMM
    that runs again and again with new payloads calls (``dtq.nn.linear_plan``). Keeps no tensor
    of ``a`` or ``b``."""
    path = select(a, b, out_dtype)
    fast = fast_accum and path.fast_accum
    name = path.name + _FAST if fast else path.name
    extra = (True,) if fast else ()
    if path.run_payloads is not None:
        run, ta, tb = path.run_payloads, a.transpose, b.transpose

        def bound(pa: dict, pb: dict) -> torch.Tensor:
            if _recorders:
                _record(name)
            return run(pa, pb, ta, tb, out_dtype, *extra)

        return bound
    like_a, like_b, run_ops = a.with_payload(None), b.with_payload(None), path.run

    def bound_operands(pa: dict, pb: dict) -> torch.Tensor:
        if _recorders:
            _record(name)
        return run_ops(like_a.with_payload(pa), like_b.with_payload(pb), out_dtype, *extra)

    return bound_operands
