"""Amaxes of sharded tensors: which ranks' values combine, in one MAX all-reduce per group.

An amax a direction needs (``Codec.needs_amax``) is taken over every row: tensor-wide (0-dim) or
one per column (``[1, K]``, FP8 row-wise scaling's columnwise direction). Ranks holding other
rows of the same tensor (FSDP2 shards, sequence-parallel shards, column-parallel weights) reduce
all of them; ranks holding other columns (row-parallel weights) only the tensor-wide ones, since
a column's amax is then whole on the rank that has the column.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dtq.formats import DIRECTIONS, Quantizer, codec_for


class AmaxSync:
    """The delayed-scaling amaxes of one ``dtq.autocast(amax_group=...)`` region, reduced over the
    group so that every rank's histories (hence scales and checkpointed buffers) agree. A module
    writes its local current amax into entry 0 of its history and registers the history here;
    ``flush`` MAX-reduces all registered entries in one all-reduce and writes them back. The
    scale of a step comes from earlier entries, so reducing at the end of the forward (and of the
    backward, for gradient histories) changes no scale of the step itself."""

    def __init__(self, group):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("dtq.autocast(amax_group=...) reduces amaxes over a process group, but torch.distributed "
                               "is not initialized: call torch.distributed.init_process_group first, or leave "
                               "amax_group=None in a single-process run")
        self.group = group
        self._pending: list[torch.Tensor] = []
        self._backward_flush_queued = False

    def add(self, history: torch.Tensor) -> None:
        self._pending.append(history)

    def for_backward(self) -> "AmaxSync":
        """This sync, with a flush queued for the end of the running backward pass (once)."""
        if not self._backward_flush_queued:
            self._backward_flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        return self

    @torch.no_grad()
    def flush(self) -> None:
        pending, self._pending = self._pending, []
        self._backward_flush_queued = False
        for hist, amax in zip(pending, all_reduce_max([h[0] for h in pending], self.group)):
            hist[0] = amax


def all_reduce_max(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """``tensors`` (any shapes) MAX-reduced over ``group`` in one all-reduce, as new fp32 tensors
    of the same shapes."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    return unflatten(flat, tensors)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for t in like:
        out.append(flat[i:i + t.numel()].reshape(t.shape))
        i += t.numel()
    return out


def reduce_over_shards(amax: dict, group, dim: int = 0) -> dict:
    """``{direction: amax}`` of a tensor sharded along ``dim`` of its [M, K] view over ``group``,
    reduced to the whole tensor's values."""
    keys = [d for d, a in amax.items() if dim == 0 or a.dim() == 0]
    return {**amax, **dict(zip(keys, all_reduce_max([amax[d] for d in keys], group)))}


def sharded_dim(tensor_dim: int, ndim: int) -> int:
    """The dim of the [M, K] view (all leading dims flattened) that a shard of ``tensor_dim`` cuts."""
    return 1 if tensor_dim == ndim - 1 else 0


def sharded_dims(param: torch.Tensor) -> list[tuple[int, int]]:
    """``(mesh dim, dim of the [M, K] view)`` of every mesh dim that shards a DTensor ``param``."""
    from torch.distributed.tensor import Shard

    return [(i, sharded_dim(p.dim, param.dim())) for i, p in enumerate(getattr(param, "placements", ()))
            if isinstance(p, Shard) and param.device_mesh.size(i) > 1]


def check_column_shards(quantizer: Quantizer, param: torch.Tensor, name: str) -> None:
    """Raise if ``param`` (a DTensor) is sharded along its last dim and ``quantizer`` has a scale
    spanning whole rows, which a shard of columns cannot hold as a slice of the whole payload."""
    if all(dim == 0 for _, dim in sharded_dims(param)):
        return
    shape = param.shape
    for d in DIRECTIONS:
        sub = quantizer.for_direction(d)
        if not codec_for(sub).column_shardable(sub, d):
            raise ValueError(
                f"{name} (shape {list(shape)}) is sharded along its last dim (a row-parallel weight under tensor "
                f"parallelism), but {type(sub).__name__} ({d}) has one scale per whole row or column, which a "
                "shard of columns cannot hold as a slice of the whole tensor's payload. Keep these weights in high "
                "precision (quantized_params=False: each rank quantizes its own shard for its GEMMs) or give them "
                "another format through the recipe")
