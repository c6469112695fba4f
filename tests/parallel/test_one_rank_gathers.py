"""``dtq.parallel.one_rank_gathers``: FSDP2 over one rank (the trainer on one GPU) casts each FP32
shard straight into its BF16 unsharded parameter and keeps max|w| for the per-tensor GEMMs that
quantize it. Training is bitwise FSDP2's own one-rank path, for every recipe, eager and compiled,
resharding after forward or not; per-tensor FP8 GEMMs take the kept amax; a write into the
gathered weight makes them take their own again."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dtq
from dtq import kernels
from dtq.nn import _ops, linear_native, linear_plan
from dtq.testing import spawn
from dtq.weights import gathered_amax, remember_gathered_amax
from tests._recipe_matrix import RECIPES

HIDDEN, TOKENS, STEPS = 64, 32, 3
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Block(torch.nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.fc1 = dtq.nn.Linear(HIDDEN, 2 * HIDDEN, bias=False, name=f"{name}.fc1")
        self.fc2 = dtq.nn.Linear(2 * HIDDEN, HIDDEN, bias=False, name=f"{name}.fc2")

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _model(fused: bool, raf: bool, compiled: bool, device: str) -> torch.nn.Sequential:
    torch.manual_seed(0)
    torch._dynamo.reset()  # (each model compiles afresh: no recompile limit across the matrix)
    with torch.device(device):
        model = torch.nn.Sequential(Block("0"), Block("1"))
    dtq.parallel.gather_high_precision(model)  # plain weights, as the trainer gathers them on one host
    mesh = init_device_mesh(device, (1,))
    for block in model:
        if compiled:  # (on a GPU as the trainer compiles: inductor runs the FP8 GEMMs in the graph,
            # its weights quantized by dtq::planned_weight)
            block.compile(backend="inductor" if device == "cuda" else "aot_eager", fullgraph=True)
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=BF16)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=BF16)
    if fused:
        assert dtq.parallel.one_rank_gathers(model) == 4  # every weight: fc1 and fc2 of both blocks
    return model


def _train(model, recipe, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(STEPS):
        x = (torch.randn(TOKENS, HIDDEN, generator=g) * (1 + step)).to(device)
        with dtq.autocast(recipe):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.detach().reshape(1))
    out += [p.detach().to_local().reshape(-1) for p in model.parameters()]
    return out


def _bits(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int32) for t in ts]


def _check_bits(rank, world, device="cpu"):
    """Every recipe (and those whose weights scale from max|w| also compiled, and without
    resharding after forward): the fused one-rank gather trains bit for bit as FSDP2's own;
    per-tensor FP8 GEMMs took every weight's kept amax."""
    taken, launched = [], []
    spied = {linear_plan: linear_plan.gathered_amax, _ops: _ops.gathered_amax}
    for module, real in spied.items():
        module.gathered_amax = lambda w, _real=real: taken.append(a := _real(w)) or a
    payloads = linear_native.payloads

    def spy(plan, which, t, known=None):  # the compiled weight quantizations: which ran the launch
        out = payloads(plan, which, t, known)
        if which == linear_native.WEIGHT:
            launched.append((type(t).__name__, known is not None, out is not None))
        return out

    linear_native.payloads = spy
    try:
        for recipe_name, factory in RECIPES.items():
            # the cast is the same for every recipe; the kept amax matters where a weight direction
            # scales from max|w| (per-tensor FP8, NVFP4's tensor scale, the custom hybrid's rows)
            takes_amax = recipe_name in ("fp8", "nvfp4", "custom")
            for raf, compiled in ((True, False), (False, False), (False, True))[: 3 if takes_amax else 1]:
                recipe = factory()
                want = _train(_model(False, raf, compiled, device), recipe, device)
                taken.clear()
                launched.clear()
                got = _train(_model(True, raf, compiled, device), recipe, device)
                config = (recipe_name, dict(reshard_after_forward=raf, compiled=compiled))
                for i, (a, b) in enumerate(zip(_bits(got), _bits(want), strict=True)):
                    assert torch.equal(a, b), (*config, "losses" if i < STEPS else "parameters", i)
                if recipe_name == "fp8" and (device == "cpu" or compiled):
                    # every forward GEMM of every step (the compiled one too: dtq::planned_weight);
                    # not a backward override (the general path), nor on a GPU eagerly (the C++
                    # function, which takes its own amax)
                    found = [a is not None for a in taken]
                    assert found and all(found), (*config, found)
                if recipe_name == "fp8" and device == "cuda" and compiled:
                    # FSDP2's unsharded weight (an nn.Parameter) quantized by the kernel library's
                    # one launch, given the kept amax (not the Python plan's launches)
                    assert launched and all(r == ("Parameter", True, True) for r in launched), (*config, launched)
    finally:
        linear_native.payloads = payloads
        for module, real in spied.items():
            module.gathered_amax = real


