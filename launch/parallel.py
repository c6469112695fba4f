"""Parallelizing the model: tensor/sequence parallelism first (on the mesh's "tp" dim), then FSDP2
``fully_shard`` on every block and on the root (on the "dp" dim)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from launch.config import Config


def make_mesh(device: torch.device, world_size: int, tp: int) -> DeviceMesh:
    """A ("dp",) mesh, or ("dp", "tp") when tensor parallelism is on."""
    if world_size % tp:
        raise ValueError(f"config: parallel.tp = {tp} must divide the world size {world_size}")
    if tp == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def apply_tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh, cfg: Config) -> None:
    """The seam for dtq's DTensor parallel styles on ``mesh["tp"]`` (column-wise QKV / fc1,
    row-wise proj / fc2, sequence-parallel norms with quantized input gathers), applied before
    FSDP2 shards the result over ``mesh["dp"]``. Those styles are not in dtq yet."""
    raise NotImplementedError(
        f"config: parallel.tp = {cfg.parallel.tp}: tensor/sequence parallelism needs dtq's DTensor parallel styles "
        "for dtq modules, which do not exist yet (torch's ColwiseParallel/RowwiseParallel refuse dtq modules); "
        "set parallel.tp = 1 and scale out with FSDP2 ranks")


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, cfg: Config) -> torch.nn.Module:
    """TP styles (when ``tp > 1``), then FSDP2 per block and on the root. Parameters are kept in
    their dtype; ``train.dtype = "bfloat16"`` makes FSDP2 gather and compute in BF16 with FP32
    gradient reduction."""
    if cfg.parallel.tp > 1:
        apply_tensor_parallel(model, mesh, cfg)
    dp = mesh["dp"] if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names else mesh
    mp = None
    if cfg.train.dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mesh": dp} | ({"mp_policy": mp} if mp is not None else {})
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=cfg.parallel.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model
