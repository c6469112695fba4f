"""Tensor- and sequence-parallel communication: quantized sequence-parallel gathers of activations
and gradients, and the high-precision reductions of partial GEMM results around them.

Sequence parallelism splits activations along their **first** dimension (sequence-first
``[S, B, H]`` or flattened tokens ``[T, H]``): a gather is then a concatenation of payload rows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dtq.codec import (
    COLUMNWISE,
    ROWWISE,
    QuantizedData,
    columnwise_from_rowwise,
    quantize_payloads,
    row_bytes,
    shape_2d,
    split_derived,
)
from dtq.distributed import amax as amax_lib
from dtq.distributed import collective, comm

if TYPE_CHECKING:
    from dtq.formats import Quantizer


def _all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    flat = t.contiguous().view(torch.uint8)  # any dtype travels as bytes (gloo has no float8)
    out = [torch.empty_like(flat) for _ in range(world)]
    collective.run(dist.all_gather, out, flat, group=group)
    return torch.cat(out).view(t.dtype)


def gather_rows(x: torch.Tensor, group, reason: str | None = None) -> torch.Tensor:
    """Plain all-gather along dim 0 in ``x``'s dtype. With a ``reason`` (a GEMM operand that moves
    in high precision: no recipe, no quantizer, a high-precision backward override) it is counted
    as ``<dtype>/fallback`` and warned about once; without, as ``<dtype>/high_precision`` (high
    precision on purpose: cheaper than the payloads, or feeding a high-precision layer)."""
    nbytes = x.numel() * x.element_size() * dist.get_world_size(group)
    if reason is None:
        comm.record(str(x.dtype).replace("torch.", ""), "high_precision", nbytes)
    else:
        comm.record_fallback(x.dtype, nbytes, "a sequence-parallel gather", reason)
    return _all_gather_rows(x, group)


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's dim-0 slice (sequence-parallel GEMM outputs)."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(
            f"sequence parallel: a tensor of shape {list(x.shape)} cannot be reduce-scattered over "
            f"{world} ranks along dim 0; use a sequence length divisible by the TP size"
        )
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    collective.run(_reduce_scatter, out, x.contiguous(), group=group)
    return out


# torch 2.13 renamed reduce_scatter_tensor (and deprecated the old name); 2.9-2.12 have only that.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    collective.run(dist.all_reduce, x, group=group)
    return x


@dataclasses.dataclass(frozen=True)
class TPSpec:
    """How one GEMM of a module is split over a tensor-parallel group (set by dtq's parallel
    styles): ``"column"`` shards the weight's output features, ``"row"`` its input features.
    ``sequence_parallel``: activations outside the GEMM pair are split along dim 0, so a column
    GEMM gathers its input (quantized) and a row GEMM reduce-scatters its output."""

    kind: str
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.kind not in ("column", "row"):
            raise ValueError(f"TPSpec.kind={self.kind!r}; use 'column' or 'row'")

    @property
    def gathers_input(self) -> bool:
        return self.kind == "column" and self.sequence_parallel

    @property
    def scatters_output(self) -> bool:
        return self.kind == "row" and self.sequence_parallel


class CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the partial input gradients of a column-parallel GEMM."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_sum(g, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Sums the partial outputs of a row-parallel GEMM; the gradient passes through."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


NO_RECIPE = "no dtq recipe is active for its module (run the step under dtq.autocast)"


class GatherFromSP(torch.autograd.Function):
    """High-precision sequence gather (forward) / reduce-scatter (backward), for GEMMs that run
    without a recipe (a counted, warned fall-back)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_rows(x, group, reason=NO_RECIPE)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_rows(g, ctx.group), None


class ScatterToSP(torch.autograd.Function):
    """Reduce-scatter of partial outputs (forward) / high-precision gather of the gradient, for
    GEMMs that run without a recipe (a counted, warned fall-back)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_rows(g, ctx.group, reason=NO_RECIPE), None


class SplitToSP(torch.autograd.Function):
    """Keep this rank's dim-0 slice of a replicated tensor (entering a sequence-parallel region);
    backward gathers the slices' gradients, so replicated producers see the whole gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        if x.shape[0] % world:
            raise ValueError(
                f"sequence parallel: a tensor of shape {list(x.shape)} cannot be split evenly along dim 0 "
                f"over {world} ranks; use a sequence length divisible by the TP size"
            )
        return x.chunk(world)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, g):
        return gather_rows(g, ctx.group), None


