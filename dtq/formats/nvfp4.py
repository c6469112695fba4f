"""NVFP4: E2M1 codes, E4M3 scales per 16 elements, and one fp32 tensor scale.

``S_enc = 448 * 6 / global_amax`` (1 if the amax is 0 or non-finite, capped at the fp32 max);
per block ``s_b = e4m3((block_amax / 6) * S_enc)`` (saturating); ``q = e2m1(x * (S_enc / s_b))``
(code 0 where ``s_b == 0``); dequantized value ``(q * s_b) / S_enc``. All arithmetic is fp32 in
that order. Two codes per byte, element 2i in the low nibble.

Blocks: rowwise (1, 16) along K, columnwise (16, 1) along M; ``block=(16, 16)`` (weights) uses
16x16 tiles for both directions, whose payloads are then identical.

Options:
* ``stochastic_rounding``: E2M1 rounding is stochastic with counter-based random bits of
  ``(seed, direction, element index)``; the seed is drawn from torch's generator at quantize time
  (or passed explicitly), so runs and recomputes are reproducible.
* ``random_hadamard``: the columnwise (wgrad) direction first multiplies every 16 rows by
  ``T = H16 . diag(signs) / 4`` (orthogonal, signs from ``hadamard_seed``). Both wgrad operands use
  the same T, so ``(T a)^T (T b) = a^T b``; its amax is that of ``T x``; dequantize applies ``T^T``.

Requirements: K % 16 == 0; M % 16 == 0 for the columnwise direction and for 16x16 blocks.
Payload per direction: ``data`` uint8 [M, K/2], ``scale`` float8_e4m3fn (one per block:
rowwise [M, K/16], columnwise [M/16, K], 16x16 [M/16, K/16]), ``amax`` fp32 0-dim.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dtq import _bits, kernels
from dtq.formats.base import Payload, COLUMNWISE, ROWWISE, Codec, Quantizer, register, shape_error

BLOCK = 16
_GLOBAL = 448.0 * 6.0


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    block: tuple[int, int] = (1, 16)
    stochastic_rounding: bool = False
    random_hadamard: bool = False
    hadamard_seed: int = 0

    def __post_init__(self):
        if tuple(self.block) not in ((1, 16), (16, 16)):
            raise ValueError(f"NVFP4Quantizer: block={self.block} is not supported; use (1, 16) or (16, 16)")
        object.__setattr__(self, "block", tuple(self.block))
        if self.random_hadamard and self.block == (16, 16):
            raise ValueError("NVFP4Quantizer: random_hadamard=True applies to wgrad operands (1x16 blocks along "
                             "M); it cannot be combined with block=(16, 16), which is meant for weights")

    def tile(self, direction: str) -> tuple[int, int]:
        if self.block == (16, 16):
            return (BLOCK, BLOCK)
        return (1, BLOCK) if direction == ROWWISE else (BLOCK, 1)

    def hadamard(self, direction: str) -> bool:
        return self.random_hadamard and direction == COLUMNWISE


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 2688 / amax in fp32; 1 when amax is 0 or non-finite; capped at the fp32 max."""
    return _bits.per_tensor_scale(amax, _GLOBAL, pow2=False)


@functools.lru_cache(maxsize=64)
def _signs_mask(seed: int) -> int:
    return kernels.signs_mask(_bits.hadamard_signs(seed, torch.device("cpu")))


