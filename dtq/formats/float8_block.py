"""FP8 with one fp32 scale per block: (1, 128) blocks for activations and grads, (128, 128) for weights.

Per block: ``scale = fp8_max / block_amax`` (1 if the block amax is 0 or non-finite, capped at the
fp32 max), rounded down to a power of two unless ``pow2_scales=False``; ``q = sat(x * scale)``.
Edge blocks are partial. Rowwise blocks are (1, 128) along K, columnwise blocks (128, 1) along M;
a (128, 128) block serves both directions, so its two payloads are identical.

Payload per direction: ``data`` [M, K] float8 and ``scale_inv`` fp32 with one entry per block:
rowwise (1x128) [M, ceil(K/128)], columnwise (1x128) [ceil(M/128), K], 128x128
[ceil(M/128), ceil(K/128)] for both.
"""

from __future__ import annotations

import dataclasses

import torch

from dtq import _bits, kernels
from dtq.formats.base import Payload, ROWWISE, Codec, Quantizer, register

_BLOCKS = ((1, 128), (128, 128))


@dataclasses.dataclass(frozen=True)
class Float8BlockQuantizer(Quantizer):
    block: tuple[int, int] = (1, 128)
    dtype: torch.dtype = torch.float8_e4m3fn
    pow2_scales: bool = True

    def __post_init__(self):
        _bits.check_fp8_dtype(self.dtype, "Float8BlockQuantizer")
        if tuple(self.block) not in _BLOCKS:
            raise ValueError(f"Float8BlockQuantizer: block={self.block} is not supported; use (1, 128) "
                             "(activations, gradients) or (128, 128) (weights)")
        object.__setattr__(self, "block", tuple(self.block))

    def tile(self, direction: str) -> tuple[int, int]:
        br, bc = self.block
        return (br, bc) if direction == ROWWISE or br == bc else (bc, br)


@register(Float8BlockQuantizer)
class Float8BlockCodec(Codec):
    name = "fp8_block"

    @classmethod
    def tile(cls, q: Float8BlockQuantizer, direction: str, shape: tuple[int, int]) -> tuple[int, int] | None:
        return q.tile(direction)

    @classmethod
    def fields(cls, q: Float8BlockQuantizer, direction: str) -> dict[str, int | None]:
        return {"data": 1, "scale_inv": q.tile(direction)[0]}

    @classmethod
    def quantize(cls, q: Float8BlockQuantizer, x: torch.Tensor, direction: str, amax: torch.Tensor | None, seed: torch.Tensor | None) -> Payload:
        tile = q.tile(direction)
        scale = _bits.per_tensor_scale(_bits.block_amax(x.float(), tile), _bits.FP8_MAX[q.dtype], q.pow2_scales)
        data = _bits.cast_fp8(x.float() * _bits.expand_blocks(scale, tile, tuple(x.shape)), q.dtype)
        return {"data": data, "scale_inv": torch.reciprocal(scale)}

    @classmethod
    def kernel_spec(cls, q: Float8BlockQuantizer, direction: str, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec:
        br, bc = q.tile(direction)
        nblk = (-(-shape[0] // br), -(-shape[1] // bc))
        return kernels.KernelSpec(kernels.FP8_SCALED, (br, bc), (("data", shape, q.dtype), ("scale_inv", nblk, torch.float32)),
                                  e5m2=q.dtype == torch.float8_e5m2, pow2=q.pow2_scales)

    @classmethod
    def exact_dtype(cls, q: Float8BlockQuantizer, payload: Payload, direction: str, rotated: bool = False) -> torch.dtype:
        # code * 2^k keeps the code's 4 significant bits; a general scale_inv does not fit bf16
        return torch.bfloat16 if q.pow2_scales else torch.float32

    @classmethod
    def dequantize(cls, q: Float8BlockQuantizer, payload: Payload, direction: str, shape: tuple[int, int]) -> torch.Tensor:
        if (out := cls.kernel_dequantize(q, payload, direction, shape)) is not None:
            return out
        s = _bits.expand_blocks(payload["scale_inv"], q.tile(direction), shape)
        return payload["data"].to(torch.float32) * s

    @classmethod
    def empty(cls, q: Float8BlockQuantizer, shape: tuple[int, int], direction: str, device: torch.device, dtype: torch.dtype) -> Payload:
        br, bc = q.tile(direction)
        nblk = (-(-shape[0] // br), -(-shape[1] // bc))
        return {"data": torch.zeros(shape, dtype=q.dtype, device=device),
                "scale_inv": torch.ones(nblk, dtype=torch.float32, device=device)}

    @classmethod
    def identical_directions(cls, q: Float8BlockQuantizer) -> bool:
        return q.block[0] == q.block[1]
