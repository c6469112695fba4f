"""``precompute_amax``: the global amaxes of every FSDP2-sharded high-precision dtq weight in one
all-reduce per process group, reused by the all-gathers (:mod:`dtq.distributed.gather`) until the
weight changes. ``gather_high_precision``: the opt-out, weights that FSDP2 gathers unquantized;
``resolve_quantized_gather``: which of the two a ``quantized_gather`` setting ("auto") means here;
``one_rank_gathers``: FSDP2 over one rank casting each weight into its unsharded parameter in one
pass that also takes the max|w| its GEMMs quantize with; ``kernel_gradient_packing``: FSDP2's
gradient packing by dtq's kernel."""

from __future__ import annotations

import socket
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dtq import _torch_private, kernels
from dtq._torch_private import fsdp_gather_dtype, fsdp_holds, fsdp_shard_group, gather_context
from dtq.autocast import active_recipe
from dtq.codec import DIRECTIONS
from dtq.distributed.amax import all_reduce_max, sharded_amaxes
from dtq.distributed.gather import amax_key
from dtq.distributed.world import check_launched_world
from dtq.nn.module import QuantizedModule
from dtq.tensor import QuantizedTensor
from dtq.weights import HighPrecisionWeight, local_data, local_tensor, remember_gathered_amax, unwrap

__all__ = [
    "precompute_amax",
    "gather_high_precision",
    "resolve_quantized_gather",
    "one_rank_gathers",
    "kernel_gradient_packing",
    "HighPrecisionWeight",
]

_SPANS_HOSTS: dict = {}  # a group's global ranks -> whether they run on several hosts


def resolve_quantized_gather(
    setting: bool | Literal["auto"], *, quantized_params: bool = False, group: dist.ProcessGroup | None = None
) -> bool:
    """Whether FSDP2 gathers high-precision weights quantized for a ``quantized_gather`` setting:
    True and False as given; "auto": only where the ranks of ``group`` (FSDP2's shard group; None:
    the whole job) run on more than one host. Between the GPUs of one host (and on one GPU) the
    plain gather (:func:`gather_high_precision`) has been the faster FP8 step in every run so far,
    and per-tensor FP8's compiled GEMMs then run from the graph; across hosts the quantized
    gather's halved bytes are what it is for (docs/benchmarks.md, FSDP2). Quantized parameters are
    gathered in their format whatever the setting. "auto" compares host names
    (``socket.gethostname``) over ``group`` once per process and set of ranks (a collective: every
    rank of the group calls it the first time); containers on different machines that report one
    host name read as one host (plain gathers: a slower step, the same training)."""
    if setting not in (True, False, "auto"):
        raise ValueError(f'quantized_gather={setting!r}: expected True, False or "auto"')
    if quantized_params:
        return True
    if setting != "auto":
        return bool(setting)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return False
    key = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if key not in _SPANS_HOSTS:
        hosts: list[str | None] = [None] * len(key)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _SPANS_HOSTS[key] = len(set(hosts)) > 1
    return _SPANS_HOSTS[key]


