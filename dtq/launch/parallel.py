"""Parallelizing the model: tensor/sequence parallelism first (on the mesh's "tp" dim), then FSDP2
``fully_shard`` on every block and on the root (on the "dp" dim, or HSDP on ("replicate", "dp");
on the root only in a one-rank job, :func:`fsdp_units`).
Mesh ranks are laid out ``(replicate, dp, tp)``: the ``tp`` ranks of one data-parallel replica are
consecutive, then the FSDP2 shards of one HSDP replica."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import dtq
from dtq import _torch_private
from dtq.launch.config import Config


def make_mesh(device: torch.device, world_size: int, tp: int, replicate: int = 1) -> DeviceMesh:
    """A ("dp",) mesh, with a leading "replicate" dim under HSDP and a trailing "tp" dim under
    tensor parallelism (size-1 dims are left out)."""
    if world_size % (tp * replicate):
        raise ValueError(
            f"config: parallel.tp * parallel.replicate = {tp} * {replicate} must divide the world size {world_size}"
        )
    dims = ([("replicate", replicate)] if replicate > 1 else []) + [("dp", world_size // (tp * replicate))]
    dims += [("tp", tp)] if tp > 1 else []
    names, sizes = zip(*dims)
    return init_device_mesh(device.type, tuple(sizes), mesh_dim_names=tuple(names))


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 runs on: every dim but "tp" (2-D ("replicate", "dp") is HSDP)."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "tp")
    return mesh if names == mesh.mesh_dim_names else mesh[names]


def describe(mesh: DeviceMesh) -> str:
    """``dp 4``, ``replicate 2 x dp 2``, ``dp 2 x tp 2``: the layout, for the progress header."""
    return " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))


def tp_plan(sequence_parallel: bool) -> dict:
    """The TP style of each GEMM module of a decoder block, by its name inside the block."""
    return {
        "attn.qkv": dtq.parallel.ColwiseParallel(sequence_parallel=sequence_parallel),
        "attn.proj": dtq.parallel.RowwiseParallel(sequence_parallel=sequence_parallel),
        "mlp": dtq.parallel.LayerNormMLPParallel(sequence_parallel=sequence_parallel),
    }


def tp_weight_dims(model: torch.nn.Module) -> dict[int, Mapping[str, int]]:
    """``{id(module): {weight name: dim TP splits}}`` for the GEMM modules ``tp_plan`` shards."""
    plan = tp_plan(False)
    return {id(block.get_submodule(name)): style.weight_dims for block in model.blocks for name, style in plan.items()}


def apply_tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh, cfg: Config) -> None:
    """dtq's TP styles on ``mesh["tp"]``: QKV column-wise, the attention output projection
    row-wise, the MLP as a column/row pair; with ``parallel.sequence_parallel`` the activations
    between them stay split along the sequence and the GEMMs gather their inputs quantized."""
    if cfg.model.kind != "dtq":
        raise ValueError(
            f'config: parallel.tp = {cfg.parallel.tp} needs model.kind = "dtq" (the transformers Llama '
            "path runs with FSDP2 only)"
        )
    tp_mesh, sp = mesh["tp"], cfg.parallel.sequence_parallel
    heads, size = cfg.model.heads, tp_mesh.size()
    if heads % size:
        raise ValueError(
            f"config: model.heads = {heads} must be divisible by parallel.tp = {size} (each rank holds "
            "whole attention heads)"
        )
    if sp and cfg.model.seq_len % size:
        raise ValueError(
            f"config: model.seq_len = {cfg.model.seq_len} must be divisible by parallel.tp = {size} under "
            "sequence parallelism (each rank holds an equal slice of the sequence)"
        )
    model.to(tp_mesh.device_type)  # TP styles split tensors that already live on the mesh's device
    for block in model.blocks:
        parallelize_module(block, tp_mesh, tp_plan(sp))
    model.sp_group = tp_mesh.get_group() if sp else None


def reshard_after_forward(setting: bool | str, shard_ranks: int) -> bool:
    """FSDP2's ``reshard_after_forward`` for the blocks. "auto": reshard only when the weights are
    sharded over more than one rank; over one, resharding frees nothing but the gathered copy,
    and backward would gather (for a quantizing recipe: quantize) every weight a second time,
    which cost 20-35 ms of a 190 ms ``llama1b_1gpu`` step on an H100 (docs/benchmarks.md)."""
    return shard_ranks > 1 if setting == "auto" else bool(setting)


def fsdp_units(setting: str, world_size: int, reshard: bool) -> str:
    """Where ``fully_shard`` goes (``parallel.fsdp_units``): "blocks" (every block and the root) or
    "root". "auto" is "root" where the whole job is one rank (``world_size``, TP included) and
    the blocks would keep their gathered weights (``reshard`` false): per-block units then overlap
    nothing (no collective runs) and free nothing, while FSDP2's hooks of each unit, its gather
    before forward and its gradient packing after backward, cost host time every step, the time
    a host-bound FP8 step is made of (docs/benchmarks.md, "One FSDP2 unit over one rank"). One
    unit keeps every block's gradients until the end of backward and packs them at once, when
    the activations are gone (``llama1b_1gpu``'s peak stayed 25.2 GiB on an H200); the bits are
    the same."""
    if setting != "auto":
        return setting
    return "root" if world_size == 1 and not reshard else "blocks"


def quantized_gather(setting: bool | str, dp_mesh: DeviceMesh, quantized_params: bool) -> bool:
    """Whether FSDP2 gathers high-precision weights quantized (``parallel.quantized_gather``), decided
    over the FSDP2 shard group (the mesh's "dp" dim): "auto" quantizes only where one weight's
    shards lie on several hosts (``dtq.parallel.resolve_quantized_gather``; every rank calls it)."""
    group = dp_mesh["dp"].get_group()
    return dtq.parallel.resolve_quantized_gather(setting, quantized_params=quantized_params, group=group)


def parallelize(
    model: torch.nn.Module, mesh: DeviceMesh, cfg: Config, recipe=None, *, gather_quantized: bool, units: str
) -> torch.nn.Module:
    """TP styles (when ``tp > 1``), then quantized parameters (``train.quantized_params``: after the
    styles, so every TP shard is the slice of the whole weight's quantization) or plain ones
    (``gather_quantized`` false: :func:`quantized_gather`'s decision), then FSDP2 per block and on
    the root (``units`` "blocks") or on the root only ("root": :func:`fsdp_units`). Parameters are
    kept in their dtype; ``train.dtype = "bfloat16"`` makes FSDP2 gather and compute in BF16 with
    FP32 gradient reduction."""
    if cfg.parallel.tp > 1:
        apply_tensor_parallel(model, mesh, cfg)
    if cfg.train.quantized_params:
        dtq.convert(model, recipe=recipe, quantized_params=True, module_filter_fn=lambda m, fqn: False)
    elif not gather_quantized:
        dtq.parallel.gather_high_precision(model)
    if cfg.train.compile:
        for block in model.blocks:  # in place: parameter names and FSDP2's per-block units stay as they are
            block.compile()
    dp = data_parallel_mesh(mesh)
    mp = None
    if cfg.train.dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mesh": dp} | ({"mp_policy": mp} if mp is not None else {})
    reshard = reshard_after_forward(cfg.parallel.reshard_after_forward, dp["dp"].size())
    if units not in ("blocks", "root"):
        raise ValueError(f'parallelize: units = {units!r}; "blocks" or "root" (fsdp_units decides "auto")')
    blocks = [*model.blocks] if units == "blocks" else []
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    dtq.parallel.kernel_gradient_packing()  # (the same bits as FSDP2's packing, less host and GPU time)
    if dp["dp"].size() == 1:  # FSDP2 over one rank would copy every packed gradient once more
        for unit in [*blocks, model]:
            unit.set_custom_reduce_scatter(_torch_private.one_rank_reduce_scatter())
        # and cast every weight twice (into a new tensor, then into the parameter) where one pass,
        # taking the max|w| its GEMMs quantize with, does
        dtq.parallel.one_rank_gathers(model, amax=recipe is not None)
    return model
