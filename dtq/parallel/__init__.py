"""Distributed pieces: FSDP2 all-gather extensions, tensor/sequence parallelism, master-weight
casts, CPU offload, byte counters."""

from dtq.parallel.comm import comm_stats
from dtq.parallel.fsdp import HighPrecisionWeight, precompute_amax
from dtq.parallel.master import FlatSlice, quantize_master_weights
from dtq.parallel.offload import offload
from dtq.parallel.tp import gather_along_first_dim

_STYLES = ("ColwiseParallel", "RowwiseParallel", "LayerNormMLPParallel")

__all__ = ["comm_stats", "precompute_amax", "HighPrecisionWeight", "FlatSlice", "quantize_master_weights", "offload",
           "gather_along_first_dim", *_STYLES]


def __getattr__(name: str):
    if name in _STYLES:  # imported on use: the styles depend on dtq.nn, which depends on this package
        from dtq.parallel import styles

        return getattr(styles, name)
    raise AttributeError(f"module 'dtq.parallel' has no attribute {name!r}")