class GatherToReplicated(torch.autograd.Function):
    """Gather dim-0 slices into the whole tensor (leaving a sequence-parallel region for a
    computation every rank repeats); backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)].contiguous(), None


def gather_along_first_dim(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    quantizer: Quantizer | None = None,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    amax: dict | None = None,
) -> torch.Tensor | QuantizedData:
    """All-gather a sequence-parallel shard ``x`` (dim 0 split across ``group``).

    With a ``quantizer``, the result is the ``QuantizedData`` of the whole tensor holding the
    requested directions, bitwise ``quantizer.quantize(whole)``: per-tensor amaxes are reduced over
    the group first (one all-reduce), then each rank's payload rows are gathered. When those
    payloads would outweigh the high-precision tensor (both directions of an 8-bit format, say),
    the high-precision shard is gathered instead and quantized locally: the same bits, fewer
    bytes. Stochastic rounding draws one seed from torch's generator (recompute replays it) and
    offsets it by the rank, so shards do not repeat each other's random bits: the result is then
    the concatenation of each shard's quantization. Without a quantizer it is a plain all-gather
    (counted and warned about as a fall-back).
    ``amax`` (``{direction: tensor}``, already the same on every rank, e.g. from delayed scaling)
    replaces the reduced current amaxes."""
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    hp_bytes = x.numel() * x.element_size() * world
    if quantizer is None:
        return gather_rows(x, group, reason="no quantizer was given")
    dirs = tuple(d for d, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on)
    local_rows = shape_2d(x.shape)[0]
    for d in dirs:
        need = quantizer.block_rows(d)
        if local_rows % need:
            raise ValueError(
                f"gather_along_first_dim: each rank holds {local_rows} rows of a tensor of shape "
                f"{list(x.shape)}, but {quantizer.for_direction(d).format_name} {d} blocks span {need} "
                f"rows; use a sequence length per rank that is a multiple of {need}"
            )
    moved, derived = split_derived(quantizer, dirs, shape_2d(x.shape))
    aliases = quantizer.aliases(moved)
    q_bytes = sum(row_bytes(quantizer, d, shape_2d(x.shape)) * world for d in moved if d not in aliases)
    full_shape = (x.shape[0] * world, *x.shape[1:])
    if q_bytes > hp_bytes:  # the cheaper correct representation (the whole's own amax is the global one)
        whole = gather_rows(x, group)
        return quantizer.quantize_data(whole, rowwise=rowwise, columnwise=columnwise, amax=amax)
    if amax is None:
        amax = reduce_amax(quantizer, x, group, rowwise=ROWWISE in moved, columnwise=COLUMNWISE in moved)
    payloads = quantize_payloads(quantizer, x, moved, amax=amax or None, seed=_shard_seed(quantizer, moved, x, group))
    gathered: dict = {}
    for d in moved:
        if d in aliases:
            gathered[d] = dict(gathered[aliases[d]])
            continue
        codec = quantizer.codec(d)
        fields = codec.fields()
        gathered[d] = {k: (_all_gather_rows(v, group) if fields[k] is not None else v) for k, v in payloads[d].items()}
        comm.record(
            codec.name,
            d,
            sum(v.numel() * v.element_size() * world for k, v in payloads[d].items() if fields[k] is not None),
        )
    for d in derived:  # a columnwise payload quantized from the rowwise one: from the gathered rows
        gathered[d] = columnwise_from_rowwise(quantizer, gathered[ROWWISE], shape_2d(full_shape))
        comm.record(
            quantizer.for_direction(d).format_name, f"{d}_derived", row_bytes(quantizer, d, shape_2d(x.shape)) * world
        )
    return QuantizedData(full_shape, x.dtype, quantizer, gathered, device=x.device)


def reduce_amax(
    quantizer: Quantizer,
    x: torch.Tensor,
    group,
    *,
    rowwise: bool,
    columnwise: bool,
    amax: dict | None = None,
    dim: int = 0,
) -> dict:
    """The amaxes of a tensor split along ``dim`` of its [M, K] view over ``group``: the local ones
    (or ``amax``), MAX-reduced in one all-reduce (see :mod:`dtq.distributed.amax`)."""
    if dist.get_world_size(group) == 1:
        return amax if amax is not None else quantizer.local_amax(x, rowwise=rowwise, columnwise=columnwise)
    if amax is not None:
        return amax_lib.reduce_over_shards(amax, group, dim) if amax else amax
    return amax_lib.sharded_amax(
        quantizer,
        x,
        lambda a: amax_lib.reduce_over_shards(a, group, dim),
        rowwise=rowwise,
        columnwise=columnwise,
    )


def _shard_seed(quantizer: Quantizer, dirs, x: torch.Tensor, group) -> torch.Tensor | None:
    if not any(quantizer.codec(d).uses_rng() for d in dirs):
        return None
    seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=x.device)
    return (seed + dist.get_rank(group) * 1_000_003) % (2**31 - 1)


def local_param(p: torch.Tensor, reduce_group=None) -> torch.Tensor:
    """A parameter as a plain tensor for a local computation: a DTensor's local shard (gradient
    flowing back to it). ``reduce_group``: the parameter is replicated but sees only this rank's
    sequence shard, so its gradient is summed over the group (sequence-parallel norms and biases)."""
    if hasattr(p, "device_mesh"):
        p = p.to_local()
    return CopyToTP.apply(p, reduce_group) if reduce_group is not None else p
