"""Checkpoints hold codes, not values (docs/design.md §5.6): torch.distributed.checkpoint saves payloads,
loads them bit for bit (also resharded), resumes training bitwise, and refuses mismatches."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtq
from dtq.testing import spawn

H, F, T = 128, 256, 32


def _recipe(name: str = "hybrid"):
    if name == "fp8_row":  # per-column scales: a [1, K] field every dim-0 shard shares
        return dtq.Float8RowwiseScaling()
    return dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling())


def _dev():
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _model(seed, quantized_params, recipe=None):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        dtq.nn.LayerNormMLP(H, F, activation="swiglu", name="mlp"), dtq.nn.Linear(H, H, name="out")
    ).to(_dev())
    if quantized_params:
        dtq.convert(m, recipe=recipe or _recipe(), quantized_params=True)
    return m


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Full (unsharded) parameters of a and b are bitwise equal, payload by payload."""
    from torch.distributed.tensor import DTensor

    def full(p):
        if isinstance(p, DTensor):
            loc = p._local_tensor
            if isinstance(loc, dtq.QuantizedTensor):
                return loc  # compared shard-wise by the caller's world
            p = p.full_tensor()
        return p.__dtq_unwrap__() if hasattr(p, "__dtq_unwrap__") else p

    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        x, y = full(p), full(q)
        if isinstance(x, dtq.QuantizedTensor):
            assert x.directions == y.directions, n
            for d in x.directions:
                for k, v in x.payload(d).items():
                    assert torch.equal(_bits(v), _bits(y.payload(d)[k])), (n, d, k)
        else:
            assert torch.equal(x.detach(), y.detach()), n


@pytest.mark.parametrize("quantized_params", [False, True])
def test_single_process_round_trip(tmp_path, quantized_params):
    a = _model(0, quantized_params)
    sd = a.state_dict()
    if quantized_params:  # codes, not values: payload entries, and no dequantized weight
        assert "out.weight" not in {k.replace("1.", "out.") for k in sd} and any(
            k.startswith("1.weight._payload.rowwise.mxfp8-") and k.endswith(".data") for k in sd
        )
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"))
    b = _model(1, quantized_params)
    sd_b = b.state_dict()
    dcp.load(sd_b, checkpoint_id=str(tmp_path / "dcp"))
    b.load_state_dict(sd_b)
    _same_weights(a, b)
    torch.save(a.state_dict(), tmp_path / "sd.pt")  # also through torch.save(weights_only=True)
    c = _model(2, quantized_params)
    c.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    _same_weights(a, c)


def _snapshot(model):
    return {
        n: (p.dequantize() if isinstance(p, dtq.QuantizedTensor) else p.detach()).clone()
        for n, p in model.named_parameters()
    }


def _mismatches(src: dict):
    """(name, recipe of the target model, mutation of the source state dict, expected error)."""
    key = next(k for k in src if k.startswith("1.weight._payload.rowwise.") and k.endswith(".data"))
    return [
        (
            "wrong format",
            dtq.MXFP8BlockScaling(),
            None,
            r"holds it quantized as HybridQuantizer.*the model as MXFP8Quantizer",
        ),
        ("missing key", None, lambda sd: sd.pop(key.replace(".data", ".scale")), r"missing from the checkpoint"),
        ("shape mismatch", None, lambda sd: sd.__setitem__(key, sd[key][:64]), r"the checkpoint has \[64, 128\]"),
    ]


def test_mismatched_checkpoints_raise_and_leave_the_model_untouched(tmp_path):
    src = _model(0, True).state_dict()
    for name, recipe, mutate, match in _mismatches(src):
        sd = dict(src)
        target = _model(5, True, recipe)
        if mutate is not None:
            mutate(sd)
        before = _snapshot(target)
        with pytest.raises(RuntimeError, match=match):
            target.load_state_dict(sd)
        for n, p in _snapshot(target).items():  # every module untouched, not only the one that failed
            assert torch.equal(p, before[n]), (name, n)


def test_mismatched_dcp_checkpoints_fail_before_writing(tmp_path):
    """dcp.load writes into the live payloads: a checkpoint of another format (other keys) or
    another shape must stop at planning, before any byte lands."""
    src = _model(0, True)
    dcp.save(src.state_dict(), checkpoint_id=str(tmp_path / "hybrid"))
    for name, target in [
        ("wrong format", _model(5, True, dtq.MXFP8BlockScaling())),
        (
            "wrong shape",
            dtq.convert(
                torch.nn.Sequential(dtq.nn.LayerNormMLP(H, F, activation="swiglu"), dtq.nn.Linear(H, 2 * H)),
                recipe=_recipe(),
                quantized_params=True,
            ),
        ),
    ]:
        before = _snapshot(target)
        with pytest.raises(CheckpointException) as failure:  # DCP wraps the planner's error per rank
            dcp.load(target.state_dict(), checkpoint_id=str(tmp_path / "hybrid"))
        assert re.search(
            r"Missing key in checkpoint state_dict: 0\.fc1_weight\._payload\.\w+\.mxfp8-|Size mismatch",
            repr(failure.value) + str(failure.value),
        ), repr(failure.value)
        for n, p in _snapshot(target).items():
            assert torch.equal(p, before[n]), (name, n)


