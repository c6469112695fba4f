"""Planned FP8 per-tensor calls run as one C++ autograd function (dtq/nn/linear_native.py,
csrc/linear.cpp) and give the Python plan's bits: output, dx, dw and db, for 2-D and 3-D inputs,
with and without a bias, fp32 and bf16 weights, both fprop accumulations, every gradient
combination, q/k/v reading one input, a producer's amax, recompute, saved tensors on the CPU, and
a backward that builds a graph. GPU only (the kernel library and Hopper's FP8 GEMMs)."""

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dtq
from dtq import kernels
from dtq.nn import linear_native, linear_plan
from tests.nn.test_linear_plan import _bits, _same, _SharedInput

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.available("cuda"), reason="the kernel library and FP8 GEMMs"
)


def _native_ran(y: torch.Tensor) -> bool:
    return y.grad_fn is not None and "NativeLinear" in y.grad_fn.name()


def _layer(bias: bool, w_dtype: torch.dtype, plain_weight: bool = False, n: int = 128):
    torch.manual_seed(0)
    layer = dtq.nn.Linear(64, n, bias=bias, params_dtype=w_dtype, device="cuda")
    if plain_weight:  # a plain Parameter, not dtq's HighPrecisionWeight wrapper
        layer.weight = torch.nn.Parameter(layer.weight.detach().__dtq_unwrap__().clone())
    return layer


def _step(make, x, recipe, native: bool, monkeypatch, *, x_grad=True, w_grad=True, wrap=None, amax=None):
    """A fresh module's forward + backward, the native function on or off; its bits and whether
    the native function ran."""
    with monkeypatch.context() as m:
        m.setattr(linear_native, "enabled", native)
        module = make()
        for p in module.parameters():
            if p.dim() == 2:
                p.requires_grad_(w_grad)
        x = x.detach().clone().requires_grad_(x_grad)
        with (
            dtq.autocast(recipe),
            wrap() if wrap else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            y = module(x) if amax is None else module._linear(x, module.weight, None, x_amax=amax)
        ran = _native_ran(y)
        y.float().pow(2).sum().backward()
    return [_bits(y), _bits(x.grad)] + [_bits(p.grad) for p in module.parameters()], ran


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(64, 64), (4, 16, 64)])
@pytest.mark.parametrize(
    "dtypes", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
)
@pytest.mark.parametrize("fast", [False, True])
def test_native_calls_give_the_python_plans_bits(bias, shape, dtypes, fast, monkeypatch):
    x_dtype, w_dtype = dtypes
    recipe = dataclasses.replace(dtq.Float8CurrentScaling(), fprop_fast_accumulation=fast)
    x = torch.randn(shape, dtype=x_dtype, device="cuda")
    make = lambda: _layer(bias, w_dtype)  # noqa: E731
    # (x, weight) requiring grad: both gradients, dgrad only, wgrad only (dy's columnwise codes
    # alone are written [M, N] by their launch: that plan keeps the Python path)
    for x_grad, w_grad, native in [(True, True, True), (True, False, True), (False, True, False)]:
        want, ran = _step(make, x, recipe, False, monkeypatch, x_grad=x_grad, w_grad=w_grad)
        assert not ran
        got, ran = _step(make, x, recipe, True, monkeypatch, x_grad=x_grad, w_grad=w_grad)
        assert ran == native, (x_grad, w_grad)
        assert _same(got, want), (x_grad, w_grad)


def test_a_plain_parameter_weight_runs_native(monkeypatch):
    recipe = dtq.Float8CurrentScaling()
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    make = lambda: _layer(True, torch.bfloat16, plain_weight=True)  # noqa: E731
    want, _ = _step(make, x, recipe, False, monkeypatch)
    got, ran = _step(make, x, recipe, True, monkeypatch)
    assert ran and _same(got, want)


class _Shared(torch.nn.Module):
    """q, k and v of one x (written in place between q and k where ``write``), x a non-leaf that
    requires grad: every GEMM then needs dgrad and wgrad."""

    def __init__(self, write: bool):
        super().__init__()
        self.inner = _SharedInput(write, "cuda")

    def forward(self, x):
        return self.inner(x * 1.0)


@pytest.mark.parametrize("write", [False, True])
def test_gemms_reading_one_input_quantize_it_once_natively(write, monkeypatch):
    """q, k and v share one quantization of x in the C++ function too (the Python plan's bits, one
    saved copy of x's codes); a write into x between two of them quantizes again."""
    recipe = dtq.Float8CurrentScaling()
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, device="cuda")

    def make():
        torch.manual_seed(0)
        return dtq.convert(_Shared(write))

    want, _ = _step(make, x, recipe, False, monkeypatch)
    got, _ = _step(make, x, recipe, True, monkeypatch)
    assert _same(got, want)
    module, saved = make(), []
    pack = lambda t: saved.append(t) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dtq.autocast(recipe):
        y = module(x.clone().requires_grad_())
    codes = {t.data_ptr() for t in saved if t.dtype == torch.float8_e4m3fn and t.shape == (64, 32)}
    assert len(codes) == (2 if write else 1), codes  # x's [K, M] codes: one copy per quantization
    y.float().sum().backward()
    with dtq.autocast(recipe):
        assert _native_ran(module.inner.q(x.clone().requires_grad_()))


