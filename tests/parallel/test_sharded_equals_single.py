"""Sharded equals single (the project's invariant): with the same data on every rank, FSDP2 (and
HSDP) training is bitwise the single-process run. Every recipe, both parameter modes,
``reshard_after_forward`` True / False, with and without ``precompute_amax``, ``fully_shard`` per
Linear and per block, activation recompute on and off; and weights gathered unquantized
(``dtq.parallel.gather_high_precision``). Losses, final parameters (payload bits for
quantized ones) and delayed-scaling histories are compared bit for bit.

Why it can be bitwise: every rank computes the whole batch, so each rank's weight gradient is the
single process's; FSDP2 averages two (or 2 x 2) equal fp32 values, which is exact; the gathered
payloads are the quantization of the whole weight (global amaxes are MAX-reduced, which is
exact); AdamW is elementwise.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import dtq
from dtq import kernels
from dtq.testing import spawn
from tests._recipe_matrix import RECIPES

# 256: a 2-way shard of a weight keeps whole 128x128 FP8 blocks; 32 tokens: whole MXFP8 (32) and
# NVFP4 (16) column blocks.
HIDDEN, TOKENS, STEPS = 256, 32, 5


class Block(torch.nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.fc1 = dtq.nn.Linear(HIDDEN, HIDDEN, bias=False, name=f"{name}.fc1")
        self.fc2 = dtq.nn.Linear(HIDDEN, HIDDEN, name=f"{name}.fc2")
        self.recompute = False

    def _inner(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    def forward(self, x):
        return checkpoint(self._inner, x, use_reentrant=False) if self.recompute else self._inner(x)


def _model(recipe, quantized_params: bool, recompute: bool, device: str = "cpu") -> torch.nn.Sequential:
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(Block("0"), Block("1"))
    for b in model:
        b.recompute = recompute
    if recipe.delayed:
        dtq.convert(model, recipe=recipe)  # histories exist from the start (and are compared at the end)
    if quantized_params:
        dtq.convert(model, recipe=recipe, quantized_params=True)
    return model


def _data(device: str):
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    xs = [torch.randn(TOKENS, HIDDEN, generator=g) * (1 + step) for step in range(STEPS)]  # growing amaxes
    return [x.to(device) for x in xs], [torch.tanh(x @ teacher).to(device) for x in xs]


def _train(model, recipe, quantized_params: bool, precompute: bool):
    if quantized_params:
        opt = dtq.optim.MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xs, ts = _data(next(model.parameters()).device.type)
    losses = []
    for x, t in zip(xs, ts):
        with dtq.autocast(recipe):
            loss = torch.nn.functional.mse_loss(model(x), t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if precompute:
            dtq.parallel.precompute_amax(model)
        losses.append(loss.detach().clone())
    return torch.stack(losses)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _add_bits(out: dict, name: str, t: torch.Tensor) -> None:
    """``t`` as bits under ``name`` (a QuantizedTensor: each payload field, tensor-wide ones whole)."""
    if isinstance(t, dtq.QuantizedTensor):
        for d in t.directions:
            for k, v in t.payload(d).items():
                out[f"{name}.{d}.{k}"] = _bits(v)
    else:
        out[name] = _bits(t.__dtq_unwrap__() if hasattr(t, "__dtq_unwrap__") else t)


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a sharded run as bits: this rank's rows of sharded ones."""
    out = {}
    for name, p in itertools.chain(model.named_parameters(), model.named_buffers()):
        _add_bits(out, name, p._local_tensor if isinstance(p, DTensor) else p)
    return out


def _reference_rows(ref: torch.nn.Module, rows_of: dict) -> dict[str, torch.Tensor]:
    """The reference's parameters and buffers as bits, cut to the rows a sharded rank holds
    (``rows_of``: name -> (start, end) of dim 0)."""
    out = {}
    for name, p in itertools.chain(ref.named_parameters(), ref.named_buffers()):
        if name in rows_of:
            start, end = rows_of[name]
            p = p[start:end]
        _add_bits(out, name, p)
    return out


def _shard(model, mesh, unit: str, raf: bool):
    for block in model:
        if unit == "linear":
            fully_shard(block.fc1, mesh=mesh, reshard_after_forward=raf)
            fully_shard(block.fc2, mesh=mesh, reshard_after_forward=raf)
        else:
            fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf)


