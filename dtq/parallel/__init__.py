"""Distributed pieces: FSDP2 all-gather extensions, master-weight casts, byte counters."""

from dtq.parallel.comm import comm_stats
from dtq.parallel.fsdp import HighPrecisionWeight, precompute_amax
from dtq.parallel.master import FlatSlice, quantize_master_weights
from dtq.parallel.offload import offload
from dtq.parallel.tp import gather_along_first_dim

__all__ = ["comm_stats", "precompute_amax", "HighPrecisionWeight", "FlatSlice", "quantize_master_weights", "offload",
           "gather_along_first_dim"]
