"""High-precision passthrough: one direction of a hybrid can stay unquantized.

Payload per direction: ``data`` [M, K] in ``dtype`` (the input's dtype when ``dtype`` is None).
"""

from __future__ import annotations

import dataclasses

import torch

from dtq import _bits, kernels
from dtq.formats.base import Payload, Codec, Quantizer, register


@dataclasses.dataclass(frozen=True)
class IdentityQuantizer(Quantizer):
    dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.dtype is not None and not self.dtype.is_floating_point:
            raise ValueError(f"IdentityQuantizer: dtype={self.dtype} is not a floating-point dtype; "
                             "use None (keep the input dtype), torch.bfloat16, torch.float16 or torch.float32")
        if self.dtype is not None and self.dtype.itemsize < 2:
            raise ValueError(f"IdentityQuantizer: dtype={self.dtype} is a quantized dtype; use Float8Quantizer "
                             "for FP8, or a 16/32-bit float here")


@register(IdentityQuantizer)
class IdentityCodec(Codec):
    name = "identity"

    @classmethod
    def fields(cls, q: IdentityQuantizer, direction: str) -> dict[str, int | None]:
        return {"data": 1}

    @classmethod
    def quantize(cls, q: IdentityQuantizer, x: torch.Tensor, direction: str, amax: torch.Tensor | None, seed: torch.Tensor | None) -> Payload:
        if q.dtype is None or q.dtype == x.dtype:
            return {"data": x.clone()}  # bit-exact passthrough
        return {"data": _bits.canonical_nan(x.to(q.dtype))}

    @classmethod
    def kernel_spec(cls, q: IdentityQuantizer, direction: str, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec | None:
        out = q.dtype or dtype
        if out not in kernels.INPUT_DTYPES:
            return None
        return kernels.KernelSpec(kernels.IDENTITY, (0, 0), (("data", shape, out),), out_dtype=out)

    @classmethod
    def dequantize(cls, q: IdentityQuantizer, payload: Payload, direction: str, shape: tuple[int, int]) -> torch.Tensor:
        return payload["data"].to(torch.float32, copy=True)  # never hand out the stored data itself

    @classmethod
    def empty(cls, q: IdentityQuantizer, shape: tuple[int, int], direction: str, device: torch.device, dtype: torch.dtype) -> Payload:
        return {"data": torch.zeros(shape, dtype=q.dtype or dtype, device=device)}

    @classmethod
    def identical_directions(cls, q: IdentityQuantizer) -> bool:
        return True

    @classmethod
    def dequantize_factored(cls, q: IdentityQuantizer, payload: Payload, direction: str, shape: tuple[int, int],
                            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
        return payload["data"].to(dtype), None  # read-only use: no copy when the dtype matches

    @classmethod
    def exact_dtype(cls, q: IdentityQuantizer, payload: Payload, direction: str, rotated: bool = False) -> torch.dtype:
        return torch.bfloat16 if payload["data"].dtype == torch.bfloat16 else torch.float32

    @classmethod
    def lossless(cls, q: IdentityQuantizer, dtype: torch.dtype) -> bool:
        return q.dtype is None or q.dtype == dtype