def _compare(recipe_name: str, config, losses, ref_losses, model, ref) -> None:
    assert torch.equal(_bits(losses), _bits(ref_losses)), (recipe_name, config, losses.tolist(), ref_losses.tolist())
    rows_of = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            local = p._local_tensor
            n = local.shape[0]
            start = p.device_mesh.get_local_rank(p.device_mesh.ndim - 1) * -(-p.shape[0] // p.device_mesh.size(-1))
            rows_of[name] = (start, start + n)
    want = _reference_rows(ref, rows_of)
    got = _state(model)
    for key in want:
        assert key in got, (recipe_name, config, key, sorted(got))
    differ = {k: _ulps(got[k], want[k]) for k in want if not torch.equal(got[k], want[k])}
    assert not differ, (recipe_name, config, "bits that differ (count, largest distance in ulps):", differ)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """How many elements of two same-dtype bit views differ, and by how many units in the last
    place at most (integer distance of the bit patterns: meaningful for same-sign floats)."""
    ne = a != b
    return int(ne.sum()), int((a.long() - b.long()).abs().max())


def _check_fsdp_matrix(rank, world, recipe_names, device="cpu"):
    """Every configuration of each recipe in one spawn (the ranks' start-up is a large share of a
    small run). A configuration whose bits differ is recorded and the matrix goes on (the
    comparison runs after the configuration's collectives, so the ranks stay in step); all of
    them are reported at the end."""
    mesh = init_device_mesh(device, (world,))
    failed = []
    for recipe_name in recipe_names:
        recipe = RECIPES[recipe_name]()
        refs = {}
        for qp in (False, True):
            ref = _model(recipe, qp, recompute=False, device=device)
            refs[qp] = (_train(ref, recipe, qp, precompute=False), ref)
        for qp, raf, precompute, unit, recompute in itertools.product(
            (False, True), (True, False), (False, True), ("linear", "block"), (False, True)
        ):
            if qp and precompute:
                continue  # precompute_amax concerns high-precision shards only
            config = dict(
                quantized_params=qp,
                reshard_after_forward=raf,
                precompute_amax=precompute,
                unit=unit,
                recompute=recompute,
            )
            model = _model(recipe, qp, recompute, device=device)
            _shard(model, mesh, unit, raf)
            losses = _train(model, recipe, qp, precompute)
            try:
                _compare(recipe_name, config, losses, refs[qp][0], model, refs[qp][1])
            except AssertionError as e:
                failed.append(str(e))
    assert not failed, f"{len(failed)} configurations differ:\n" + "\n".join(failed)


def test_fsdp2_equals_single_process():
    spawn(_check_fsdp_matrix, 2, list(RECIPES), backend="gloo")


def test_adamw_runs_the_same_kernels_for_dtq_weights_as_for_their_fsdp2_shards(monkeypatch):
    """On a GPU, AdamW's default runs its multi-tensor kernels for FSDP2's DTensor parameters. It
    must for a single process's dtq weights too: its per-tensor loop rounds the update differently
    (on two H200s every NCCL case below differed in the last bits after the first step). A CPU has
    no multi-tensor default, so torch's device check here counts the CPU as one that has."""
    from torch.optim import adam, optimizer

    monkeypatch.setattr(optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    ran = []
    for name in ("_single_tensor_adam", "_multi_tensor_adam"):
        real = getattr(adam, name)
        monkeypatch.setattr(adam, name, lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k))
    torch.manual_seed(0)
    plain = torch.nn.Linear(16, 8)
    ours = dtq.nn.Linear(16, 8, name="fc")
    assert type(ours.weight) is not torch.nn.Parameter  # (a subclass: what torch's check used to refuse)
    with torch.no_grad():
        ours.weight.copy_(plain.weight)
        ours.bias.copy_(plain.bias)
    x = torch.randn(4, 16)
    for layer in (plain, ours):
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        with dtq.autocast(enabled=False):  # (high precision: the update is what is compared)
            layer(x).square().sum().backward()
        opt.step()
    assert ran == ["_multi_tensor_adam", "_multi_tensor_adam"], ran
    for a, b in ((plain.weight, ours.weight), (plain.bias, ours.bias)):
        assert torch.equal(_bits(a.detach()), _bits(dtq.weights.unwrap(b.detach())))


# The same on GPUs with NCCL: dtq's CUDA kernels and native GEMMs, and for FP8 per-tensor calls on
# plain weights the kernel library's C++ autograd function (dtq.nn.linear_native).
needs_gpu = pytest.mark.skipif(not kernels.available(), reason="needs a GPU with dtq's CUDA kernels")
needs_gpus = pytest.mark.skipif(
    not kernels.available() or torch.cuda.device_count() < 2, reason="needs two GPUs with dtq's CUDA kernels"
)


@needs_gpus
def test_fsdp2_equals_single_process_nccl():
    spawn(_check_fsdp_matrix, 2, ["fp8", "fp8_block", "hybrid_mxfp8_nvfp4"], "cuda", backend="nccl")


def _check_hsdp(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for recipe_name, factory in RECIPES.items():
        recipe = factory()
        for qp in (False, True):
            ref = _model(recipe, qp, recompute=False)
            ref_losses = _train(ref, recipe, qp, precompute=False)
            model = _model(recipe, qp, recompute=False)
            _shard(model, mesh, "block", True)
            losses = _train(model, recipe, qp, precompute=not qp)
            _compare(recipe_name, dict(hsdp="2x2", quantized_params=qp), losses, ref_losses, model, ref)


def test_hsdp_2x2_equals_single_process():
    spawn(_check_hsdp, 4, backend="gloo")


def _check_one_rank(rank, world, device="cpu"):
    """FSDP2 over one rank (the trainer on one GPU): its gathers take the single-rank shortcut,
    where one payload field travels as it is and several are packed into one input, and whose
    amaxes the quantize pass takes (recipes with one field per direction, several, a hybrid)."""
    mesh = init_device_mesh(device, (world,))
    for recipe_name in ("fp8", "mxfp8", "hybrid_mxfp8_nvfp4"):
        recipe = RECIPES[recipe_name]()
        for qp in (False, True):
            ref = _model(recipe, qp, recompute=False, device=device)
            ref_losses = _train(ref, recipe, qp, precompute=False)
            for raf in (True, False):
                model = _model(recipe, qp, recompute=False, device=device)
                _shard(model, mesh, "block", raf)
                losses = _train(model, recipe, qp, precompute=not qp)
                _compare(recipe_name, dict(world=1, quantized_params=qp, raf=raf), losses, ref_losses, model, ref)


def test_fsdp2_on_one_rank_equals_single_process():
    spawn(_check_one_rank, 1, backend="gloo")


@needs_gpu
def test_fsdp2_on_one_gpu_equals_single_process():
    spawn(_check_one_rank, 1, "cuda", backend="nccl")


def _check_high_precision_gather(rank, world, device="cpu"):
    """Weights FSDP2 gathers unquantized (``gather_high_precision``), each GEMM quantizing the whole
    gathered weight: the single process with dtq's own weights, every recipe."""
    from dtq.nn import linear_native

    mesh = init_device_mesh(device, (world,))
    native, run = [], linear_native.run

    def counted(plan, x, *args):  # whether each eager call ran the C++ function
        y = run(plan, x, *args)
        native.append((x.requires_grad, y is not None))
        return y

    linear_native.run = counted
    for recipe_name, factory in RECIPES.items():
        recipe = factory()
        native.clear()
        ref = _model(recipe, False, recompute=False, device=device)
        ref_losses = _train(ref, recipe, False, precompute=False)
        for raf, recompute in ((True, False), (False, True)):
            model = _model(recipe, False, recompute, device=device)
            changed = dtq.parallel.gather_high_precision(model)
            assert changed == [f"{b}.{fc}.weight" for b in "01" for fc in ("fc1", "fc2")]
            _shard(model, mesh, "block", raf)
            assert not any(isinstance(p._local_tensor, dtq.parallel.HighPrecisionWeight) for p in model.parameters())
            losses = _train(model, recipe, False, precompute=True)  # (nothing to precompute: a no-op)
            config = dict(gather="high precision", reshard_after_forward=raf, recompute=recompute)
            _compare(recipe_name, config, losses, ref_losses, model, ref)
        if recipe_name == "fp8":
            # On a GPU every call runs it, the reference's and the sharded runs', but the first
            # layer's: its input (the data) needs no gradient, a plan without dgrad that the C++
            # function declines (dtq.nn.linear_native.native_id). On a CPU none runs it.
            assert any(needs_dgrad for needs_dgrad, _ in native), native
            if device == "cuda":
                assert all(ran for needs_dgrad, ran in native if needs_dgrad), native
            else:
                assert not any(ran for _, ran in native), native


def test_high_precision_gather_equals_single_process():
    spawn(_check_high_precision_gather, 2, backend="gloo")


@needs_gpus
def test_high_precision_gather_equals_single_process_nccl():
    """The trainer's default on one host: plain gathers, each FP8 GEMM through the C++ function."""
    spawn(_check_high_precision_gather, 2, "cuda", backend="nccl")
