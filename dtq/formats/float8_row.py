"""FP8 with one fp32 scale per row of the GEMM's contraction: "row-wise scaling".

The rowwise direction has one scale per row of ``[M, K]`` (its amax over K); the columnwise
direction one scale per column (its amax over M), i.e. one per row of ``X^T``. In every GEMM of
the three, each operand then has one scale per output row or column, which is what Hopper's
row-wise scaled GEMM (``torch._scaled_mm`` with ``[m, 1]`` / ``[1, n]`` scales) applies after the
FP8 product. Per scale: ``scale = fp8_max / amax`` (1 if amax is 0 or non-finite, capped at the
fp32 max), optionally rounded down to a power of two; ``q = sat(x * scale)``.

Sharding: a dim-0 shard holds whole rows, so the rowwise direction needs nothing from other
ranks. The columnwise direction needs each column's amax over every row: ``local_amax`` gives
``[1, K]``, which is MAX-reduced across dim-0 shards (FSDP2, sequence parallel) like a per-tensor
amax, and then shared by every slice. A shard of the last dim cannot hold rowwise scales that
span whole rows (``column_shardable`` is False): such tensor-parallel weights stay high precision.

Payload per direction: ``data`` [M, K] float8 and ``scale_inv`` fp32: rowwise [M, 1], columnwise
[1, K].

CUDA kernels: an axis-amax pass (one read: the row and/or column amaxes not given), then the fused
quantize kernel with one scale per row / column (slot kind ``FP8_ROW``); the bits are the ones
below.
"""

from __future__ import annotations

import dataclasses

import torch

from dtq import _bits, kernels
from dtq.codec import COLUMNWISE, Codec, Payload, register
from dtq.formats.base import Quantizer


@dataclasses.dataclass(frozen=True)
class Float8RowwiseQuantizer(Quantizer):
    dtype: torch.dtype = torch.float8_e4m3fn
    pow2_scales: bool = False

    def __post_init__(self):
        _bits.check_fp8_dtype(self.dtype, "Float8RowwiseQuantizer")


def _reduced_dim(direction: str) -> int:
    """The dim of [M, K] one scale spans: K (dim 1) rowwise, M (dim 0) columnwise."""
    return 0 if direction == COLUMNWISE else 1


@register(Float8RowwiseQuantizer)
class Float8RowwiseCodec(Codec):
    name = "fp8_row"
    q: Float8RowwiseQuantizer

    def fields(self) -> dict[str, int | None]:
        # columnwise scales cover every row: shared by all dim-0 slices, like a per-tensor value
        return {"data": 1, "scale_inv": None if self.direction == COLUMNWISE else 1}

    def tile(self, shape: tuple[int, int]) -> tuple[int, int]:
        return (shape[0], 1) if self.direction == COLUMNWISE else (1, shape[1])

    def needs_amax(self) -> bool:
        return self.direction == COLUMNWISE

    def amax_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        return (1, shape[1])

    def local_amax(self, x: torch.Tensor) -> torch.Tensor:
        return _bits.axis_amax(x, _reduced_dim(self.direction))

    def column_shardable(self) -> bool:
        return False

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | None = None, seed: torch.Tensor | None = None) -> Payload:
        q = self.q
        if amax is None:
            amax = _bits.axis_amax(x, _reduced_dim(self.direction))
        scale = _bits.per_tensor_scale(amax, _bits.FP8_MAX[q.dtype], q.pow2_scales)
        return {"data": _bits.cast_fp8(x.float() * scale, q.dtype), "scale_inv": torch.reciprocal(scale)}

    def kernel_spec(self, shape: tuple[int, int], dtype: torch.dtype) -> kernels.KernelSpec:
        q = self.q
        col = self.direction == COLUMNWISE
        return kernels.KernelSpec(
            kernels.FP8_ROW,
            (0, 1) if col else (1, 0),
            (("data", shape, q.dtype), ("scale_inv", _scale_shape(shape, self.direction), torch.float32)),
            e5m2=q.dtype == torch.float8_e5m2,
            pow2=q.pow2_scales,
            amax_vector="cols" if col else "rows",
        )

    def _kernel(
        self, payload: Payload, shape: tuple[int, int], factored: bool = False, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor | None:
        # The dequantize kernel's FP8 blocks, one per whole row ((1, K)) or column ((M, 1)).
        data = payload.get("data")
        if data is None or not data.is_cuda or 0 in shape:
            return None
        q = self.q
        block = (shape[0], 1) if self.direction == COLUMNWISE else (1, shape[1])
        spec = kernels.KernelSpec(
            kernels.FP8_SCALED,
            block,
            self.kernel_spec(shape, torch.float32).fields,
            e5m2=q.dtype == torch.float8_e5m2,
            pow2=q.pow2_scales,
        )
        return kernels.dequantize(spec, payload, shape, factored, dtype)

    def _reference(self, payload: Payload, shape: tuple[int, int]) -> torch.Tensor:
        return payload["data"].to(torch.float32) * payload["scale_inv"]

    def exact_dtype(self, payload: Payload, rotated: bool = False) -> torch.dtype:
        # code * 2^k keeps the code's 4 significant bits; a general scale_inv does not fit bf16
        return torch.bfloat16 if self.q.pow2_scales else torch.float32

    def empty(self, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> Payload:
        return {
            "data": torch.zeros(shape, dtype=self.q.dtype, device=device),
            "scale_inv": torch.ones(_scale_shape(shape, self.direction), dtype=torch.float32, device=device),
        }


def _scale_shape(shape: tuple[int, int], direction: str) -> tuple[int, int]:
    return (1, shape[1]) if direction == COLUMNWISE else (shape[0], 1)
