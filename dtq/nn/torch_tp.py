"""torch's own tensor-parallel styles on a ``dtq.nn.Linear``.

``torch.distributed.tensor.parallel.ColwiseParallel`` / ``RowwiseParallel`` accept a
``dtq.nn.Linear`` (it is an ``nn.Linear``): they shard its parameters as DTensors (the weight's
local shard keeps its quantized FSDP2 gather) and hand its forward a DTensor input. The module
then runs its GEMM as dtq's own styles do, quantized on the local shards, and returns the DTensor
layout torch's style expects. The communication around the GEMM stays torch's, in high precision;
dtq's styles (``dtq.parallel.ColwiseParallel`` ...) also quantize the sequence-parallel gathers.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtq.distributed.tp import TPSpec


def _is_shard(placement, dim: int, ndim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim % ndim == dim % ndim


def linear_forward(module: torch.nn.Module, x: DTensor) -> DTensor:
    """``module(x)`` for a DTensor ``x``: column-parallel when the weight is ``Shard(0)`` (input
    replicated, output sharded on its last dim), row-parallel when ``Shard(1)`` (input sharded on
    its last dim, output summed: replicated)."""
    weight, name = module.weight, f"{type(module).__name__} {module.name!r}"
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or mesh.ndim != 1 or not any(_is_shard(weight.placements[0], d, 2) for d in (0, 1)):
        got = (
            f"a DTensor weight with placements {tuple(weight.placements)}"
            if mesh is not None
            else "a weight that is no DTensor"
        )
        raise ValueError(
            f"dtq: {name} got a DTensor input but has {got}; tensor parallelism needs the weight "
            "sharded on one mesh dim, Shard(0) (torch's or dtq.parallel's ColwiseParallel) or "
            "Shard(1) (RowwiseParallel)"
        )
    kind = "column" if _is_shard(weight.placements[0], 0, 2) else "row"
    ok = isinstance(x.placements[0], Replicate) if kind == "column" else _is_shard(x.placements[0], -1, x.ndim)
    if x.device_mesh != mesh or not ok:
        want = "Replicate()" if kind == "column" else "Shard(-1)"
        raise ValueError(
            f"dtq: {name} is {kind}-parallel and takes an input DTensor placed {want} on its weight's "
            f"mesh, got placements {tuple(x.placements)}"
        )
    tp = module.gemm_state.tp
    if tp is None:  # first call: run as dtq's styles would have set it up
        module.gemm_state.set_tensor_parallel({0: TPSpec(kind)}, mesh)
    elif dict(tp.specs) != {0: TPSpec(kind)} or tp.mesh != mesh:
        raise ValueError(
            f"dtq: {name} was parallelized as {dict(tp.specs)} and now gets a {kind}-parallel DTensor "
            "input; apply one tensor-parallel style per module"
        )
    y = module._linear(x.to_local(), weight, module.bias)
    return DTensor.from_local(y, mesh, [Shard(y.ndim - 1) if kind == "column" else Replicate()], run_check=False)
