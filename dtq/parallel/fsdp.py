"""``precompute_amax``: the global amaxes of every FSDP2-sharded high-precision dtq weight in one
all-reduce per process group, reused by the all-gathers (:mod:`dtq.distributed.gather`) until the
weight changes."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from dtq._torch_private import fsdp_gather_dtype, fsdp_holds, fsdp_shard_group, gather_context
from dtq.autocast import active_recipe
from dtq.codec import DIRECTIONS
from dtq.distributed.amax import all_reduce_max, sharded_amaxes
from dtq.distributed.gather import amax_key
from dtq.distributed.world import check_launched_world
from dtq.nn.module import QuantizedModule
from dtq.weights import HighPrecisionWeight, local_data, local_tensor

__all__ = ["precompute_amax", "HighPrecisionWeight"]


@torch.no_grad()
def precompute_amax(model: torch.nn.Module, recipe=None) -> None:
    """Reduce the global amax of every FSDP2-sharded high-precision dtq weight that needs one, in
    one all-reduce per process group. Call it after ``optimizer.step()`` (like torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``); gathers reuse the result until the weight changes.
    Weights sharded over one rank are skipped: there is nothing to reduce, and their gathers take
    the amax in the same pass that quantizes (a separate pass per weight cost ~10 ms of a
    ``llama1b_1gpu`` step on an H100)."""
    check_launched_world()
    groups: dict = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, QuantizedModule):
            continue
        state = module.gemm_state
        rec = recipe or active_recipe() or state.recipe or state.default_recipe
        if rec is None or state.high_precision is not None:  # (gathered in high precision)
            continue
        for leaf in module.weight_names():
            p = getattr(module, leaf)
            local = local_tensor(p) if isinstance(p, DTensor) else None
            if not isinstance(local, HighPrecisionWeight) or not fsdp_holds(local):
                continue  # not FSDP2-sharded (a tensor-parallel weight alone is quantized in its GEMM)
            q = module.weight_quantizer(leaf, rec)
            if q is None:
                continue
            ctx = gather_context(local)
            pg = fsdp_shard_group(ctx.fsdp_param)
            if pg.size() == 1:
                continue  # nothing to reduce: the gather takes the amax in its quantize pass
            dtype = fsdp_gather_dtype(ctx.fsdp_param) or local.dtype  # what fsdp_pre_all_gather casts to
            data = local_data(local)
            x = data if _amax_commutes_with_cast(q) else data.to(dtype)
            try:
                amax = q.local_amax(x)
                if x.dtype != dtype:  # max|cast(x)| = cast(max|x|): rounding is monotone and symmetric
                    amax = {d: a.to(dtype).to(a.dtype) for d, a in amax.items()}
            except ValueError as e:
                name = f"{fqn}.{leaf}".lstrip(".")
                raise ValueError(
                    f"dtq.parallel.precompute_amax: cannot take the amax of {name} (this rank's FSDP2 "
                    f"shard {list(local.shape)} of {list(p.shape)}) for {q.format_name}: {e} Keep the "
                    f"layer out of dtq.convert (dtq.convert(model, recipe=..., fsdp_world=...) skips and "
                    f"reports layers a recipe cannot shard)"
                ) from e
            if amax:
                groups.setdefault(pg, []).append((local, data, q, dtype, x, amax))
    for pg, items in groups.items():
        reduced = sharded_amaxes(
            [(q, x, True, True) for _, _, q, _, x, _ in items],
            lambda ts: all_reduce_max(ts, pg),  # noqa: B023 - called before the loop moves on
            [amax for *_, amax in items],
        )
        for (local, data, q, dtype, _, _), amax in zip(items, reduced):
            local.remember_amax(amax_key(local, data, q, dtype), amax)


def _amax_commutes_with_cast(q) -> bool:
    """Whether every amax ``q`` takes is the tensor-wide ``max|x|`` (``Codec.amax_is_tensor_max``) and none
    is deferred: then the amax of the weight cast to the gather's dtype is the cast of its amax,
    and the cast of the whole shard (a copy of every weight per step) can be skipped. Formats that
    take their amax another way (per column, after a transform, from another direction) keep it."""
    codecs = [q.codec(d) for d in DIRECTIONS]
    return not q.deferred_amax() and all(c.amax_is_tensor_max() for c in codecs if c.needs_amax())
