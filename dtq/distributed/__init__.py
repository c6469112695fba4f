"""Collectives below the tensor layer: amax reductions, byte counters, the launched-world check,
tensor/sequence-parallel collectives and the mechanics of FSDP2's all-gather extensions.

Nothing here knows dtq modules: what a gather serves (recipe, directions) is asked of the
module's ``gemm_state`` through the :class:`dtq.distributed.gather.GatherPlanner` protocol. The
user-facing distributed API (styles, ``precompute_amax``, offload, master-weight casts) is
:mod:`dtq.parallel`, which stands on top of :mod:`dtq.nn`."""
