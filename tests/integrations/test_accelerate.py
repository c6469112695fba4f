"""dtq.integrations.accelerate, on CPU (2 gloo ranks, and one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtq
from dtq.testing import spawn

H = 64


def _data(n=32, out=H):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, H, generator=g), torch.randn(n, out, generator=g)


# Accelerate 1.15 shards with FSDP2 only on accelerators (AcceleratorState sets DistributedType.FSDP
# for GPU-like backends): on CPU its multi-process mode is DDP, which these tests train under.


def _check_accelerate(rank, world):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from dtq.integrations import accelerate as dtq_accelerate

    accelerator = Accelerator(cpu=True)  # finds the process group dtq.testing.spawn started
    assert accelerator.num_processes == world and accelerator.distributed_type == DistributedType.MULTI_CPU
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.ReLU(), torch.nn.Linear(2 * H, 100))
    model = dtq_accelerate.convert(accelerator, model, "mxfp8", quantized_gather=True)  # the weight wrapper under DDP
    assert isinstance(model[0], dtq.nn.Linear) and type(model[2]) is torch.nn.Linear  # 100 rows: no MX blocks
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = dtq_accelerate.prepare(accelerator, model, optimizer)
    x, y = _data(n=64, out=100)
    x, y = x[rank::world], y[rank::world]  # each rank its own half of the batch (32 rows: whole MX blocks)
    losses = []
    for _ in range(3):  # no dtq.autocast: convert bound the recipe
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    inner = accelerator.unwrap_model(model)
    assert inner[0].gemm_state.recipe == dtq.MXFP8BlockScaling() and losses[2] < losses[0], losses
    # DDP averaged the gradients of the quantized GEMMs: every rank holds the same weights
    w = inner[0].weight.detach().clone()
    ws = [torch.empty_like(w) for _ in range(world)]
    torch.distributed.all_gather(ws, w)
    assert all(torch.equal(ws[0], v) for v in ws[1:])


def test_accelerate_trains_on_two_ranks():
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    spawn(_check_accelerate, 2, backend="gloo")


def test_accelerate_refuses_plain_optimizers_and_its_own_fp8():
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from dtq.integrations import accelerate as dtq_accelerate

    try:
        accelerator = Accelerator(cpu=True)
        plain = dtq_accelerate.convert(accelerator, torch.nn.Linear(H, H), "mxfp8", quantized_gather=False)
        assert type(plain.weight) is torch.nn.Parameter  # gathered unquantized by FSDP2
        # "auto" (the default): unquantized gathers within one host (one process here)
        assert type(dtq_accelerate.convert(accelerator, torch.nn.Linear(H, H), "mxfp8").weight) is torch.nn.Parameter
        kept = dtq_accelerate.convert(accelerator, torch.nn.Linear(H, H), "mxfp8", quantized_gather=True)
        assert isinstance(kept.weight, dtq.parallel.HighPrecisionWeight)  # gathered quantized
        with pytest.raises(ValueError, match="quantized_gather=False needs quantized_params=False"):
            dtq_accelerate.convert(
                accelerator, torch.nn.Linear(H, H), "mxfp8", quantized_params=True, quantized_gather=False
            )
        qmodel = dtq_accelerate.convert(accelerator, torch.nn.Linear(H, H), "mxfp8", quantized_params=True)
        with pytest.raises(ValueError, match=r"weight \(and 0 more\) are quantized parameters, stepped by SGD"):
            dtq_accelerate.prepare(accelerator, qmodel, torch.optim.SGD(qmodel.parameters(), lr=0.1))
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True, mixed_precision="fp8")  # torchao's FP8 (installed with the tests)
        with pytest.raises(ValueError, match="mixed_precision='fp8'"):
            dtq_accelerate.convert(accelerator, torch.nn.Linear(H, H), "mxfp8")
    finally:
        AcceleratorState._reset_state(True)


def _check_fsdp2_ram_efficient_loading(rank, world):
    import os

    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from dtq.integrations import accelerate as dtq_accelerate

    os.environ["ACCELERATE_USE_FSDP"] = "true"
    torch.cuda.set_device(rank)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
    accelerator = Accelerator(fsdp_plugin=plugin)
    assert accelerator.distributed_type == DistributedType.FSDP
    torch.manual_seed(0)
    model = dtq_accelerate.convert(
        accelerator,
        torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(), torch.nn.Linear(2 * H, H)),
        "fp8",
        quantized_gather=True,  # (as the run that found the failure gathered)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="cpu_ram_efficient_loading is turned off"):
        model, optimizer = dtq_accelerate.prepare(accelerator, model, optimizer)
    assert not accelerator.state.fsdp_plugin.cpu_ram_efficient_loading
    x, _ = _data()
    with torch.no_grad():
        assert torch.isfinite(model(x.to(accelerator.device))).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Accelerate shards with FSDP2 on CUDA devices only")
def test_fsdp2_cpu_ram_efficient_loading_is_turned_off_for_dtq_models():
    """Accelerate's FSDP2 memory-saving load broadcasts every state-dict entry as a DTensor; it failed
    on a dtq module's ``_extra_state`` ("'dict' object has no attribute 'device_mesh'", seen on an
    H100). ``prepare`` turns it off, said once."""
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    spawn(_check_fsdp2_ram_efficient_loading, 1, backend="nccl")
