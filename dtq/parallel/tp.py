"""Sequence-parallel gathers of activations and gradients in quantized form."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtq.formats import COLUMNWISE, ROWWISE, Quantizer, codec_for
from dtq.formats.base import quantize_payloads, shape_2d
from dtq.parallel import comm
from dtq.tensor import QuantizedTensor


def _all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    flat = t.contiguous().view(torch.uint8)  # any dtype travels as bytes (gloo has no float8)
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat, group=group)
    return torch.cat(out).view(t.dtype)


def gather_along_first_dim(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                           quantizer: Quantizer | None = None, *, rowwise: bool = True,
                           columnwise: bool = False) -> torch.Tensor:
    """All-gather a sequence-parallel shard ``x`` (dim 0 split across ``group``).

    With a ``quantizer``, the result is the ``QuantizedTensor`` of the whole tensor holding the
    requested directions, bitwise ``quantizer.quantize(whole)``: per-tensor amaxes are reduced over
    the group first (one all-reduce), then each rank's payload rows are gathered. When those
    payloads would outweigh the high-precision tensor (both directions of an 8-bit format, say),
    the high-precision shard is gathered instead and quantized locally: the same bits, fewer
    bytes. Without a quantizer it is a plain all-gather (counted as a high-precision gather)."""
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    hp_bytes = x.numel() * x.element_size() * world
    if quantizer is None:
        comm.record_fallback(x.dtype, hp_bytes, "a sequence-parallel gather", "no quantizer was given")
        return _all_gather_rows(x, group)
    dirs = tuple(d for d, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on)
    local_rows = shape_2d(x.shape)[0]
    for d in dirs:
        need = quantizer.block_rows(d)
        if local_rows % need:
            raise ValueError(f"gather_along_first_dim: each rank holds {local_rows} rows of a tensor of shape "
                             f"{list(x.shape)}, but {quantizer.for_direction(d).format_name} {d} blocks span {need} "
                             f"rows; use a sequence length per rank that is a multiple of {need}")
    amax = quantizer.local_amax(x, rowwise=rowwise, columnwise=columnwise)
    if amax and world > 1:
        stacked = torch.stack([amax[d] for d in amax])
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
        amax = dict(zip(amax, stacked.unbind(0)))
    payloads = quantize_payloads(quantizer, x, dirs, amax=amax or None)
    aliases = quantizer.aliases(dirs)
    moved = {d: payloads[d] for d in dirs if d not in aliases}
    q_bytes = 0
    for d, p in moved.items():
        sub = quantizer.for_direction(d)
        fields = codec_for(sub).fields(sub, d)
        q_bytes += sum(v.numel() * v.element_size() * world for k, v in p.items() if fields[k] is not None)
    full_shape = (x.shape[0] * world, *x.shape[1:])
    if q_bytes > hp_bytes:  # the cheaper correct representation
        comm.record(f"{x.dtype}".replace("torch.", ""), "high_precision", hp_bytes)
        whole = _all_gather_rows(x, group)
        return quantizer.quantize(whole, rowwise=rowwise, columnwise=columnwise, amax=amax or None)
    gathered: dict = {}
    for d in dirs:
        if d in aliases:
            gathered[d] = dict(gathered[aliases[d]])
            continue
        sub = quantizer.for_direction(d)
        fields = codec_for(sub).fields(sub, d)
        gathered[d] = {k: (_all_gather_rows(v, group) if fields[k] is not None else v) for k, v in payloads[d].items()}
        comm.record(sub.format_name, d, sum(v.numel() * v.element_size() * world
                                             for k, v in payloads[d].items() if fields[k] is not None))
    return QuantizedTensor(full_shape, x.dtype, quantizer, gathered)
