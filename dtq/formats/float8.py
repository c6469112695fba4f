"""FP8 with one fp32 scale for the whole tensor (current scaling).

``scale = fp8_max / amax`` (1 if amax is 0 or non-finite, capped at the fp32 max), optionally
rounded down to a power of two; ``q = sat(x * scale)``; the payload keeps ``scale_inv = 1 / scale``.
Both directions hold the same codes (one scale), so either is derived exactly from the other.

Payload per direction: ``data`` [M, K] float8, ``scale_inv`` fp32 0-dim. A GEMM's own
columnwise operand may also carry ``data_t``, the same codes [K, M] (written by the quantize
kernel beside the rowwise codes: the layout Hopper's FP8 GEMMs read in dgrad and wgrad); it is
never stored, gathered or checkpointed.
"""

from __future__ import annotations

import dataclasses

import torch

from dtq import _bits, kernels
from dtq.codec import Codec, Payload, register
from dtq.formats.base import Quantizer


@dataclasses.dataclass(frozen=True)
class Float8Quantizer(Quantizer):
    dtype: torch.dtype = torch.float8_e4m3fn
    pow2_scales: bool = False

    def __post_init__(self):
        _bits.check_fp8_dtype(self.dtype, "Float8Quantizer")


@register(Float8Quantizer)
class Float8Codec(Codec):
    name = "fp8"
    q: Float8Quantizer

    def fields(self) -> dict[str, int | None]:
        return {"data": 1, "scale_inv": None}

    def needs_amax(self) -> bool:
        return True

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> Payload:
        q = self.q
        scale = _bits.per_tensor_scale(amax, _bits.FP8_MAX[q.dtype], q.pow2_scales)
        data = _bits.cast_fp8(x.float() * scale, q.dtype)
        return {"data": data, "scale_inv": torch.reciprocal(scale)}

    def traced_quantize(
        self, x: torch.Tensor, amax: torch.Tensor, transposed: bool = False, triton: bool = False
    ) -> Payload | None:
        q = self.q
        if q.pow2_scales:
            return None
        scale = _bits.per_tensor_scale(amax, _bits.FP8_MAX[q.dtype], False, traced=True)
        # a view inductor lowers by storing its input: the scale is computed once, where a 0-dim
        # value would be inlined and divided again (in fp64) for every element of the cast
        scale = torch.as_strided(scale, (), ())
        data = _bits.cast_fp8(x.float() * scale, q.dtype, traced=True, triton=triton)
        out = {"data": data, "scale_inv": _bits.fp32_quotient(1.0, scale)}  # (scale <= FLT_MAX: no cap)
        if transposed:
            out["data_t"] = kernels.transposed_codes(data)
        return out

    def kernel_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec:
        q = self.q
        return kernels.KernelSpec(
            kernels.FP8_SCALED,
            (0, 0),
            (("data", shape, q.dtype), ("scale_inv", (), torch.float32)),
            e5m2=q.dtype == torch.float8_e5m2,
            pow2=q.pow2_scales,
        )

    def transposed_codes_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec:
        q = self.q
        return kernels.KernelSpec(
            kernels.FP8_SCALED_T,
            (0, 0),
            (("data_t", (shape[1], shape[0]), q.dtype),),
            e5m2=q.dtype == torch.float8_e5m2,
            pow2=q.pow2_scales,
        )

    def _reference(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        return payload["data"].to(torch.float32) * payload["scale_inv"]

    def _factored(
        self, payload: Payload, shape: tuple[int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return payload["data"].to(dtype), payload["scale_inv"]

    def exact_dtype(self, payload: Payload, rotated: bool = False) -> torch.dtype:
        return torch.bfloat16  # the codes themselves (the scale is the separate factor)

    def empty(self, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Payload:
        return {
            "data": torch.zeros(shape, dtype=self.q.dtype, device=device),
            "scale_inv": torch.ones((), dtype=torch.float32, device=device),
        }

    def identical_directions(self) -> bool:
        return True
