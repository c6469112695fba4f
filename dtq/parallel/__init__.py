"""The distributed API for users: tensor/sequence-parallel styles, ``precompute_amax``,
``gather_high_precision``, ``one_rank_gathers`` and ``kernel_gradient_packing`` for FSDP2,
master-weight casts, CPU offload and byte counters. It stands on :mod:`dtq.nn`; the collectives
that dtq modules run themselves are in :mod:`dtq.distributed`."""

from dtq.distributed.comm import comm_stats
from dtq.parallel.fsdp import (
    HighPrecisionWeight,
    gather_high_precision,
    kernel_gradient_packing,
    one_rank_gathers,
    precompute_amax,
    resolve_quantized_gather,
)
from dtq.parallel.master import FlatSlice, quantize_master_weights
from dtq.parallel.offload import offload
from dtq.parallel.styles import ColwiseParallel, LayerNormMLPParallel, RowwiseParallel
from dtq.parallel.tp import gather_along_first_dim

__all__ = [
    "comm_stats",
    "precompute_amax",
    "gather_high_precision",
    "resolve_quantized_gather",
    "one_rank_gathers",
    "kernel_gradient_packing",
    "HighPrecisionWeight",
    "FlatSlice",
    "quantize_master_weights",
    "offload",
    "gather_along_first_dim",
    "ColwiseParallel",
    "RowwiseParallel",
    "LayerNormMLPParallel",
]