@register(NVFP4Quantizer)
class NVFP4Codec(Codec):
    name = "nvfp4"

    @classmethod
    def tile(cls, q: NVFP4Quantizer, direction: str, shape: tuple[int, int]) -> tuple[int, int] | None:
        return q.tile(direction)

    @classmethod
    def fields(cls, q: NVFP4Quantizer, direction: str) -> dict[str, int | None]:
        return {"data": 1, "scale": q.tile(direction)[0], "amax": None}

    @classmethod
    def check_shape(cls, q: NVFP4Quantizer, shape: tuple[int, int], direction: str) -> None:
        m, k = shape
        if k % BLOCK:
            raise shape_error(q, shape, direction, f"K (last dim) = {k} must be a multiple of {BLOCK}")
        if q.tile(direction)[0] == BLOCK and m % BLOCK:
            why = "16x16 blocks" if q.block == (16, 16) else "the columnwise direction (blocks along M)"
            raise shape_error(q, shape, direction, f"M (leading dims) = {m} must be a multiple of {BLOCK} for {why}")

    @classmethod
    def needs_amax(cls, q: NVFP4Quantizer, direction: str) -> bool:
        return True

    @classmethod
    def local_amax(cls, q: NVFP4Quantizer, x: torch.Tensor, direction: str) -> torch.Tensor:
        if x.numel() == 0:
            return torch.zeros((), device=x.device)
        xf = x.float()
        if q.hadamard(direction):
            xf = _bits.hadamard_rows(xf, q.hadamard_seed)
        return xf.abs().amax()

    @classmethod
    def uses_rng(cls, q: NVFP4Quantizer, direction: str) -> bool:
        return q.stochastic_rounding

    @classmethod
    def quantize(cls, q: NVFP4Quantizer, x: torch.Tensor, direction: str, amax: torch.Tensor | None, seed: torch.Tensor | None) -> Payload:
        xf = x.float()
        if q.hadamard(direction):
            xf = _bits.hadamard_rows(xf, q.hadamard_seed)
        tile = q.tile(direction)
        s_enc = global_scale(amax)
        # Divide by a tensor, not a Python scalar: torch's CUDA kernels turn division by a CPU scalar
        # into multiplication by its reciprocal, which is not the fp32 division this format defines.
        six = xf.new_full((), 6.0, dtype=torch.float32)  # a fill, not a blocking host-to-device copy
        s_b = _bits.cast_fp8(_bits.block_amax(xf, tile) / six * s_enc, torch.float8_e4m3fn)
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

    @classmethod
    def kernel_spec(cls, q: NVFP4Quantizer, direction: str, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec:
        br, bc = q.tile(direction)
        fields = (("data", (shape[0], shape[1] // 2), torch.uint8),
                  ("scale", (shape[0] // br, shape[1] // bc), torch.float8_e4m3fn), ("amax", (), torch.float32))
        return kernels.KernelSpec(kernels.NVFP4, (br, bc), fields, stochastic=q.stochastic_rounding,
                                  stream=0 if br == bc or direction == ROWWISE else 1,
                                  hadamard_signs=_signs_mask(q.hadamard_seed) if q.hadamard(direction) else None)

    @classmethod
    def dequantize(cls, q: NVFP4Quantizer, payload: Payload, direction: str, shape: tuple[int, int]) -> torch.Tensor:
        if (out := cls.kernel_dequantize(q, payload, direction, shape)) is not None:
            return out
        out = cls._block_values(q, payload, direction, shape) / global_scale(payload["amax"])
        return _bits.hadamard_rows(out, q.hadamard_seed, inverse=True) if q.hadamard(direction) else out

    @classmethod
    def dequantize_factored(cls, q: NVFP4Quantizer, payload: Payload, direction: str, shape: tuple[int, int],
                            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
        vals = cls.kernel_dequantize(q, payload, direction, shape, factored=True, dtype=dtype)
        if vals is None:
            vals = cls._block_values(q, payload, direction, shape)
            if q.hadamard(direction):
                vals = _bits.hadamard_rows(vals, q.hadamard_seed, inverse=True)
            vals = vals.to(dtype)
        return vals, torch.reciprocal(global_scale(payload["amax"]))

    @classmethod
    def exact_dtype(cls, q: NVFP4Quantizer, payload: Payload, direction: str, rotated: bool = False) -> torch.dtype:
        # e2m1 (2 significant bits) * e4m3 (4): exact in bf16; the inverse Hadamard is not
        return torch.bfloat16 if rotated or not q.hadamard(direction) else torch.float32

    @classmethod
    def rotation(cls, q: NVFP4Quantizer, direction: str):
        return ("hadamard16", q.hadamard_seed) if q.hadamard(direction) else None

    @classmethod
    def dequantize_rotated(cls, q: NVFP4Quantizer, payload: Payload, direction: str, shape: tuple[int, int],
                           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not q.hadamard(direction):
            return cls.dequantize_factored(q, payload, direction, shape, dtype)
        plain = dataclasses.replace(q, random_hadamard=False)  # the same codes, read without T^T
        vals = cls.kernel_dequantize(plain, payload, direction, shape, factored=True, dtype=dtype)
        if vals is None:
            vals = cls._block_values(q, payload, direction, shape).to(dtype)
        return vals, torch.reciprocal(global_scale(payload["amax"]))

    @staticmethod
    def _block_values(q, payload, direction, shape):
        vals = _bits.e2m1_decode(_bits.unpack_nibbles(payload["data"]))
        return vals * _bits.expand_blocks(payload["scale"].to(torch.float32), q.tile(direction), shape)

    @classmethod
    def empty(cls, q: NVFP4Quantizer, shape: tuple[int, int], direction: str, device: torch.device, dtype: torch.dtype) -> Payload:
        br, bc = q.tile(direction)
        return {"data": torch.zeros((shape[0], shape[1] // 2), dtype=torch.uint8, device=device),
                "scale": torch.zeros((shape[0] // br, shape[1] // bc), dtype=torch.float8_e4m3fn, device=device),
                "amax": torch.zeros((), dtype=torch.float32, device=device)}

    @classmethod
    def amax_space(cls, q: NVFP4Quantizer, direction: str) -> str:
        return "hadamard(x)" if q.hadamard(direction) else "x"

    @classmethod
    def identical_directions(cls, q: NVFP4Quantizer) -> bool:
        return q.block == (16, 16)
