"""Amaxes of sharded tensors: which ranks' values combine, in one MAX all-reduce per group.

An amax a direction needs (``Codec.needs_amax``) is taken over every row: tensor-wide (0-dim) or
one per column (``[1, K]``, FP8 row-wise scaling's columnwise direction). Ranks holding other
rows of the same tensor (FSDP2 shards, sequence-parallel shards, column-parallel weights) reduce
all of them; ranks holding other columns (row-parallel weights) only the tensor-wide ones, since
a column's amax is then whole on the rank that has the column.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dtq import _torch_private
from dtq.codec import DIRECTIONS, ROWWISE
from dtq.distributed import collective

if TYPE_CHECKING:
    from dtq.formats import Quantizer


class AmaxSync:
    """The delayed-scaling amaxes of one ``dtq.autocast(amax_group=...)`` region, reduced over the
    group so that every rank's histories (hence scales and checkpointed buffers) agree.

    A module pushes its local current amax into its history (entry 0) and registers the history
    here; until the flush, its scales come only from the entries before the pending ones
    (``pending``), which every rank shares. ``flush`` MAX-reduces all pending entries in one
    all-reduce and writes them back: at the region's exit, and at the end of each backward pass
    that recorded gradient amaxes (with reentrant recompute, each recomputed segment's backward
    is a backward pass of its own)."""

    def __init__(self, group: dist.ProcessGroup):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "dtq.autocast(amax_group=...) reduces amaxes over a process group, but torch.distributed "
                "is not initialized: call torch.distributed.init_process_group first, or leave "
                "amax_group=None in a single-process run"
            )
        self.group = group
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}  # id(history) -> (history, entries pushed)
        self._queued_in: set[int] = set()  # backward passes (graph tasks) with a flush queued

    def pending(self, history: torch.Tensor) -> int:
        """How many of ``history``'s newest entries are local amaxes not reduced yet."""
        return self._pending.get(id(history), (history, 0))[1]

    def add(self, history: torch.Tensor) -> None:
        """Register the local amax just pushed into ``history[0]``; inside backward, make sure
        this backward pass ends with a flush."""
        self._pending[id(history)] = (history, self.pending(history) + 1)
        task = _torch_private.graph_task_id()
        if task != -1 and task not in self._queued_in:
            self._queued_in.add(task)
            _torch_private.at_end_of_backward(lambda: self._flush_backward(task))

    def _flush_backward(self, task: int) -> None:
        self._queued_in.discard(task)
        self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        """One all-reduce of every pending entry (the same list on every rank of the group)."""
        pending, self._pending = list(self._pending.values()), {}
        entries = [hist[: min(n, hist.numel())] for hist, n in pending]
        for (hist, _), reduced in zip(pending, all_reduce_max(entries, self.group)):
            hist[: reduced.numel()] = reduced


def all_reduce_max(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """``tensors`` (any shapes) MAX-reduced over ``group`` in one all-reduce, as new fp32 tensors
    of the same shapes."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    if dist.get_world_size(group) > 1:
        collective.run(dist.all_reduce, flat, op=dist.ReduceOp.MAX, group=group)
    return unflatten(flat, tensors)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for t in like:
        out.append(flat[i : i + t.numel()].reshape(t.shape))
        i += t.numel()
    return out


def reduce_over_shards(amax: dict, group, dim: int = 0) -> dict:
    """``{direction: amax}`` of a tensor sharded along ``dim`` of its [M, K] view over ``group``,
    reduced to the whole tensor's values."""
    keys = [d for d, a in amax.items() if dim == 0 or a.dim() == 0]
    return {**amax, **dict(zip(keys, all_reduce_max([amax[d] for d in keys], group)))}


def sharded_amax(
    quantizer: Quantizer,
    x: torch.Tensor,
    reduce: Callable[[dict], dict],
    *,
    rowwise: bool = True,
    columnwise: bool = True,
) -> dict:
    """The amaxes that make shard ``x`` quantize as the slice of the whole tensor: the local ones
    MAX-reduced by ``reduce`` (``{direction: local} -> {direction: global}``), in a second round
    for a direction whose amax needs another's reduced first (``Quantizer.deferred_amax``: a
    hybrid whose columnwise payload is quantized from its rowwise one)."""
    amax = quantizer.local_amax(x, rowwise=rowwise, columnwise=columnwise)
    if amax:
        amax = reduce(amax)
    for d in quantizer.deferred_amax(rowwise, columnwise):
        later = quantizer.local_amax(x, rowwise=False, columnwise=True, rowwise_amax=amax[ROWWISE])
        amax = {**amax, d: reduce({d: later[d]})[d]}
    return amax


def sharded_amaxes(
    items: Sequence[tuple[Quantizer, torch.Tensor, bool, bool]],
    reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    local: Sequence[dict] | None = None,
) -> list[dict]:
    """:func:`sharded_amax` of many ``(quantizer, shard, rowwise, columnwise)`` at once, with one
    ``reduce`` of all their values per round (a second only if some quantizer defers an amax).
    ``local``: the items' ``local_amax`` results where the caller has them already."""
    out = local if local is not None else [q.local_amax(x, rowwise=r, columnwise=c) for q, x, r, c in items]
    reduced = iter(reduce([a for amax in out for a in amax.values()]))
    out = [{d: next(reduced) for d in amax} for amax in out]
    later = [
        (i, d, q.local_amax(x, rowwise=False, columnwise=True, rowwise_amax=out[i][ROWWISE])[d])
        for i, (q, x, r, c) in enumerate(items)
        for d in q.deferred_amax(r, c)
    ]
    if later:
        for (i, d, _), a in zip(later, reduce([a for *_, a in later])):
            out[i][d] = a
    return out


def sharded_dim(tensor_dim: int, ndim: int) -> int:
    """The dim of the [M, K] view (all leading dims flattened) that a shard of ``tensor_dim`` cuts."""
    return 1 if tensor_dim == ndim - 1 else 0


def sharded_dims(param: torch.Tensor) -> list[tuple[int, int]]:
    """``(mesh dim, dim of the [M, K] view)`` of every mesh dim that shards a DTensor ``param``."""
    from torch.distributed.tensor import Shard

    return [
        (i, sharded_dim(p.dim, param.dim()))
        for i, p in enumerate(getattr(param, "placements", ()))
        if isinstance(p, Shard) and param.device_mesh.size(i) > 1
    ]


def check_column_shards(quantizer: Quantizer, param: torch.Tensor, name: str) -> None:
    """Raise if ``param`` (a DTensor) is sharded along its last dim and ``quantizer`` has a scale
    spanning whole rows, which a shard of columns cannot hold as a slice of the whole payload."""
    if all(dim == 0 for _, dim in sharded_dims(param)):
        return
    shape = param.shape
    for d in DIRECTIONS:
        sub = quantizer.for_direction(d)
        if not quantizer.codec(d).column_shardable():
            raise ValueError(
                f"{name} (shape {list(shape)}) is sharded along its last dim (a row-parallel weight under tensor "
                f"parallelism), but {type(sub).__name__} ({d}) has one scale per whole row or column, which a "
                "shard of columns cannot hold as a slice of the whole tensor's payload. Keep these weights in high "
                "precision (quantized_params=False: each rank quantizes its own shard for its GEMMs) or give them "
                "another format through the recipe"
            )