def test_a_producers_amax_is_read_as_the_python_plan_reads_it(monkeypatch):
    recipe = dtq.Float8CurrentScaling()
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    amax = x.float().abs().max() * 3  # (not max|x|: where taken, the given amax is what scales x)
    make = lambda: _layer(False, torch.bfloat16)  # noqa: E731
    want, _ = _step(make, x, recipe, False, monkeypatch, amax=amax)
    got, ran = _step(make, x, recipe, True, monkeypatch, amax=amax)
    assert ran and _same(got, want)
    assert not _same(got, _step(make, x, recipe, True, monkeypatch)[0])  # (the amax was taken)
    # another shape or dtype of it: the Python path converts it (and names a wrong size)
    other, ran = _step(make, x, recipe, True, monkeypatch, amax=amax.reshape(1).double())
    assert not ran and _same(other, want)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recompute_runs_native_as_its_forward_did(reentrant, monkeypatch):
    recipe = dtq.Float8CurrentScaling()
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, device="cuda")

    def make():
        torch.manual_seed(0)
        inner = torch.nn.Sequential(
            torch.nn.Linear(64, 128, dtype=torch.bfloat16), torch.nn.Linear(128, 64, dtype=torch.bfloat16)
        )
        inner = dtq.convert(inner.cuda())

        class Recomputed(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return checkpoint(self.inner, x, use_reentrant=reentrant)

        return Recomputed()

    want, _ = _step(make, x, recipe, False, monkeypatch)
    got, _ = _step(make, x, recipe, True, monkeypatch)
    assert _same(got, want)


def test_saved_tensors_on_the_cpu(monkeypatch):
    recipe = dtq.Float8CurrentScaling()
    x = torch.randn(64, 64, dtype=torch.bfloat16, device="cuda")
    make = lambda: _layer(True, torch.bfloat16)  # noqa: E731
    wrap = torch.autograd.graph.save_on_cpu
    want, _ = _step(make, x, recipe, False, monkeypatch, wrap=wrap)
    got, ran = _step(make, x, recipe, True, monkeypatch, wrap=wrap)
    assert ran and _same(got, want)


def test_a_backward_that_builds_a_graph_refuses_a_second_backward():
    recipe = dtq.Float8CurrentScaling()
    layer = _layer(False, torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    with dtq.autocast(recipe):
        y = layer(x)
    assert _native_ran(y)
    (dx,) = torch.autograd.grad(y.float().pow(2).sum(), x, create_graph=True)
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.float().sum().backward()
    with dtq.autocast(recipe):
        y = layer(x)
    (dx2,) = torch.autograd.grad(y.float().pow(2).sum(), x)
    assert torch.equal(_bits(dx.detach()), _bits(dx2))


def test_a_new_input_is_quantized_anew(monkeypatch):
    """The C++ side's held input payloads serve only the tensor they were made from, unwritten:
    step after step, each output is the Python plan's of its own input. Python's held payloads
    (linear_plan._LAST) are not touched by native calls."""
    recipe = dtq.Float8CurrentScaling()
    layer = _layer(False, torch.bfloat16)
    python = _layer(False, torch.bfloat16)
    for seed in range(3):
        linear_plan._LAST.entry = None
        torch.manual_seed(seed)
        x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        with dtq.autocast(recipe):
            y = layer(x)
            assert _native_ran(y) and linear_plan._LAST.entry is None
            if seed == 1:
                with torch.no_grad():
                    x.mul_(2)  # (a write: its version moves)
                y = layer(x)
            with monkeypatch.context() as m:
                m.setattr(linear_native, "enabled", False)  # (a plan decides at its first eager call: this one)
                want = python(x.detach())
        assert torch.equal(_bits(y), _bits(want))
        y.float().sum().backward()


def _mlp():
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda", "bias": False}
    return dtq.nn.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu", **kw)


@pytest.mark.parametrize(
    "make, w_grad, launches",
    [
        (lambda: _layer(False, torch.bfloat16), True, {linear_native.WEIGHT}),
        (lambda: _layer(True, torch.bfloat16), False, {linear_native.WEIGHT}),
        # fc2's input and fc1's gradient come out of the SwiGLU kernels, with their amaxes
        (_mlp, True, {linear_native.INPUT, linear_native.WEIGHT, linear_native.GRAD}),
    ],
    ids=["linear", "linear-bias-frozen", "layernorm-mlp"],
)
def test_compiled_quantize_ops_through_the_library_give_the_python_plans_bits(make, w_grad, launches, monkeypatch):
    """A compiled graph's quantize ops (``dtq::planned_weight``, and ``quantize_input`` /
    ``quantize_grad`` where their tensors come out of dtq's SwiGLU kernels) run their launches
    through the kernel library (``linear_native.payloads``) with the Python quantize plans' bits:
    the compiled step's output and gradients with it and without it."""
    recipe = dtq.Float8CurrentScaling()
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16, device="cuda")
    real = linear_native.payloads
    results = {}
    for native in (False, True):
        took = []

        def spy(plan, which, t, known=None, native=native, took=took):
            out = real(plan, which, t, known) if native else None
            took.append((which, out is not None))
            return out

        with monkeypatch.context() as m:
            m.setattr(linear_native, "payloads", spy)
            torch._dynamo.reset()
            module = make()
            for p in module.parameters():
                if p.dim() == 2:
                    p.requires_grad_(w_grad)
            compiled = torch.compile(module, fullgraph=True)
            xc = x.clone().requires_grad_(True)
            with dtq.autocast(recipe):
                y = compiled(xc)
            y.float().pow(2).sum().backward()
        grads = [_bits(p.grad) for p in module.parameters() if p.grad is not None]
        results[native] = [_bits(y), _bits(xc.grad), *grads]
        assert {w for w, _ in took} == launches and all(ok == native for _, ok in took), took
    assert _same(results[True], results[False])
