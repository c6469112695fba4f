"""The explicit interface between dtq's FSDP2 gathers (dtq.distributed.gather), the module state
that decides what a gather serves (``module.gemm_state``), and the TP layout the styles set: its
refusals name what is wrong and what would work."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.testing import spawn


def _dtq_weight_in_a_plain_module(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    plain = torch.nn.Linear(32, 32, bias=False)
    plain.weight = dtq.nn.Linear(32, 32, bias=False).weight  # a HighPrecisionWeight in a module without gemm_state
    model = torch.nn.Sequential(plain)
    fully_shard(model, mesh=mesh)
    with pytest.raises(
        TypeError,
        match=r"FSDP2 gathers 0\.weight, a dtq weight held by Linear, which is not a dtq "
        r"module .* keep dtq weights in dtq modules",
    ):
        model(torch.randn(4, 32))


def test_gather_of_a_dtq_weight_outside_a_dtq_module_names_the_parameter():
    spawn(_dtq_weight_in_a_plain_module, 1, backend="gloo")


def _two_dim_mesh(rank, world):
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    lin = dtq.nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"1-D device mesh, got 2 dims; pass the TP sub-mesh \(mesh\['tp'\]\)"):
        lin.gemm_state.set_tensor_parallel({}, mesh)
    lin.gemm_state.set_tensor_parallel({}, mesh["tp"])  # the sub-mesh is what works
    assert lin.gemm_state.tp.mesh == mesh["tp"]


def test_tensor_parallel_layout_takes_a_one_dim_mesh():
    spawn(_two_dim_mesh, 1, backend="gloo")
