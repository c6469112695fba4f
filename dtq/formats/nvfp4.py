"""NVFP4: E2M1 codes, E4M3 scales per 16 elements, and fp32 global scales.

``S_enc = e4m3_max * 6 / amax`` (1 if the amax is 0 or non-finite, capped at the fp32 max), with
``amax`` the tensor's (or, with ``row_scaled``, the row's / column's); per block
``s_b = e4m3((block_amax / 6) * S_enc)`` (saturating); ``q = e2m1(x * (S_enc / s_b))`` (code 0
where ``s_b == 0``); dequantized value ``(q * s_b) / S_enc``. All arithmetic is fp32 in that order.
Two codes per byte, element 2i in the low nibble.

Blocks: rowwise (1, 16) along K, columnwise (16, 1) along M; ``block=(16, 16)`` (weights) uses
16x16 tiles for both directions, whose payloads are then identical.

Options (all off by default; docs/formats.md defines the bits):
* ``stochastic_rounding``: E2M1 rounding is stochastic with counter-based random bits of
  ``(seed, direction, element index)``; the seed is drawn from torch's generator at quantize time
  (or passed explicitly), so runs and recomputes are reproducible.
* ``random_hadamard``: the columnwise (wgrad) direction first multiplies every 16 rows by
  ``T = H16 . diag(signs) / 4`` (orthogonal); ``hadamard_seed`` draws the random sign mask (None:
  all signs +1). Both wgrad operands use the same T, so ``(T a)^T (T b) = a^T b``; its amax is that
  of ``T x``; dequantize applies ``T^T``.
* ``row_scaled``: one amax, so one ``S_enc``, per row of the rowwise payload ([M, 1], local to a
  row) and per column of the columnwise one ([1, K], reduced over dim-0 shards like FP8 row-wise).
* ``four_over_six``: each block takes ``s_b`` with divisor 4 instead of 6 when that candidate's
  quantization error (``four_over_six_error``: "mae" or "mse", summed in a fixed order) is smaller;
  the stored scale carries the choice, so dequantization is unchanged.
* ``e4m3_max``: the E4M3 bound in ``S_enc`` (256 leaves room for 4/6's larger block scales).

Requirements: K % 16 == 0; M % 16 == 0 for the columnwise direction and for 16x16 blocks.
Payload per direction: ``data`` uint8 [M, K/2], ``scale`` float8_e4m3fn (one per block:
rowwise [M, K/16], columnwise [M/16, K], 16x16 [M/16, K/16]), ``amax`` fp32 0-dim (row_scaled:
rowwise [M, 1], columnwise [1, K]).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dtq import _bits, kernels
from dtq.codec import COLUMNWISE, ROWWISE, Codec, Payload, register, shape_error
from dtq.formats.base import Quantizer

BLOCK = 16
E4M3_MAX = 448.0
ERROR_MODES = ("mae", "mse")
# Fields shown by repr only when not at their defaults: checkpoint format tags hash repr(q), so the
# settings that existed before these options keep their tags.
_LATE_FIELDS = ("row_scaled", "four_over_six", "four_over_six_error", "e4m3_max")


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    block: tuple[int, int] = (1, 16)
    stochastic_rounding: bool = False
    random_hadamard: bool = False
    hadamard_seed: int | None = 0
    row_scaled: bool = False
    four_over_six: bool = False
    four_over_six_error: str = "mae"
    e4m3_max: float = E4M3_MAX

    def __post_init__(self):
        if tuple(self.block) not in ((1, 16), (16, 16)):
            raise ValueError(f"NVFP4Quantizer: block={self.block} is not supported; use (1, 16) or (16, 16)")
        object.__setattr__(self, "block", tuple(self.block))
        if self.random_hadamard and self.block == (16, 16):
            raise ValueError(
                "NVFP4Quantizer: random_hadamard=True applies to wgrad operands (1x16 blocks along "
                "M); it cannot be combined with block=(16, 16), which is meant for weights"
            )
        seed = self.hadamard_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
            raise ValueError(
                f"NVFP4Quantizer: hadamard_seed={seed!r} must be an int in [0, 2**32) (the random "
                "sign mask's seed) or None (no sign mask: a plain Hadamard transform)"
            )
        for name in ("row_scaled", "four_over_six"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"NVFP4Quantizer: {name} must be True or False, got {getattr(self, name)!r}")
        if self.row_scaled and self.block == (16, 16):
            raise ValueError(
                "NVFP4Quantizer: row_scaled=True gives every row (rowwise) or column (columnwise) its "
                "own global scale, which a 16x16 block spanning 16 of each cannot share; use "
                "block=(1, 16)"
            )
        if self.four_over_six_error not in ERROR_MODES:
            raise ValueError(
                f"NVFP4Quantizer: four_over_six_error={self.four_over_six_error!r} is not one of "
                f"{ERROR_MODES} (sum of absolute / squared errors of a block)"
            )
        if self.four_over_six_error != "mae" and not self.four_over_six:
            raise ValueError(
                f"NVFP4Quantizer: four_over_six_error={self.four_over_six_error!r} only applies with four_over_six=True"
            )
        object.__setattr__(self, "e4m3_max", _check_e4m3_max(self.e4m3_max))

    def __repr__(self) -> str:
        shown = [
            f for f in dataclasses.fields(self) if f.name not in _LATE_FIELDS or getattr(self, f.name) != f.default
        ]
        return f"NVFP4Quantizer({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def tile(self, direction: str) -> tuple[int, int]:
        if self.block == (16, 16):
            return (BLOCK, BLOCK)
        return (1, BLOCK) if direction == ROWWISE else (BLOCK, 1)

    def hadamard(self, direction: str) -> bool:
        return self.random_hadamard and direction == COLUMNWISE


def _check_e4m3_max(v) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 1.0 <= float(v) <= E4M3_MAX
    if ok:
        ok = _e4m3_code(float(v)) is not None
    if not ok:
        raise ValueError(
            f"NVFP4Quantizer: e4m3_max={v!r} must be an E4M3 value in [1, 448] (e.g. 448, the "
            "default, or 256 to leave room for four_over_six's larger block scales)"
        )
    return float(v)


@functools.lru_cache(maxsize=64)
def _e4m3_code(v: float) -> int | None:
    """The E4M3 byte holding exactly ``v`` (the kernels' encoding of ``e4m3_max``), or None."""
    t = torch.tensor(v, dtype=torch.float32).to(torch.float8_e4m3fn)
    return int(t.view(torch.uint8)) if float(t.float()) == v else None


def global_scale(amax: torch.Tensor, q: NVFP4Quantizer) -> torch.Tensor:
    """S_enc = e4m3_max * 6 / amax in fp32 (per tensor, or per row / column with their amaxes); 1
    where amax is 0 or non-finite; capped at the fp32 max."""
    return _bits.per_tensor_scale(amax, q.e4m3_max * 6.0, pow2=False)  # exact: an e4m3 value times 6


def inverse_global_scale(amax: torch.Tensor, q: NVFP4Quantizer) -> torch.Tensor:
    """1 / S_enc, the factor a GEMM of the dequantized blocks applies: one launch on CUDA (the
    bits of the torch ops below it)."""
    inv = kernels.inverse_scale(amax, q.e4m3_max * 6.0)
    return inv if inv is not None else torch.reciprocal(global_scale(amax, q))


@functools.lru_cache(maxsize=64)
def _signs_mask(seed: int | None) -> int:
    return kernels.signs_mask(_bits.hadamard_signs(seed, torch.device("cpu")))


def _candidate_error(
    q: NVFP4Quantizer, xf: torch.Tensor, xs: torch.Tensor, tile, s_enc: torch.Tensor, s_b: torch.Tensor
) -> torch.Tensor:
    """Per block, the error of quantizing ``xf`` (RNE) with block scales ``s_b``, measured in the
    S_enc-scaled space: ``e = e2m1_value * s_b - x * S_enc`` (both products exact / rounded once),
    ``|e|`` ("mae") or ``e * e`` ("mse"), summed in ``_bits.block_sum``'s order."""
    shape = tuple(xf.shape)
    s_bf = s_b.to(torch.float32)
    zero = s_bf == 0
    factor = torch.where(zero, torch.zeros_like(s_bf), s_enc / s_bf)
    vals = _bits.e2m1_decode(_bits.e2m1_encode(xf * _bits.expand_blocks(factor, tile, shape)))
    vals = torch.where(_bits.expand_blocks(zero, tile, shape), torch.zeros_like(vals), vals)
    e = vals * _bits.expand_blocks(s_bf, tile, shape) - xs
    return _bits.block_sum(e.abs() if q.four_over_six_error == "mae" else e * e, tile)


def block_scales(q: NVFP4Quantizer, xf: torch.Tensor, tile, s_enc: torch.Tensor) -> torch.Tensor:
    """The E4M3 block scales of ``xf`` (fp32, in the space it is quantized in): ``e4m3(bamax / 6 *
    S_enc)``, or with ``four_over_six`` the candidate with divisor 4 where its error is smaller
    (ties and NaN keep 6)."""
    # Divide by a tensor, not a Python scalar: torch's CUDA kernels turn division by a CPU scalar
    # into multiplication by its reciprocal, which is not the fp32 division this format defines.
    bamax = _bits.block_amax(xf, tile)
    six = xf.new_full((), 6.0, dtype=torch.float32)  # a fill, not a blocking host-to-device copy
    s6 = _bits.cast_fp8(bamax / six * s_enc, torch.float8_e4m3fn)
    if not q.four_over_six:
        return s6
    s4 = _bits.cast_fp8(bamax / xf.new_full((), 4.0, dtype=torch.float32) * s_enc, torch.float8_e4m3fn)
    xs = xf * s_enc
    pick4 = _candidate_error(q, xf, xs, tile, s_enc, s4) < _candidate_error(q, xf, xs, tile, s_enc, s6)
    return torch.where(pick4, s4.view(torch.uint8), s6.view(torch.uint8)).view(torch.float8_e4m3fn)


def _amax_field_shape(q: NVFP4Quantizer, shape: tuple[int, int], direction: str) -> tuple[int, ...]:
    if not q.row_scaled:
        return ()
    return (shape[0], 1) if direction == ROWWISE else (1, shape[1])


@register(NVFP4Quantizer)
class NVFP4Codec(Codec):
    name = "nvfp4"
    q: NVFP4Quantizer

    def __init__(self, q: NVFP4Quantizer, direction: str):
        super().__init__(q, direction)
        self.hadamard = q.hadamard(direction)
        if self.hadamard:  # the same codes, read without T^T (built once: GEMMs read wgrad operands rotated)
            self._unrotated = NVFP4Codec(dataclasses.replace(q, random_hadamard=False), direction)

    def tile(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        return self.q.tile(self.direction)

    def fields(self) -> dict[str, int | None]:
        # row_scaled: rowwise amaxes are one per row; columnwise ones cover every row (shared by slices)
        q, d = self.q, self.direction
        return {"data": 1, "scale": q.tile(d)[0], "amax": 1 if q.row_scaled and d == ROWWISE else None}

    def check_shape(self, shape: tuple[int, int]) -> None:
        q, d = self.q, self.direction
        m, k = shape
        if k % BLOCK:
            raise shape_error(q, shape, d, f"K (last dim) = {k} must be a multiple of {BLOCK}")
        if q.tile(d)[0] == BLOCK and m % BLOCK:
            why = "16x16 blocks" if q.block == (16, 16) else "the columnwise direction (blocks along M)"
            raise shape_error(q, shape, d, f"M (leading dims) = {m} must be a multiple of {BLOCK} for {why}")

    def needs_amax(self) -> bool:
        return not (self.q.row_scaled and self.direction == ROWWISE)  # a row's own amax needs nothing from other rows

    def amax_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        return _amax_field_shape(self.q, shape, self.direction)

    def scales_from_block_amax(self) -> bool:
        return not self.q.four_over_six  # 4/6 compares the errors of every value of a block

    def column_shardable(self) -> bool:
        return not self.q.row_scaled  # per-row scales span K; per-column ones are fields shared by all rows

    def local_amax(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q
        xf = x.float()
        if self.hadamard:
            xf = _bits.hadamard_rows(xf, q.hadamard_seed)
        if q.row_scaled:
            return _bits.axis_amax(xf, 0 if self.direction == COLUMNWISE else 1)
        if x.numel() == 0:
            return torch.zeros((), device=x.device)
        return xf.abs().amax()

    def uses_rng(self) -> bool:
        return self.q.stochastic_rounding

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> Payload:
        q, direction = self.q, self.direction
        xf = x.float()
        if self.hadamard:
            xf = _bits.hadamard_rows(xf, q.hadamard_seed)
        if amax is None:  # row_scaled rowwise: every row's own amax
            amax = _bits.axis_amax(xf, 1)
        tile = q.tile(direction)
        s_enc = global_scale(amax, q)
        s_b = block_scales(q, xf, tile, s_enc)
        s_bf = s_b.to(torch.float32)
        factor = torch.where(s_bf == 0, torch.zeros_like(s_bf), s_enc / s_bf)
        scaled = xf * _bits.expand_blocks(factor, tile, tuple(x.shape))
        if q.stochastic_rounding:
            # 2-D tiles share one stream so the two directions stay identical.
            stream = 0 if tile[0] == tile[1] else (0 if direction == ROWWISE else 1)
            rand = _bits.random_bits(seed, stream, xf.numel(), x.device).view(xf.shape)
            codes = _bits.e2m1_encode_stochastic(scaled, rand)
        else:
            codes = _bits.e2m1_encode(scaled)
        zero_block = _bits.expand_blocks(s_bf == 0, tile, tuple(x.shape))
        codes = torch.where(zero_block, torch.zeros_like(codes), codes)
        return {"data": _bits.pack_nibbles(codes), "scale": s_b, "amax": _bits.canonical_nan(amax)}

    def kernel_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec:
        q, direction = self.q, self.direction
        br, bc = q.tile(direction)
        fields = (
            ("data", (shape[0], shape[1] // 2), torch.uint8),
            ("scale", (shape[0] // br, shape[1] // bc), torch.float8_e4m3fn),
            ("amax", _amax_field_shape(q, shape, direction), torch.float32),
        )
        vector = ("rows" if direction == ROWWISE else "cols") if q.row_scaled else None
        return kernels.KernelSpec(
            kernels.NVFP4,
            (br, bc),
            fields,
            stochastic=q.stochastic_rounding,
            stream=0 if br == bc or direction == ROWWISE else 1,
            hadamard_signs=_signs_mask(q.hadamard_seed) if self.hadamard else None,
            amax_vector=vector,
            row_scaled=q.row_scaled,
            four_over_six=1 + ERROR_MODES.index(q.four_over_six_error) if q.four_over_six else 0,
            e4m3_max=_e4m3_code(q.e4m3_max),
        )

    def _reference(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        out = self._block_values(payload, shape) / global_scale(payload["amax"], self.q)
        return _bits.hadamard_rows(out, self.q.hadamard_seed, inverse=True) if self.hadamard else out

    def _factored(
        self, payload: Payload, shape: tuple[int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The factor 1 / S_enc: 0-dim, or with row_scaled [M, 1] / [1, K], which lie along the
        # GEMM's output dims (the blocks run along the contraction) and so factor out of it.
        vals = self._kernel(payload, shape, True, dtype)
        if vals is None:
            vals = self._block_values(payload, shape)
            if self.hadamard:
                vals = _bits.hadamard_rows(vals, self.q.hadamard_seed, inverse=True)
            vals = vals.to(dtype)
        return vals, inverse_global_scale(payload["amax"], self.q)

    def exact_dtype(self, payload: Payload, rotated: bool = False) -> torch.dtype:
        # e2m1 (2 significant bits) * e4m3 (4): exact in bf16; the inverse Hadamard is not
        return torch.bfloat16 if rotated or not self.hadamard else torch.float32

    def rotation(self):
        return ("hadamard16", self.q.hadamard_seed) if self.hadamard else None

    def _rotated(
        self, payload: Payload, shape: tuple[int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.hadamard:
            return self._factored(payload, shape, dtype)
        vals = self._unrotated._kernel(payload, shape, True, dtype)
        if vals is None:
            vals = self._block_values(payload, shape).to(dtype)
        return vals, inverse_global_scale(payload["amax"], self.q)

    def _block_values(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        vals = _bits.e2m1_decode(_bits.unpack_nibbles(payload["data"]))
        return vals * _bits.expand_blocks(payload["scale"].to(torch.float32), self.q.tile(self.direction), shape)

    def empty(self, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Payload:
        br, bc = self.q.tile(self.direction)
        return {
            "data": torch.zeros((shape[0], shape[1] // 2), dtype=torch.uint8, device=device),
            "scale": torch.zeros((shape[0] // br, shape[1] // bc), dtype=torch.float8_e4m3fn, device=device),
            "amax": torch.zeros(_amax_field_shape(self.q, shape, self.direction), dtype=torch.float32, device=device),
        }

    def amax_space(self) -> str:
        return "hadamard(x)" if self.hadamard else "x"

    def reusable_amax(self, payload: Payload, src: str) -> torch.Tensor | None:
        if self.q.row_scaled:
            return None  # per-row amaxes of one direction are not the per-column ones of the other
        return super().reusable_amax(payload, src)

    def identical_directions(self) -> bool:
        return self.q.block == (16, 16)
