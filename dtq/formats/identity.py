"""High-precision passthrough: one direction of a hybrid can stay unquantized.

Payload per direction: ``data`` [M, K] in ``dtype`` (the input's dtype when ``dtype`` is None).
"""

from __future__ import annotations

import dataclasses

import torch

from dtq import _bits, kernels
from dtq.codec import Codec, Payload, register
from dtq.formats.base import Quantizer


@dataclasses.dataclass(frozen=True)
class IdentityQuantizer(Quantizer):
    dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.dtype is not None and not self.dtype.is_floating_point:
            raise ValueError(
                f"IdentityQuantizer: dtype={self.dtype} is not a floating-point dtype; "
                "use None (keep the input dtype), torch.bfloat16, torch.float16 or torch.float32"
            )
        if self.dtype is not None and self.dtype.itemsize < 2:
            raise ValueError(
                f"IdentityQuantizer: dtype={self.dtype} is a quantized dtype; use Float8Quantizer "
                "for FP8, or a 16/32-bit float here"
            )


@register(IdentityQuantizer)
class IdentityCodec(Codec):
    name = "identity"
    q: IdentityQuantizer

    def fields(self) -> dict[str, int | None]:
        return {"data": 1}

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> Payload:
        if self.q.dtype is None or self.q.dtype == x.dtype:
            return {"data": x.clone()}  # bit-exact passthrough
        return {"data": _bits.canonical_nan(x.to(self.q.dtype))}

    def kernel_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec | None:
        out = self.q.dtype or dtype
        if out not in kernels.INPUT_DTYPES:
            return None
        return kernels.KernelSpec(kernels.IDENTITY, (0, 0), (("data", shape, out),), out_dtype=out)

    def _kernel(
        self, payload: Payload, shape: tuple[int, int], factored: bool = False, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor | None:
        return None  # a copy needs no kernel (the quantize kernel's IDENTITY slot only writes payloads)

    def _reference(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        return payload["data"].to(torch.float32, copy=True)  # never hand out the stored data itself

    def empty(self, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Payload:
        return {"data": torch.zeros(shape, dtype=self.q.dtype or dtype, device=device)}

    def identical_directions(self) -> bool:
        return True

    def _factored(
        self, payload: Payload, shape: tuple[int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return payload["data"].to(dtype), None  # read-only use: no copy when the dtype matches

    def exact_dtype(self, payload: Payload, rotated: bool = False) -> torch.dtype:
        return torch.bfloat16 if payload["data"].dtype == torch.bfloat16 else torch.float32

    def lossless(self, dtype: torch.dtype) -> bool:
        return self.q.dtype is None or self.q.dtype == dtype