def test_one_rank_gathers_keep_fsdp2s_bits():
    spawn(_check_bits, 1, backend="gloo")


@pytest.mark.skipif(not kernels.available(), reason="needs a GPU with dtq's CUDA kernels")
def test_one_rank_gathers_keep_fsdp2s_bits_on_one_gpu():
    spawn(_check_bits, 1, "cuda", backend="nccl")


def _check_write_after_gather(rank, world):
    """A write into the gathered weight between its gather and its GEMM (an in-place op: the
    version counter moves) drops the kept amax: the GEMM quantizes what the weight holds then,
    bit for bit as FSDP2's own path does."""
    recipe = dtq.Float8CurrentScaling()
    outs = []
    for fused in (False, True):
        model = _model(fused, True, False, "cpu")
        fc1 = model[0].fc1

        def grow(module, args):
            with torch.no_grad():
                module.weight.mul_(4)  # max|w| grows: a stale amax would clip the codes

        fc1.register_forward_pre_hook(grow)
        with dtq.autocast(recipe):
            y = model(torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5)))
        if fused:
            w = fc1.weight
            assert gathered_amax(w) is None, "a weight written after its gather kept the gather's amax"
        outs.append(y.detach())
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_a_write_into_the_gathered_weight_drops_its_amax():
    spawn(_check_write_after_gather, 1, backend="gloo")


def test_gathered_amax_is_kept_for_that_memory_and_version_only():
    t = torch.randn(8, 4).to(torch.bfloat16)
    amax = t.abs().amax().float()
    remember_gathered_amax(t, amax)
    assert gathered_amax(t) is amax
    assert gathered_amax(t.view(4, 8)) is amax  # a contiguous view of all of it
    assert gathered_amax(t[:4]) is None and gathered_amax(t.t()) is None  # part of it, or strided
    assert gathered_amax(t.clone()) is None  # other memory
    t.add_(1)
    assert gathered_amax(t) is None  # written since
    remember_gathered_amax(t, t.abs().amax().float())
    t.data = torch.zeros_like(t)  # the memory moved (as FSDP2's refills may)
    assert gathered_amax(t) is None
    zero = torch.zeros(())
    remember_gathered_amax(t, zero)
    assert gathered_amax(t) is zero


def test_kept_amaxes_of_moved_or_freed_memory_are_pruned(monkeypatch):
    monkeypatch.setattr(dtq.weights, "_GATHERED", {})
    monkeypatch.setattr(dtq.weights, "_PRUNE_AT", [1])
    t = torch.ones(4, dtype=torch.bfloat16)
    remember_gathered_amax(t, torch.ones(()))
    moved = t.data_ptr()
    t.data = torch.ones(4, dtype=torch.bfloat16)
    remember_gathered_amax(t, torch.ones(()))  # two entries: the one of moved memory goes
    assert list(dtq.weights._GATHERED) == [t.data_ptr()] and moved != t.data_ptr()
