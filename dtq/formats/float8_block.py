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
from dtq.codec import ROWWISE, Codec, Payload, register
from dtq.formats.base import Quantizer

_BLOCKS = ((1, 128), (128, 128))


@dataclasses.dataclass(frozen=True)
class Float8BlockQuantizer(Quantizer):
    block: tuple[int, int] = (1, 128)
    dtype: torch.dtype = torch.float8_e4m3fn
    pow2_scales: bool = True

    def __post_init__(self):
        _bits.check_fp8_dtype(self.dtype, "Float8BlockQuantizer")
        if tuple(self.block) not in _BLOCKS:
            raise ValueError(
                f"Float8BlockQuantizer: block={self.block} is not supported; use (1, 128) "
                "(activations, gradients) or (128, 128) (weights)"
            )
        object.__setattr__(self, "block", tuple(self.block))

    def tile(self, direction: str) -> tuple[int, int]:
        br, bc = self.block
        return (br, bc) if direction == ROWWISE or br == bc else (bc, br)


@register(Float8BlockQuantizer)
class Float8BlockCodec(Codec):
    name = "fp8_block"
    q: Float8BlockQuantizer

    def tile(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        return self.q.tile(self.direction)

    def fields(self) -> dict[str, int | None]:
        return {"data": 1, "scale_inv": self.q.tile(self.direction)[0]}

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> Payload:
        q = self.q
        tile = q.tile(self.direction)
        scale = _bits.per_tensor_scale(_bits.block_amax(x.float(), tile), _bits.FP8_MAX[q.dtype], q.pow2_scales)
        data = _bits.cast_fp8(x.float() * _bits.expand_blocks(scale, tile, tuple(x.shape)), q.dtype)
        return {"data": data, "scale_inv": torch.reciprocal(scale)}

    def kernel_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec:
        q = self.q
        br, bc = q.tile(self.direction)
        nblk = (-(-shape[0] // br), -(-shape[1] // bc))
        return kernels.KernelSpec(
            kernels.FP8_SCALED,
            (br, bc),
            (("data", shape, q.dtype), ("scale_inv", nblk, torch.float32)),
            e5m2=q.dtype == torch.float8_e5m2,
            pow2=q.pow2_scales,
        )

    def exact_dtype(self, payload: Payload, rotated: bool = False) -> torch.dtype:
        # code * 2^k keeps the code's 4 significant bits; a general scale_inv does not fit bf16
        return torch.bfloat16 if self.q.pow2_scales else torch.float32

    def _reference(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        s = _bits.expand_blocks(payload["scale_inv"], self.q.tile(self.direction), shape)
        return payload["data"].to(torch.float32) * s

    def empty(self, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Payload:
        br, bc = self.q.tile(self.direction)
        nblk = (-(-shape[0] // br), -(-shape[1] // bc))
        return {
            "data": torch.zeros(shape, dtype=self.q.dtype, device=device),
            "scale_inv": torch.ones(nblk, dtype=torch.float32, device=device),
        }

    def identical_directions(self) -> bool:
        return self.q.block[0] == self.q.block[1]
