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
    stats = _reduce(stats, groups)
    # A second round for amaxes taken over values that depend on the first round's (a hybrid whose
    # columnwise payload is quantized from its rowwise one): nothing moves unless some parameter has one.
    later = [
        (i, plan)
        for i, plan in enumerate(plans)
        if plan[0] == "flat" or plan[1].quantizer.deferred_amax("rowwise" in plan[3], "columnwise" in plan[3])
    ]
    more: list = []
    followups = {i: _second_round(plan, stats, more) for i, plan in later}
    more = _reduce(more, groups)
    for i, plan in enumerate(plans):
        if plan[0] == "shard":
            _, qt, master, dirs, keys, first = plan
            amax = {d: stats[first + j] for j, d in enumerate(keys)}
            if i in followups:
                amax.update({d: more[j] for d, j in followups[i].items()})
            _write(qt, quantize_payloads(qt.quantizer, master, dirs, amax=amax), None)
        else:
            _finish_flat(plan, stats, followups[i], more)


def _reduce(stats: list, groups) -> list:
    for g in groups:  # one all-reduce per sharding mesh dim (one, without tensor parallelism)
        stats = all_reduce_max(stats, g)
    return stats


def _second_round(plan, stats: list, more: list) -> dict:
    """Append to ``more`` the local second-round amaxes of ``plan`` (given the reduced first-round
    ``stats``); return where each went."""
    if plan[0] == "shard":
        _, qt, master, dirs, keys, first = plan
        q = qt.quantizer
        out = {}
        for d in q.deferred_amax("rowwise" in dirs, "columnwise" in dirs):
            rowwise_amax = stats[first + keys.index("rowwise")]
            out[d] = len(more)
            more.append(q.local_amax(master, rowwise=False, columnwise=True, rowwise_amax=rowwise_amax)[d])
        return out
    return _flat_second_round(plan, stats, more)


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
    q = qt.quantizer
    derived = "columnwise" in dirs and q.columnwise_from_rowwise()
    entries = {}
    for d in ("rowwise", "columnwise"):
        if d not in dirs and not (derived and d == "rowwise"):
            continue
        _check_flat(q.codec(d), d, (m, k))
        # a columnwise payload quantized from the rowwise one: its stats are the second round's
        entries[d] = {} if derived and d == "columnwise" else _block_stats(q.codec(d), buf, stats)
    return ("flat", qt, buf, ours, dirs, entries, (start, end))


def _check_flat(codec, d: str, shape: tuple[int, int]) -> None:
    if codec.amax_space() != "x":
        raise ValueError(
            f"quantize_master_weights: {codec.q!r} transforms its {d} direction across rows; a flat "
            "slice cannot be cast piecewise. Use dim-0 shards for this parameter"
        )
    if codec.tile(shape) is not None and not codec.scales_from_block_amax():
        raise ValueError(
            f"quantize_master_weights: {codec.q!r} chooses each {d} block scale from all the block's "
            "values, which a flat slice cutting through blocks does not hold. Use dim-0 shards "
            "(whole blocks) for this parameter"
        )


def _block_stats(codec, buf: torch.Tensor, stats: list) -> dict:
    """Append the partial block amaxes (and tensor-wide amax) of ``buf`` (zeros where not ours) to
    ``stats``; return where they went."""
    entry = {}
    tile = codec.tile(tuple(buf.shape))
    if tile is not None:
        entry["blocks"] = (len(stats), tile)
        stats.append(_bits.block_amax(buf, tile))
    if codec.needs_amax():
        entry["amax"] = len(stats)
        stats.append(codec.local_amax(buf))
    return entry


def _filled(buf: torch.Tensor, ours: torch.Tensor, entry: dict, stats: list) -> torch.Tensor:
    """Every element that is not ours holds its block's global amax: quantizing the whole buffer
    then gives each block its global scale, and our elements their exact codes."""
    if "blocks" not in entry:
        return buf
    idx, tile = entry["blocks"]
    return torch.where(ours, buf, _bits.expand_blocks(stats[idx], tile, tuple(buf.shape)))


def _flat_payload(q, d: str, buf, ours, entry: dict, stats: list):
    amax = {d: stats[entry["amax"]]} if "amax" in entry else None
    return quantize_payloads(q.for_direction(d), _filled(buf, ours, entry, stats), (d,), amax=amax)[d]


def _flat_second_round(plan, stats: list, more: list) -> dict:
    """A columnwise payload quantized from the dequantized rowwise one: our elements' rowwise
    values are exact once the rowwise scales are global (first round), so their columnwise block
    amaxes are the second round's partial ones."""
    _, qt, buf, ours, dirs, entries, _ = plan
    q = qt.quantizer
    if "columnwise" not in dirs or not q.columnwise_from_rowwise():
        return {}
    rowwise = _flat_payload(q, "rowwise", buf, ours, entries["rowwise"], stats)
    y = q.codec("rowwise").dequantize(rowwise, qt.shape2d)
    y = torch.where(ours, y, torch.zeros((), dtype=y.dtype, device=y.device))
    return {"rowwise": rowwise, "y": y, "entry": _block_stats(q.codec("columnwise"), y, more)}


def _finish_flat(plan, stats: list, second: dict, more: list) -> None:
    _, qt, buf, ours, dirs, entries, element_range = plan
    q = qt.quantizer
    payloads = {}
    for d in dirs:
        if d == "columnwise" and second:
            payloads[d] = _flat_payload(q, d, second["y"], ours, second["entry"], more)
        elif d == "rowwise" and second:
            payloads[d] = second["rowwise"]
        else:
            payloads[d] = _flat_payload(q, d, buf, ours, entries[d], stats)
    _write(qt, payloads, element_range)


__all__ = ["FlatSlice", "quantize_master_weights"]
