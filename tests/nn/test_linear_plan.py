"""Planned GEMM calls (dtq.nn.linear_plan) give the general path's bits: output, dx, dw and db, for
every built-in recipe the plan takes, high-precision and quantized weights, 2-D and 3-D inputs,
every gradient combination and saved tensors moved to the CPU; recipes it cannot take run the
general path."""

import pytest
import torch

import dtq
import dtq.nn.module as nn_module
from dtq import kernels
from dtq.presets import recipe_from_name

PLANNED = [
    "fp8",
    "fp8-block",
    "fp8-row",
    "mxfp8",
    "nvfp4",
    "nvfp4_1d_weight",
    "hybrid",
    "hybrid-original",
    "high_precision_fwd_mxfp8_bwd",
]
GENERAL = ["fp8-delayed", "mxfp8_fwd_high_precision_bwd"]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CUDA: the kernels and scaled GEMMs


def _bits(t):
    return None if t is None else t.detach().contiguous().view(torch.uint8)


def _same(a: list, b: list) -> bool:
    """Two runs' bit patterns (``_bits`` of each tensor, None where there is none) are identical."""
    return all(u is None and v is None or torch.equal(u, v) for u, v in zip(a, b, strict=True))


def _run(module, x, recipe, planned: bool, monkeypatch, *, x_grad=True, offload=False):
    with monkeypatch.context() as m:
        if not planned:
            m.setattr(nn_module, "plan_for", lambda *a: None)
        torch.manual_seed(1)  # stochastic rounding draws the same seeds in both runs
        x = x.detach().clone().requires_grad_(x_grad)
        ctx = (
            torch.autograd.graph.save_on_cpu()
            if offload
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with ctx, dtq.autocast(recipe):
            y = module(x)
        y.float().pow(2).sum().backward()
    out = [_bits(y), _bits(x.grad)] + [_bits(p.grad) for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return out


def _module(bias: bool, quantized: bool, recipe, device="cpu"):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=bias, dtype=torch.bfloat16, device=device))
    if quantized:
        module = dtq.convert(module, recipe=recipe, quantized_params=True)
        return module, module[0]
    module = dtq.convert(module)
    return module, module[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PLANNED)
@pytest.mark.parametrize("bias", [False, True])
def test_planned_calls_give_the_general_paths_bits(name, bias, device, monkeypatch):
    recipe = recipe_from_name(name)
    module, layer = _module(bias, False, recipe, device)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16, device=device)
    for x_grad, weight_grad, offload in [(True, True, False), (False, True, False), (True, False, True)]:
        layer.weight.requires_grad_(weight_grad)
        want = _run(module, x, recipe, False, monkeypatch, x_grad=x_grad, offload=offload)
        got = _run(module, x, recipe, True, monkeypatch, x_grad=x_grad, offload=offload)
        assert _same(got, want), (name, x_grad)
    plans = layer._slots(recipe, 0).plans
    assert len(plans) == 3, plans  # one per gradient combination: the planned path ran


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8", "mxfp8", "hybrid"])
def test_planned_calls_with_quantized_weights(name, device, monkeypatch):
    recipe = recipe_from_name(name)
    module, layer = _module(True, True, recipe, device)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
    want = _run(module, x, recipe, False, monkeypatch)
    got = _run(module, x, recipe, True, monkeypatch)
    assert _same(got, want), name
    assert layer._slots(recipe, 0).plans


@pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.available("cuda"), reason="Hopper's FP8 GEMMs and the kernels"
)
@pytest.mark.parametrize("quantized", [False, True])
def test_planned_fp8_takes_transposed_codes_from_the_quantize_launch(quantized, monkeypatch):
    """dgrad and wgrad read FP8 codes [K, M] on Hopper: the plan has the quantize kernel write x's,
    dy's and a high-precision weight's that way beside the rowwise codes, so no transpose kernel
    runs (a stored quantized weight's columnwise codes still take one), and backward keeps x's
    [K, M] codes only. The bits are the general path's (the tests above)."""
    recipe = recipe_from_name("fp8")
    module, layer = _module(False, quantized, recipe, "cuda")
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    calls, saved, real = [], [], kernels.transposed
    monkeypatch.setattr(kernels, "transposed", lambda t: calls.append(tuple(t.shape)) or real(t))
    keep = lambda t: saved.append((tuple(t.shape), t.dtype)) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), dtq.autocast(recipe):
        y = module(x)
    y.float().pow(2).sum().backward()
    assert layer._slots(recipe, 0).plans
    assert calls == ([(128, 64)] if quantized else [])  # the stored weight's columnwise codes, [N, K]
    codes = [shape for shape, dtype in saved if dtype == torch.float8_e4m3fn]
    assert (64, 32) in codes and (32, 64) not in codes, codes
    if not quantized:
        assert (64, 128) in codes and (128, 64) not in codes, codes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recompute_runs_the_plan_its_forward_ran(reentrant, device, monkeypatch):
    """torch.utils.checkpoint's recompute must save what the forward saved (the non-reentrant one
    checks count, shapes and dtypes): a planned forward is recomputed planned, since a plan may keep
    other fields than the general path (FP8's [K, M] codes on a GPU). Bits: test_recompute_matrix."""
    from torch.utils.checkpoint import checkpoint

    from dtq._torch_private import in_backward

    recipe = recipe_from_name("fp8")
    module, _ = _module(False, False, recipe, device)
    seen, real = [], nn_module.plan_for
    monkeypatch.setattr(nn_module, "plan_for", lambda *a: seen.append(in_backward()) or real(*a))
    x = torch.randn(32, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    with dtq.autocast(recipe):
        y = checkpoint(module, x, use_reentrant=reentrant)
    y.float().pow(2).sum().backward()
    assert seen == [False, True], seen  # the forward, then its recompute in backward


class _SharedInput(torch.nn.Module):
    """q, k and v of one x, as a converted attention block has them; ``write``: x changes in place
    between q and k."""

    def __init__(self, write: bool, device):
        super().__init__()
        kw = {"bias": False, "dtype": torch.bfloat16, "device": device}
        self.q, self.k, self.v = (torch.nn.Linear(64, 64, **kw) for _ in range(3))
        self.write = write

    def forward(self, x):
        q = self.q(x)
        if self.write:
            x.mul_(2)
        return q + self.k(x) + self.v(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8", "mxfp8", "hybrid"])
@pytest.mark.parametrize("write", [False, True])
def test_gemms_reading_one_input_quantize_it_once(name, write, device, monkeypatch):
    """One quantization of x serves q, k and v (the general path's bits, one quantize call, one
    saved copy of x's columnwise codes); a write into x between two of them quantizes again."""
    from dtq.nn import linear_native, linear_plan

    monkeypatch.setattr(linear_native, "enabled", False)  # the Python plan's (the C++ one's: test_native_linear.py)
    recipe = recipe_from_name(name)
    torch.manual_seed(0)
    module = dtq.convert(_SharedInput(write, device))
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, device=device)
    want = _run(module, x, recipe, False, monkeypatch, x_grad=not write)
    runs, real = [], linear_plan._run
    monkeypatch.setattr(linear_plan, "_run", lambda plan, x2, *a: runs.append(x2.shape) or real(plan, x2, *a))
    got = _run(module, x, recipe, True, monkeypatch, x_grad=not write)
    assert _same(got, want), name
    forward = runs[: runs.index(torch.Size([64, 64]), 1) + 3]  # up to the last weight: x's and the weights'
    assert forward.count(torch.Size([32, 64])) == (2 if write else 1), runs
    saved = []
    pack = lambda t: saved.append(t) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dtq.autocast(recipe):
        y = module(x.clone())
    ids = [id(t) for t in saved]
    assert len(ids) - len(set(ids)) >= (1 if write else 2) * 2  # the shared codes and scales, saved again
    assert linear_plan._LAST.entry is not None
    y.float().sum().backward()
    assert linear_plan._LAST.entry is None  # backward dropped the held payloads


@pytest.mark.parametrize("name", GENERAL)
def test_recipes_the_plan_cannot_take_run_the_general_path(name, monkeypatch):
    recipe = recipe_from_name(name)
    module, layer = _module(False, False, recipe)
    _run(module, torch.randn(32, 64, dtype=torch.bfloat16), recipe, True, monkeypatch)
    assert not layer._slots(recipe, 0).plans


@pytest.mark.parametrize("planned", [True, False])
def test_a_backward_that_builds_a_graph_refuses_a_second_backward(planned, monkeypatch):
    # the GEMM Functions' backward skips once_differentiable's no_grad region when no graph is
    # built; with create_graph=True it takes it, so differentiating dx again raises instead of
    # silently treating the quantized GEMMs as constants
    if not planned:
        monkeypatch.setattr(nn_module, "plan_for", lambda *a: None)
    recipe = dtq.Float8CurrentScaling()
    module, layer = _module(False, False, recipe)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with dtq.autocast(recipe):
        y = module(x)
    assert bool(layer._slots(recipe, 0).plans) == planned  # (the call ran the path asked for)
    (dx,) = torch.autograd.grad(y.float().pow(2).sum(), x, create_graph=True)
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.float().sum().backward()
    with dtq.autocast(recipe):
        y = module(x)
    (dx2,) = torch.autograd.grad(y.float().pow(2).sum(), x)
    assert torch.equal(_bits(dx.detach()), _bits(dx2))  # the same gradient either way


def _given_amax_run(layer, x, recipe, amax, planned: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not planned:
            m.setattr(nn_module, "plan_for", lambda *a: None)
        torch.manual_seed(1)  # stochastic rounding draws the same seeds in both runs
        x = x.detach().clone().requires_grad_()
        with dtq.autocast(recipe):
            y = layer._linear(x, layer.weight, None, x_amax=amax)
        y.float().pow(2).sum().backward()
    out = [_bits(y), _bits(x.grad), _bits(layer.weight.grad)]
    layer.weight.grad = None
    return out


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "hybrid"])
def test_a_producers_amax_reaches_the_directions_the_general_path_gives_it(name, monkeypatch):
    # a planned call takes a known max|x| (a producer's) for the directions scaled from max|x|
    # over the whole tensor (NVFP4: its rowwise direction, not the random-Hadamard columnwise
    # one; the MXFP8/NVFP4 hybrid's input: none), as the general path does; as is when it is the
    # 0-dim fp32 the codecs take, converted when of another shape or dtype, and a wrong size is named
    recipe = recipe_from_name(name)
    torch.manual_seed(0)
    layer = dtq.nn.Linear(64, 32, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    amax = x.float().abs().max() * 3  # (not max|x|: where taken, the given amax is what scales x)
    planned = _given_amax_run(layer, x, recipe, amax, True, monkeypatch)
    ((_, plan),) = layer._slots(recipe, 0).plans.values()  # (the call ran planned)
    takers = {"fp8": ("rowwise",), "nvfp4": ("rowwise",), "hybrid": ()}[name]  # (FP8's columnwise: its twin)
    assert plan.x_known == takers
    assert _same(planned, _given_amax_run(layer, x, recipe, amax, False, monkeypatch))
    assert _same(planned, _given_amax_run(layer, x, recipe, amax.reshape(1).double(), True, monkeypatch))
    assert _same(planned, _given_amax_run(layer, x, recipe, None, True, monkeypatch)) == (not takers)
    if takers:
        with pytest.raises(ValueError, match="amax has shape"), dtq.autocast(recipe):
            layer._linear(x, layer.weight, None, x_amax=torch.ones(3))


def test_a_shape_the_format_refuses_raises_the_general_message():
    layer = dtq.nn.Linear(48, 32, bias=False, params_dtype=torch.bfloat16, name="proj")
    with pytest.raises(ValueError, match="MXFP8"), dtq.autocast(dtq.MXFP8BlockScaling()):
        layer(torch.randn(8, 48, dtype=torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8", "mxfp8"])
def test_planned_layernorm_mlp_with_the_swiglu_amax_link(name, device, monkeypatch):
    """LayerNormMLP's SwiGLU hands max|h| to fc2 and max|d(fc1 out)| to fc1's backward (on CUDA,
    from its fused kernel): the planned calls take them as the general path does."""
    recipe = recipe_from_name(name)
    torch.manual_seed(0)
    mlp = dtq.nn.LayerNormMLP(64, 128, activation="swiglu", params_dtype=torch.bfloat16, device=device)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, device=device)
    want = _run(mlp, x, recipe, False, monkeypatch)
    got = _run(mlp, x, recipe, True, monkeypatch)
    assert _same(got, want), name
    assert mlp._slots(recipe, 0).plans and mlp._slots(recipe, 1).plans


@pytest.mark.parametrize("planned", [True, False])
def test_a_quantized_weight_without_columnwise_payload_is_named_in_dgrad(planned, monkeypatch):
    layer = dtq.nn.Linear(64, 32, bias=False, params_dtype=torch.bfloat16, name="blocks.0.proj")
    rowwise_only = dtq.Float8Quantizer().quantize(layer.weight.detach().__dtq_unwrap__(), columnwise=False)
    layer.weight = torch.nn.Parameter(rowwise_only, requires_grad=False)
    if not planned:
        monkeypatch.setattr(nn_module, "plan_for", lambda *a: None)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    with dtq.autocast(dtq.Float8CurrentScaling()):
        y = layer(x)
    assert bool(layer._slots(dtq.Float8CurrentScaling(), 0).plans) == planned
    with pytest.raises(RuntimeError, match=r"Linear 'blocks\.0\.proj'.*no columnwise payload for dgrad"):
        y.sum().backward()


def _check_fsdp2_planned_equals_general(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import tests.parallel.test_sharded_equals_single as ses

    mesh = init_device_mesh("cpu", (world,))
    # FSDP2 gathers quantized payloads of quantized params / of high-precision shards (suite time: two of four)
    for name, qp in (("fp8", True), ("hybrid", False)):
        recipe = recipe_from_name(name)
        runs = []
        for planned in (True, False):
            nn_module.plan_for = _REAL_PLAN_FOR if planned else (lambda *a: None)
            model = ses._model(recipe, qp, recompute=False)
            ses._shard(model, mesh, "linear", True)
            torch.manual_seed(3)
            runs.append((ses._train(model, recipe, qp, precompute=not qp), ses._state(model)))
            if planned:
                assert model[0].fc1._slots(recipe, 0).plans, (name, qp)  # the planned path ran
        nn_module.plan_for = _REAL_PLAN_FOR
        (got, got_state), (want, want_state) = runs
        assert torch.equal(ses._bits(got), ses._bits(want)), (name, qp, got.tolist(), want.tolist())
        assert got_state.keys() == want_state.keys()
        assert all(torch.equal(got_state[k], want_state[k]) for k in got_state), (name, qp)


_REAL_PLAN_FOR = nn_module.plan_for


def test_fsdp2_training_planned_equals_general_2_ranks():
    """Under FSDP2 (gathered quantized weights, refilled by the backward gather) planned calls
    train bitwise as the general path does: losses, parameters and buffers of every rank."""
    from dtq.testing import spawn

    spawn(_check_fsdp2_planned_equals_general, 2, backend="gloo")


def test_a_hybrid_quantized_from_its_rowwise_payload_takes_no_producers_amax_columnwise():
    # its columnwise amax is taken over the dequantized rowwise values, not over x: a producer's
    # max|x| (or a gather's max|w|) stands for the rowwise direction only (it stood for both before)
    from dtq.nn.slot import tensor_amax_directions

    rows, cols = dtq.Float8Quantizer(), dtq.Float8Quantizer()
    dirs, shape = ("rowwise", "columnwise"), (32, 64)
    assert tensor_amax_directions(dtq.HybridQuantizer(rowwise=rows, columnwise=cols), dirs, shape) == dirs
    derived = dtq.HybridQuantizer(rowwise=rows, columnwise=cols, columnwise_source="rowwise_dequantized")
    assert tensor_amax_directions(derived, dirs, shape) == ("rowwise",)