def _shard(m, world):
    mesh = init_device_mesh(_dev().type, (world,))
    for x in m:
        fully_shard(x, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _save_sharded(rank, world, cases):
    """Each ``(path, quantized_params, recipe)`` of ``cases`` saved from ``world`` ranks (one spawn
    for all of them: the ranks' start-up is most of a case's time)."""
    for path, quantized_params, recipe in cases:
        m = _shard(_model(0, quantized_params, _recipe(recipe)), world)
        with dtq.autocast(_recipe(recipe)):
            m(torch.randn(T, H, device=_dev())).sum().backward()  # a gathered, used model saves the same
        _save(m.state_dict(), path, asynchronous=quantized_params)


def _save(state, path, asynchronous: bool) -> None:
    """dcp.save, or dcp.async_save on its own gloo group (the background write's collectives must
    not share a communicator with training) awaited before returning; the staged copy is taken
    before async_save returns, so training may go on meanwhile."""
    if not asynchronous:
        dcp.save(state, checkpoint_id=path)
        return
    group = dist.new_group(backend="gloo")
    dcp.async_save(state, checkpoint_id=path, process_group=group).result()
    dist.destroy_process_group(group)


def _load_sharded(rank, world, cases):
    for path, quantized_params, recipe in cases:
        _load_one(rank, world, path, quantized_params, recipe)


def _load_one(rank, world, path, quantized_params, recipe):
    m = _shard(_model(1, quantized_params, _recipe(recipe)), world)
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=path)
    m.load_state_dict(sd)
    ref = _model(0, quantized_params, _recipe(recipe))
    from torch.distributed.tensor import DTensor

    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        loc = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(loc, dtq.QuantizedTensor):
            rows = -(-q.shape[0] // world)
            shard = q[rank * rows : (rank + 1) * rows]
            for d in loc.directions:
                for k, v in loc.payload(d).items():
                    assert torch.equal(_bits(v), _bits(shard.payload(d)[k])), (n, d, k)
        else:
            full = p.full_tensor()
            full = full.__dtq_unwrap__() if hasattr(full, "__dtq_unwrap__") else full
            q = q.__dtq_unwrap__() if hasattr(q, "__dtq_unwrap__") else q
            assert torch.equal(full, q.detach()), n


def test_resharded_loads_4_to_2_to_1(tmp_path):
    """Saved from 4 ranks, loaded on 2 and on 1: high-precision and quantized hybrid parameters,
    and quantized FP8 row-wise ones."""
    cases = [
        (str(tmp_path / f"ckpt_{qp}_{recipe}"), qp, recipe)
        for qp, recipe in [(False, "hybrid"), (True, "hybrid"), (True, "fp8_row")]
    ]
    spawn(_save_sharded, 4, cases)
    spawn(_load_sharded, 2, cases)
    for path, quantized_params, recipe in cases:
        one = _model(1, quantized_params, _recipe(recipe))
        sd = one.state_dict()
        dcp.load(sd, checkpoint_id=path)
        one.load_state_dict(sd)
        _same_weights(one, _model(0, quantized_params, _recipe(recipe)))


def _train_resume(rank, world, path):
    recipe = _recipe()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(world * T, H, generator=g).to(_dev()) for _ in range(10)]
    local = slice(rank * T, (rank + 1) * T)

    def fresh():
        m = _shard(_model(0, True), world)
        return m, dtq.optim.MasterWeightOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-3)

    def steps(m, opt, rng):
        for i in rng:
            with dtq.autocast(recipe):
                loss = m(xs[i][local]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.detach()

    m, opt = fresh()
    torch.manual_seed(7)
    final = steps(m, opt, range(10))
    full_sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in m.state_dict().items()}

    m, opt = fresh()
    torch.manual_seed(7)
    steps(m, opt, range(5))
    # stochastic rounding draws its seeds from the generator of the input's device
    rng_state = (torch.get_rng_state(), torch.cuda.get_rng_state() if _dev().type == "cuda" else None)
    _save({"model": m.state_dict(), "optim": opt.state_dict()}, path, asynchronous=True)
    m, opt = fresh()  # a new process would start here
    state = {"model": m.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    m.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    torch.set_rng_state(rng_state[0])
    if rng_state[1] is not None:
        torch.cuda.set_rng_state(rng_state[1])
    resumed = steps(m, opt, range(5, 10))
    assert torch.equal(resumed, final)
    for k, v in m.state_dict().items():
        if isinstance(v, torch.Tensor):
            a = v._local_tensor if hasattr(v, "_local_tensor") else v
            b = full_sd[k]._local_tensor if hasattr(full_sd[k], "_local_tensor") else full_sd[k]
            assert torch.equal(_bits(a), _bits(b)), k


def test_training_resumed_at_step_5_ends_bitwise(tmp_path):
    spawn(_train_resume, 2, str(tmp_path / "resume"))


# -- high-precision bridges --------------------------------------------------------------------


def _check_hp_bridges(rank, world, path):
    from safetensors.torch import load_file

    single = _model(0, True)
    m = _shard(_model(0, True), world)
    opt = dtq.optim.MasterWeightOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)
    with dtq.autocast(_recipe()):
        m(torch.randn(T, H, device=_dev())).square().mean().backward()
    opt.step()  # masters move away from the dequantized values
    dtq.checkpoint.export_safetensors(m, path, dtype=torch.float32, optimizer=opt)
    dist.barrier()
    exported = load_file(path)
    masters = {
        n: mm.full_tensor()
        for (n, p), mm in zip(
            [(n, p) for n, p in m.named_parameters() if isinstance(p._local_tensor, dtq.QuantizedTensor)], opt.masters
        )
    }
    for n, p in m.named_parameters():
        if n in masters:
            assert torch.equal(exported[n], masters[n].cpu()), n
        else:
            assert torch.equal(exported[n], p.full_tensor().detach().cpu()), n
    # without the optimizer: dequantized values of the (gathered) payloads
    deq = dtq.checkpoint.high_precision_state_dict(single, dtype=torch.float32)
    for n, p in single.named_parameters():
        if isinstance(p, dtq.QuantizedTensor):
            assert torch.equal(deq[n], p.dequantize(torch.float32).cpu()), n
    # loading full high-precision values into a sharded quantized model: shard = slice of whole
    fresh = _shard(_model(3, True), world)
    dtq.checkpoint.load_high_precision(fresh, exported)
    for (n, p), (_, q) in zip(fresh.named_parameters(), single.named_parameters()):
        loc = p._local_tensor
        if isinstance(loc, dtq.QuantizedTensor):
            whole = q.quantizer.quantize(exported[n].to(_dev()))
            rows = -(-q.shape[0] // world)
            shard = whole[rank * rows : (rank + 1) * rows]
            for d in loc.directions:
                for k, v in loc.payload(d).items():
                    assert torch.equal(_bits(v), _bits(shard.payload(d)[k])), (n, d, k)
        else:
            assert torch.equal(p.full_tensor().cpu(), exported[n]), n


def test_safetensors_export_and_high_precision_load_2_ranks(tmp_path):
    spawn(_check_hp_bridges, 2, str(tmp_path / "model.safetensors"))


def test_load_high_precision_errors():
    m = _model(0, True)
    sd = dtq.checkpoint.high_precision_state_dict(m, torch.float32)
    with pytest.raises(KeyError, match=r"missing \['1.bias'\]"):
        dtq.checkpoint.load_high_precision(m, {k: v for k, v in sd.items() if k != "1.bias"})
    sd["1.weight"] = sd["1.weight"][:64]
    with pytest.raises(ValueError, match=r"1.weight has shape \[64, 128\] in the state dict and \[128, 128\]"):
        dtq.checkpoint.load_high_precision(m, sd)


def test_delayed_scaling_histories_resume_through_dcp(tmp_path):
    """dcp.load fills only the keys the target's state dict has. ``dtq.convert(model,
    recipe=DelayedScaling())`` creates the amax histories up front, so a fresh model loads them and
    the next steps' outputs (scales from the histories) are bitwise the uninterrupted model's."""
    recipe = dtq.DelayedScaling(amax_history_len=4)

    def fresh():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(H, F), torch.nn.GELU(), torch.nn.Linear(F, H))
        return dtq.convert(net, recipe=recipe)

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(T, H, generator=g) * (i + 1) for i in range(4)]

    def step(m, x):
        with dtq.autocast(recipe):
            y = m(x.requires_grad_())
        y.square().mean().backward()
        return y.detach()

    a = fresh()
    for x in xs[:2]:
        step(a, x)
    dcp.save(a.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
    b = fresh()
    sd = b.state_dict()
    assert sum("amax_history_" in k for k in sd) == 6  # input, weight, grad_output of both GEMMs
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    b.load_state_dict(sd)
    for x in xs[2:]:
        assert torch.equal(step(a, x.clone()), step(b, x.clone()))


def test_recipe_state_on_a_meta_model_starts_empty():
    """Histories created on the meta device come out of to_empty uninitialized: reset_parameters
    zeroes them (else a garbage 'past amax' would set the first scales)."""
    with torch.device("meta"):
        m = dtq.convert(torch.nn.Sequential(torch.nn.Linear(H, F), torch.nn.Linear(F, H)), recipe=dtq.DelayedScaling())
    m.to_empty(device="cpu")
    for mod in m:
        torch.nn.init.constant_(mod.amax_history_0_input, 7.0)  # what to_empty may leave
        mod.reset_parameters()
    assert all(b.eq(0).all() for n, b in m.named_buffers() if "amax_history_" in n)
