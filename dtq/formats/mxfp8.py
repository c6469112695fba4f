"""MXFP8 (OCP microscaling): 32 elements share one E8M0 scale ``2**e``.

``scale_rounding="ceil"`` (default; the cuBLAS / TransformerEngine / torchao RCEIL derivation):
``e = clamp(ceil(log2(amax / fp8_max)), -127, 127)`` where ``amax / fp8_max`` is one fp32 division
and the ceil of its log2 is taken exactly (from the fp32 bits, not a rounded ``log2``).
``scale_rounding="floor"`` (OCP MX v1.0): ``e = clamp(floor(log2(amax)) - emax_elem, -127, 127)``
with emax_elem 8 (E4M3) or 15 (E5M2); values above fp8_max then saturate.
A block amax of 0 gives the biased exponent 0 (2**-127); a NaN or infinite amax gives 0xFF (NaN),
and every code of that block is NaN. ``q = sat(x * 2**-e)``.

Rowwise blocks run along K (K % 32 == 0), columnwise blocks along M (M % 32 == 0).
Payload per direction: ``data`` [M, K] float8; ``scale`` uint8 biased exponents,
rowwise [M, K/32], columnwise [M/32, K].
"""

from __future__ import annotations

import dataclasses

import torch

from dtq import _bits, kernels
from dtq.codec import ROWWISE, Codec, Payload, register, shape_error
from dtq.formats.base import Quantizer

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer(Quantizer):
    dtype: torch.dtype = torch.float8_e4m3fn
    scale_rounding: str = "ceil"

    def __post_init__(self):
        _bits.check_fp8_dtype(self.dtype, "MXFP8Quantizer")
        if self.scale_rounding not in ("ceil", "floor"):
            raise ValueError(
                f"MXFP8Quantizer: scale_rounding={self.scale_rounding!r}; use 'ceil' "
                "(cuBLAS/TransformerEngine RCEIL) or 'floor' (OCP MX v1.0)"
            )


def _tile(direction: str) -> tuple[int, int]:
    return (1, BLOCK) if direction == ROWWISE else (BLOCK, 1)


def e8m0_exponent(q: MXFP8Quantizer, amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent (uint8) for each block amax (fp32)."""
    fmax = _bits.FP8_MAX[q.dtype]
    finite_pos = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(finite_pos, amax, torch.ones_like(amax))
    if q.scale_rounding == "ceil":
        d = safe / safe.new_full((), fmax)  # a tensor: true fp32 division on every device (and no blocking copy)
        e = torch.where(
            d > 0,
            _bits.ceil_log2(torch.where(d > 0, d, torch.ones_like(d))),
            torch.full_like(d, -127, dtype=torch.int32),
        )
    else:
        e = _bits.floor_log2(safe) - _bits.FP8_EMAX[q.dtype]
    biased = (torch.clamp(e, -127, 127) + _bits.E8M0_BIAS).to(torch.uint8)
    biased = torch.where(amax == 0, torch.zeros_like(biased), biased)
    return torch.where(torch.isfinite(amax), biased, torch.full_like(biased, _bits.E8M0_NAN))


def e8m0_value(biased: torch.Tensor) -> torch.Tensor:
    """2**(biased - 127) in fp32; 0xFF is NaN."""
    v = torch.ldexp(
        torch.ones(biased.shape, dtype=torch.float32, device=biased.device), biased.to(torch.float32) - _bits.E8M0_BIAS
    )
    return torch.where(biased == _bits.E8M0_NAN, torch.full_like(v, float("nan")), v)


@register(MXFP8Quantizer)
class MXFP8Codec(Codec):
    name = "mxfp8"
    q: MXFP8Quantizer

    def tile(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        return _tile(self.direction)

    def fields(self) -> dict[str, int | None]:
        return {"data": 1, "scale": _tile(self.direction)[0]}

    def check_shape(self, shape: tuple[int, int]) -> None:
        dim, size = (1, shape[1]) if self.direction == ROWWISE else (0, shape[0])
        if size % BLOCK:
            raise shape_error(
                self.q,
                shape,
                self.direction,
                f"{'K (last dim)' if dim else 'M (leading dims)'} = "
                f"{size} must be a multiple of the MX block size {BLOCK}",
            )

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> Payload:
        xf = x.float()
        tile = _tile(self.direction)
        biased = e8m0_exponent(self.q, _bits.block_amax(xf, tile))
        # 2**-e as fp32 (exact, subnormal for e = 127); NaN for 0xFF blocks.
        inv = torch.ldexp(
            torch.ones(biased.shape, dtype=torch.float32, device=x.device), _bits.E8M0_BIAS - biased.to(torch.float32)
        )
        inv = torch.where(biased == _bits.E8M0_NAN, torch.full_like(inv, float("nan")), inv)
        data = _bits.cast_fp8(xf * _bits.expand_blocks(inv, tile, tuple(x.shape)), self.q.dtype)
        return {"data": data, "scale": biased}

    def kernel_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec:
        q = self.q
        br, bc = _tile(self.direction)
        return kernels.KernelSpec(
            kernels.MXFP8,
            (br, bc),
            (("data", shape, q.dtype), ("scale", (shape[0] // br, shape[1] // bc), torch.uint8)),
            e5m2=q.dtype == torch.float8_e5m2,
            floor=q.scale_rounding == "floor",
        )

    def exact_dtype(self, payload: Payload, rotated: bool = False) -> torch.dtype:
        return torch.bfloat16  # code * 2^e: the code's significant bits, a power-of-two scale

    def _reference(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        s = _bits.expand_blocks(e8m0_value(payload["scale"]), _tile(self.direction), shape)
        return payload["data"].to(torch.float32) * s

    def empty(self, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Payload:
        br, bc = _tile(self.direction)
        return {
            "data": torch.zeros(shape, dtype=self.q.dtype, device=device),
            "scale": torch.zeros((shape[0] // br, shape[1] // bc), dtype=torch.uint8, device=device),
        }
