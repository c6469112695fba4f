"""Tensor- and sequence-parallel collectives for user models (the decoder's ``SplitToSP`` before the
first block, ``GatherToReplicated`` before a high-precision head), and
:func:`gather_along_first_dim`, whose quantized result is a :class:`dtq.QuantizedTensor`.

The collectives themselves live in :mod:`dtq.distributed.tp`, below :mod:`dtq.nn`, whose GEMMs
run them inside ``LinearFn``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtq.distributed.tp import (
    CopyToTP,
    GatherFromSP,
    GatherToReplicated,
    ReduceFromTP,
    ScatterToSP,
    SplitToSP,
    TPSpec,
    local_param,
    reduce_amax,
)
from dtq.distributed.tp import gather_along_first_dim as _gather
from dtq.formats import Quantizer
from dtq.tensor import QuantizedTensor

__all__ = [
    "CopyToTP",
    "ReduceFromTP",
    "GatherFromSP",
    "ScatterToSP",
    "SplitToSP",
    "GatherToReplicated",
    "TPSpec",
    "local_param",
    "reduce_amax",
    "gather_along_first_dim",
]


def gather_along_first_dim(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    quantizer: Quantizer | None = None,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    amax: dict | None = None,
) -> torch.Tensor:
    """All-gather a sequence-parallel shard ``x`` (dim 0 split across ``group``); with a
    ``quantizer``, the :class:`dtq.QuantizedTensor` of the whole, bitwise ``quantizer.quantize(whole)``
    (see :func:`dtq.distributed.tp.gather_along_first_dim` for how, and what it costs)."""
    out = _gather(x, group, quantizer, rowwise=rowwise, columnwise=columnwise, amax=amax)
    if quantizer is None:
        return out
    return QuantizedTensor(
        out.shape, out.dtype, out.quantizer, {d: out.payload(d) for d in out.directions}, shape2d=out.shape2d
    )
