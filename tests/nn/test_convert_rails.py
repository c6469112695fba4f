"""Safety rails of ``dtq.convert`` and the modules (issue 18, symptoms 3, 5 and 6).

3: ``dtq.convert(model, recipe=r)`` binds ``r`` as the model's default recipe (autocast still
   overrides, eager and compiled), and a model that would silently run in high precision says so.
5: convert checks shapes against the recipe and the FSDP2 shard count, keeps and reports by full
   name what it cannot quantize (a transformers Llama's ``lm_head``), and every later error names
   the parameter by fully qualified name.
6: ``dtq.nn.Linear`` is an ``nn.Linear`` (torch's own TP styles drive it), and convert handles
   ``nn.Linear`` subclasses instead of skipping them silently.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dtq
from dtq.testing import spawn

H = 64


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(H, 2 * H)
        self.down = torch.nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _block(**convert_kw):
    torch.manual_seed(0)
    return dtq.convert(Block(), **convert_kw)


def _run(model, x, ctx=None):
    """Output and gradients of one forward/backward, inside ``ctx`` (None: no dtq.autocast)."""
    x = x.detach().clone().requires_grad_()
    if ctx is None:
        y = model(x)
    else:
        with ctx:
            y = model(x)
    y.square().sum().backward()
    out = [y.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
    model.zero_grad(set_to_none=True)
    return out


def _same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.fixture
def fresh_warnings():
    dtq._warn._warned.clear()
    yield
    dtq._warn._warned.clear()


# -- symptom 3: the recipe convert binds ---------------------------------------------------------


def test_convert_binds_the_recipe_and_autocast_overrides(fresh_warnings):
    r = dtq.MXFP8BlockScaling()  # keeps no per-module state: convert refused it before
    x = torch.randn(32, H)
    bound = _block(recipe=r)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(bound, x)
    assert not [w for w in caught if "dtq" in str(w.message)]
    assert _same(got, _run(_block(), x, dtq.autocast(r)))  # quantized, as under autocast(r)
    assert not _same(got, _run(_block(), x, dtq.autocast(enabled=False)))
    # an active autocast overrides: another recipe, or none at all
    other = dtq.Float8CurrentScaling()
    assert _same(_run(bound, x, dtq.autocast(other)), _run(_block(), x, dtq.autocast(other)))
    assert _same(_run(bound, x, dtq.autocast(enabled=False)), _run(_block(), x, dtq.autocast(enabled=False)))
    # quantized parameters: the same recipe quantizes the weights and the GEMMs outside autocast
    qp = _block(recipe=r, quantized_params=True)
    assert isinstance(qp.up.weight, dtq.QuantizedTensor)
    assert _same(_run(qp, x)[:2], _run(_block(recipe=r, quantized_params=True), x, dtq.autocast(r))[:2])


def test_compiled_model_runs_the_bound_recipe():
    """torch.compile(fullgraph=True) of a converted model outside autocast resolves the bound
    recipe as eager does (bitwise, two steps); autocast(enabled=False) still overrides it."""
    torch._dynamo.reset()
    r = dtq.hybrid_recipe(dtq.MXFP8BlockScaling(), dtq.NVFP4BlockScaling())
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(1))
    eager, model = _block(recipe=r), _block(recipe=r)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    try:
        for step in range(2):
            torch.manual_seed(step)
            want = _run(eager, x, dtq.autocast(r))
            torch.manual_seed(step)
            assert _same(_run(compiled, x), want), step
        assert _same(_run(compiled, x, dtq.autocast(enabled=False)), _run(eager, x, dtq.autocast(enabled=False)))
    finally:
        torch._dynamo.reset()


def test_running_without_any_recipe_warns_once(fresh_warnings):
    x = torch.randn(32, H)
    model = _block()  # no recipe bound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(x)  # evaluation in high precision: nothing to say
        with dtq.autocast(enabled=False):
            _run(model, x)  # high precision chosen
        assert not caught
        _run(model, x)
        _run(model, x)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "'up'" in said[0] and "train in high precision" in said[0], said
    assert "dtq.autocast(recipe)" in said[0] and "dtq.convert(model, recipe=recipe)" in said[0]
    # quantized parameters outside any recipe are dequantized: said once too, also without grad
    lin = dtq.nn.Linear(H, H, name="q")
    lin.weight = torch.nn.Parameter(dtq.MXFP8Quantizer().quantize(lin.weight.detach()), requires_grad=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            lin(x)
            lin(x)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "'q' holds quantized parameters (mxfp8)" in said[0] and "dequantizes" in said[0]


# -- symptom 5: shape checks, reports, fully qualified names -------------------------------------


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Linear(100, H))
        self.attn = torch.nn.MultiheadAttention(H, 4)
        self.head = torch.nn.Linear(H, 1000)


def test_convert_checks_shapes_reports_and_strict(caplog):
    with caplog.at_level(logging.INFO, logger="dtq"):
        model, report = dtq.convert(Mixed(), recipe=dtq.MXFP8BlockScaling(), report=True)
    assert report.converted == ("body.0",) and isinstance(model.body[0], dtq.nn.Linear)
    assert set(report.skipped) == {"body.1", "attn.out_proj", "head"}
    assert "K (last dim) = 100 must be a multiple of the MX block size 32" in report.skipped["body.1"]
    assert "weight [1000, 64]" in report.skipped["head"] and type(model.head) is torch.nn.Linear
    assert "never calls its forward" in report.skipped["attn.out_proj"]
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "kept head:" in caplog.records[0].message
    # strict refuses, naming every layer; a filter keeps layers on purpose (not an error)
    with pytest.raises(ValueError, match=r"(?s)strict=True.*body\.1: .*attn\.out_proj: .*head: "):
        dtq.convert(Mixed(), recipe=dtq.MXFP8BlockScaling(), strict=True)
    keep = {"body.1", "head", "attn.out_proj"}
    _, report = dtq.convert(
        Mixed(),
        recipe=dtq.MXFP8BlockScaling(),
        strict=True,
        report=True,
        module_filter_fn=lambda m, fqn: fqn not in keep,
    )
    assert report.refused == {} and report.skipped["head"] == "left out by the filter (module_filter_fn)"
    # FSDP2 shards: 128x128 weight blocks cannot be split into 32-row shards
    _, report = dtq.convert(
        torch.nn.Sequential(torch.nn.Linear(H, 256), torch.nn.Linear(256, H)),
        recipe=dtq.Float8BlockScaling(),
        fsdp_world=2,
        report=True,
    )
    assert report.converted == ("0",) and "FSDP2 over 2 ranks gives shards of 32 rows" in report.skipped["1"]
    # without a recipe nothing can be checked: everything safe is converted, and the report says so
    _, report = dtq.convert(Mixed(), report=True)
    assert set(report.skipped) == {"attn.out_proj"} and "shapes not checked" in str(report)


def test_shape_problems_name_gemms_by_full_name():
    model = dtq.convert(torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(H, 48))))
    problems = dtq.shapes.shape_problems(model, dtq.NVFP4BlockScaling(), tokens=24, fsdp_world=2)
    text = "\n".join(map(str, problems))
    assert "0.0 input [24, 64]" in text and "M (leading dims) = 24 must be a multiple of 16" in text
    assert "0.0 weight [48, 64]: FSDP2 over 2 ranks gives shards of 24 rows, but nvfp4" in text


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _check_llama_fsdp2(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    # The defaults plus a recipe: lm_head ([1000, 128]: 1000 rows take no 32-row MX blocks) is kept
    # and reported; the rest trains under the bound recipe without dtq.autocast, gathers quantized.
    model, report = dtq.convert(_llama(), recipe=dtq.MXFP8BlockScaling(), report=True)
    assert set(report.refused) == {"lm_head"} and "weight [1000, 128]" in report.refused["lm_head"]
    assert len(report.converted) == 7 and isinstance(model.model.layers[0].mlp.up_proj, torch.nn.Linear)
    _shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtq.parallel.comm_stats(reset=True)
    losses = []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        dtq.parallel.precompute_amax(model)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]
    assert dtq.parallel.comm_stats().get("mxfp8/rowwise", 0) > 0
    # Converted without a recipe, lm_head is a dtq module: the errors name it by full name.
    model = _shard(dtq.convert(_llama()), mesh)
    with pytest.raises(ValueError, match=r"precompute_amax: cannot take the amax of lm_head\.weight \(this rank's"):
        dtq.parallel.precompute_amax(model, dtq.NVFP4BlockScaling())
    with pytest.raises(ValueError, match=r"cannot all-gather lm_head\.weight \(shape \[1000, 128\]\)"):
        with dtq.autocast(dtq.MXFP8BlockScaling()):
            model(input_ids=ids, labels=ids)


# -- symptom 6: dtq.nn.Linear is an nn.Linear; subclasses ----------------------------------------


def test_dtq_linear_is_an_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(H, 32, dtype=torch.float64)
    torch.manual_seed(0)
    lin = dtq.nn.Linear(H, 32, dtype=torch.float64)
    assert isinstance(lin, torch.nn.Linear) and (lin.in_features, lin.out_features) == (H, 32)
    assert lin.weight.shape == (32, H) and lin.weight.dtype == torch.float64 and lin.bias.shape == (32,)
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)  # nn.Linear's initialization
    assert hasattr(lin.weight, "fsdp_pre_all_gather")  # still gathered quantized by FSDP2
    x = torch.randn(4, H, dtype=torch.float64)
    with dtq.autocast(enabled=False):
        assert torch.equal(lin(x), ref(x))
    model = torch.nn.Sequential(lin)
    _, report = dtq.convert(model, report=True)
    assert model[0] is lin and report.converted == () and report.skipped == {}  # not converted twice


class PlainSubclass(torch.nn.Linear):
    """Adds nothing: converting it is safe."""


class ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_convert_handles_linear_subclasses():
    model = torch.nn.Sequential(PlainSubclass(H, H), ScaledLinear(H, H))
    model[0].register_forward_hook(lambda m, i, o: None)
    _, report = dtq.convert(model, report=True)
    assert report.converted == ("0",) and type(model[0]) is dtq.nn.Linear and len(model[0]._forward_hooks) == 1
    assert "ScaledLinear" in report.skipped["1"] and "'forward'" in report.skipped["1"]


def _check_torch_styles(rank, world):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    r = dtq.MXFP8BlockScaling()
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(2))
    runs = []
    for styles in ((ColwiseParallel, RowwiseParallel), (dtq.parallel.ColwiseParallel, dtq.parallel.RowwiseParallel)):
        torch.manual_seed(0)
        model = dtq.convert(torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.ReLU(), torch.nn.Linear(2 * H, H)))
        parallelize_module(model, mesh, {"0": styles[0](), "2": styles[1]()})
        y, dx, *grads = _run(model, x, dtq.autocast(r))
        runs.append([y, dx, *(g.to_local() for g in grads)])
    torch_styles, dtq_styles = runs
    assert all(torch.equal(a, b) for a, b in zip(torch_styles, dtq_styles))


def _check_two_ranks(rank, world):
    _check_llama_fsdp2(rank, world)
    _check_torch_styles(rank, world)


def test_two_ranks_llama_fsdp2_names_lm_head_and_torch_tp_styles_drive_dtq_linear():
    """One spawn for both 2-rank checks: (5) a transformers Llama converted with the defaults
    under FSDP2 keeps and names lm_head, and errors name it by full name; (6) torch's
    ColwiseParallel / RowwiseParallel accept dtq.nn.Linear and give bitwise what dtq's own styles
    give (quantized GEMMs on the local shards)."""
    pytest.importorskip("transformers")
    spawn(_check_two_ranks, 2, backend="gloo")
