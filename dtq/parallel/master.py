"""Casting FP32 master weights into quantized parameters, across ranks, with one all-reduce per
sharding mesh dim (one under FSDP2 alone; two under FSDP2 x TP).

Two layouts of masters:

* **dim-0 shards** (FSDP2): each master has the local shape of its parameter shard. Only the
  tensor-wide amaxes (per-tensor FP8, NVFP4) need reducing; block amaxes live inside a shard.
* **flat slices** (ZeRO-style): a :class:`FlatSlice` holds elements ``[start, start + n)`` of the
  flattened full parameter, which every rank holds whole. Slices may cut through blocks: each
  rank's partial block amaxes are reduced (MAX) with the others', the scales come out identical
  on every rank, and each rank writes the codes of its own elements.

All amaxes of all parameters travel together: one all-reduce per mesh dim that shards them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dtq import _bits
from dtq._torch_private import local_tensor
from dtq.codec import quantize_payloads
from dtq.distributed.amax import all_reduce_max, check_column_shards
from dtq.tensor import QuantizedTensor


@dataclasses.dataclass
class FlatSlice:
    """Elements ``[start, start + data.numel())`` of a flattened full parameter."""

    data: torch.Tensor
    start: int


def _local(p: torch.Tensor) -> QuantizedTensor:
    t = local_tensor(p)
    if not isinstance(t, QuantizedTensor):
        raise TypeError(
            f"quantize_master_weights: parameter of type {type(t).__name__} is not quantized; pass "
            "QuantizedTensor parameters (dtq.convert(..., quantized_params=True))"
        )
    return t


def _default_groups(params) -> list:
    """Where tensor-wide amaxes are reduced: every mesh dimension that shards some parameter (FSDP2's
    shard dim, a TP dim, both on a 2-D mesh; not HSDP's replicate dim), in a fixed order. A MAX
    over a group that holds replicas of a tensor changes nothing, so one list serves all."""
    from torch.distributed.tensor import DTensor, Shard

    groups: list = []
    any_dtensor = False
    for p in params:
        if isinstance(p, DTensor):
            any_dtensor = True
            for i, placement in enumerate(p.placements):
                g = p.device_mesh.get_group(i)
                if isinstance(placement, Shard) and p.device_mesh.size(i) > 1 and all(g is not h for h in groups):
                    groups.append(g)
    if any_dtensor:
        return groups
    return [dist.group.WORLD] if dist.is_available() and dist.is_initialized() else []


def _write(param: QuantizedTensor, payloads: dict, element_range: tuple[int, int] | None) -> None:
    m, k = param.shape2d
    for d, payload in payloads.items():
        if not param.has(d):
            continue
        codec = param.quantizer.codec(d)
        fields = codec.fields()
        for field, new in payload.items():
            old = param.payload(d)[field]
            if element_range is None or field != "data":
                old.copy_(new)
                continue
            per_elem = new.numel() / (m * k)  # bytes-per-element of the code field (1 or 1/2)
            a, b = element_range[0] * per_elem, element_range[1] * per_elem
            if a != int(a) or b != int(b):
                raise ValueError(
                    f"quantize_master_weights: a flat slice [{element_range[0]}, {element_range[1]}) of a "
                    f"{codec.name} parameter must start and end on a whole code byte "
                    f"(an even element index)"
                )
            old.view(-1)[int(a) : int(b)].copy_(new.reshape(-1)[int(a) : int(b)])
            assert fields[field] is not None


@torch.no_grad()
def quantize_master_weights(
    params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor | FlatSlice], group: dist.ProcessGroup | None = None
) -> None:
    """Requantize every parameter's held directions from its FP32 master, in place.

    ``params`` are QuantizedTensor parameters (or DTensors of them); ``masters`` the matching
    dim-0 shards or :class:`FlatSlice` objects. ``group`` is where the amaxes are reduced
    (default: every mesh dim that shards the parameters, FSDP2's and tensor-parallel ones; else
    the default group; nowhere without ``torch.distributed``)."""
    params, masters = list(params), list(masters)
    if len(params) != len(masters):
        raise ValueError(f"quantize_master_weights: {len(params)} parameters but {len(masters)} masters")
    groups = [group] if group is not None else _default_groups(params)
    plans, stats = [], []
    for i, (p, master) in enumerate(zip(params, masters)):
        qt = _local(p)
        check_column_shards(qt.quantizer, p, f"quantize_master_weights: parameter {i}")
        dirs = qt.directions
        q = qt.quantizer
        if isinstance(master, FlatSlice):
            plans.append(_plan_flat(qt, master, dirs, stats))
        else:
            if tuple(master.shape) != tuple(qt.shape):
                raise ValueError(
                    f"quantize_master_weights: master of shape {list(master.shape)} for a parameter shard "
                    f"of shape {list(qt.shape)}; pass matching dim-0 shards or FlatSlice objects"
                )
            for d in dirs:
                if qt.shape2d[0] % q.block_rows(d):
                    raise ValueError(
                        f"quantize_master_weights: a dim-0 shard of {qt.shape2d[0]} rows cannot hold whole "
                        f"{q.block_rows(d)}-row {q.for_direction(d).format_name} {d} blocks; cast such parameters from "
                        f"FlatSlice masters (partial block amaxes are then reduced across ranks) or shard them so that "
                        f"every shard has a multiple of {q.block_rows(d)} rows"
                    )
            amax = q.local_amax(master, rowwise="rowwise" in dirs, columnwise="columnwise" in dirs)
            first = len(stats)
            stats.extend(amax.values())
            plans.append(("shard", qt, master, dirs, list(amax), first))
    for g in groups:  # one all-reduce per sharding mesh dim (one, without tensor parallelism)
        stats = all_reduce_max(stats, g)
    for plan in plans:
        if plan[0] == "shard":
            _, qt, master, dirs, keys, first = plan
            amax = {d: stats[first + i] for i, d in enumerate(keys)}
            _write(qt, quantize_payloads(qt.quantizer, master, dirs, amax=amax), None)
        else:
            _finish_flat(plan, stats)


def _plan_flat(qt: QuantizedTensor, sl: FlatSlice, dirs, stats: list):
    m, k = qt.shape2d
    start, end = sl.start, sl.start + sl.data.numel()
    if not 0 <= start <= end <= m * k:
        raise ValueError(
            f"quantize_master_weights: FlatSlice [{start}, {end}) is outside the {m * k} elements of a "
            f"parameter of shape {list(qt.shape)}"
        )
    buf = torch.zeros(m * k, dtype=torch.float32, device=sl.data.device)
    buf[start:end] = sl.data.float().reshape(-1)
    ours = torch.zeros(m * k, dtype=torch.bool, device=sl.data.device)
    ours[start:end] = True
    buf, ours = buf.view(m, k), ours.view(m, k)
    entries = {}
    for d in dirs:
        codec = qt.quantizer.codec(d)
        sub = codec.q
        if codec.amax_space() != "x":
            raise ValueError(
                f"quantize_master_weights: {sub!r} transforms its {d} direction across rows; a flat "
                "slice cannot be cast piecewise. Use dim-0 shards for this parameter"
            )
        tile = codec.tile((m, k))
        if tile is not None and not codec.scales_from_block_amax():
            raise ValueError(
                f"quantize_master_weights: {sub!r} chooses each {d} block scale from all the block's "
                "values, which a flat slice cutting through blocks does not hold. Use dim-0 shards "
                "(whole blocks) for this parameter"
            )
        entry = {}
        if tile is not None:
            entry["blocks"] = (len(stats), tile)
            stats.append(_bits.block_amax(buf, tile))
        if codec.needs_amax():
            entry["amax"] = len(stats)
            stats.append(codec.local_amax(buf))
        entries[d] = entry
    return ("flat", qt, buf, ours, dirs, entries, (start, end))


def _finish_flat(plan, stats):
    _, qt, buf, ours, dirs, entries, element_range = plan
    payloads = {}
    for d in dirs:
        entry = entries[d]
        filled = buf
        if "blocks" in entry:
            idx, tile = entry["blocks"]
            # Every element that is not ours holds its block's global amax: quantizing the whole
            # buffer then gives each block its global scale, and our elements their exact codes.
            filled = torch.where(ours, buf, _bits.expand_blocks(stats[idx], tile, tuple(buf.shape)))
        amax = {d: stats[entry["amax"]]} if "amax" in entry else None
        payloads[d] = quantize_payloads(qt.quantizer, filled, (d,), amax=amax)[d]
    _write(qt, payloads, element_range)


__all__ = ["FlatSlice", "quantize_master_weights"]