def gather_high_precision(model: torch.nn.Module) -> list[str]:
    """Make every dtq module's high-precision weight a plain parameter: FSDP2 then gathers it in its
    own dtype (``MixedPrecisionPolicy.param_dtype``) and each GEMM quantizes the gathered weight,
    as torchao does without FP8 all-gather. The GEMMs quantize the same values either way (a
    quantized gather also quantizes the shard cast to ``param_dtype``), so training is the same;
    what changes is the step: a quantized gather moves half the bytes or less but runs dtq's
    quantization in FSDP2's gather hooks, and where the network is fast (GPUs of one host on
    NVLink) the plain gather has been the faster step (docs/benchmarks.md, FSDP2). Call it before
    ``fully_shard`` (after tensor-parallel styles) and before building the optimizer: the
    parameters are new objects (tied weights stay tied). Returns the fully qualified names of the
    weights it changed."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(
            "dtq.parallel.gather_high_precision: the model is already wrapped by fully_shard, which "
            "holds its parameters; call it before fully_shard"
        )
    new: dict[int, torch.nn.Parameter] = {}  # id of a replaced parameter -> its plain successor
    changed = []
    for fqn, module in model.named_modules():
        if not isinstance(module, QuantizedModule):
            continue
        for leaf in module.weight_names():
            p = getattr(module, leaf)
            local = local_tensor(p) if isinstance(p, DTensor) else p
            if isinstance(local, QuantizedTensor):
                raise ValueError(
                    f"dtq.parallel.gather_high_precision: {f'{fqn}.{leaf}'.lstrip('.')} is a quantized "
                    f"parameter ({type(local).__name__} {list(p.shape)}), which FSDP2 gathers in its "
                    "format; only high-precision weights can be gathered unquantized (convert without "
                    "quantized_params=True)"
                )
            if not isinstance(local, HighPrecisionWeight) or id(p) in new:
                continue  # already plain, or a tied weight met before
            data = unwrap(local).detach()
            if isinstance(p, DTensor):  # a tensor-parallel shard: the same placements, plain inside
                data = DTensor.from_local(
                    data, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            new[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            changed.append(f"{fqn}.{leaf}".lstrip("."))
    for module in model.modules():  # every holder of a replaced parameter: tied weights stay tied
        for leaf, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                setattr(module, leaf, new[id(p)])
    return changed


def one_rank_gathers(model: torch.nn.Module, *, amax: bool = True) -> int:
    """Make FSDP2 gather the plain parameters it shards over one rank (one GPU, or HSDP replicas
    of one rank each) in one pass: each FP32 shard cast straight into its unsharded parameter, and,
    with ``amax``, max|w| of the cast weight taken in the same pass (dtq's kernel on a GPU) and
    kept for the per-tensor quantization of the GEMMs that read it (``dtq.weights.gathered_amax``:
    compiled GEMMs, and eager ones on the Python plan; not yet the eager C++ function), which then
    skip their own amax pass over the weight. FSDP2
    itself, over one rank, casts each shard into a new tensor and copies that into the parameter
    (torch 2.10-2.13); the bits are the same either way. Call it after ``fully_shard`` on every
    unit (``model`` and its submodules are searched); ``amax=False`` for runs that quantize no
    GEMM. Returns how many parameters it changed."""
    cast = _cast_amax if amax else _cast
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            count += _torch_private.one_rank_gathers(module, cast)
    return count


def _cast(shard: torch.Tensor, out: torch.Tensor) -> None:
    with _torch_private.unversioned_write(out):
        out.copy_(shard)


def _cast_amax(shard: torch.Tensor, out: torch.Tensor) -> None:
    """``out.copy_(shard)`` and max|out| kept for its GEMMs: dtq's one-pass kernel for fp32 into
    bf16 / fp16 on a GPU, else a copy then the reduction (``Codec.local_amax``'s value). Only
    16-bit outputs of an fp32 shard keep an amax (elsewhere the GEMM's own pass costs the same)."""
    if shard.dtype != torch.float32 or out.dtype not in (torch.bfloat16, torch.float16):
        return _cast(shard, out)
    if out.is_cuda and kernels.available(out.device) and shard.is_contiguous() and out.is_contiguous():
        amax = kernels.cast_amax(shard, out)  # (no version bump: the kernel writes out's memory)
    else:
        with _torch_private.unversioned_write(out):
            out.copy_(shard)
        amax = out.abs().amax().to(torch.float32) if out.numel() else torch.zeros((), device=out.device)
    remember_gathered_amax(out, amax)


def kernel_gradient_packing() -> None:
    """Make FSDP2 pack each unit's gradients into its reduce-scatter buffer with dtq's kernel on
    GPUs (``dtq.kernels.chunk_cat``: one launch per 64 gradients), process-wide, for every world
    size: the same bits as FSDP2's own packing (``torch._chunk_cat``, exact copies and BF16 / FP16
    to FP32 casts). FSDP2's packing costs about 0.5 ms of host time per 1.07 B decoder block on a
    GPU host (its kernel describes its grid on the host, one entry per 2 KiB of output), and over
    one rank it is one copy kernel per gradient at about half the GPU's bandwidth. Calls the kernel
    does not take (other dtypes, non-contiguous gradients, CPU tensors) run FSDP2's packing, or
    ``torch.cat`` over one rank. Call it once, before training (the trainer does)."""
    _torch_private.install_copy_in(_pack)


def _pack(grads: list[torch.Tensor], out: torch.Tensor, world_size: int) -> bool:
    return out.is_cuda and kernels.available(out.device) and kernels.chunk_cat(grads, out, world_size)


@torch.no_grad()
def precompute_amax(model: torch.nn.Module, recipe=None) -> None:
    """Reduce the global amax of every FSDP2-sharded high-precision dtq weight that needs one, in
    one all-reduce per process group. Call it after ``optimizer.step()`` (like torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``); gathers reuse the result until the weight changes.
    Weights sharded over one rank are skipped: there is nothing to reduce, and their gathers take
    the amax in the same pass that quantizes (a separate pass per weight cost ~10 ms of a
    ``llama1b_1gpu`` step on an H100). A job of one process returns at once: every group has one
    rank, and finding that out weight by weight costs Python on every step of a host-bound
    single-GPU run."""
    check_launched_world()
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
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
