"""The eager GEMM path's host-time shortcuts keep results bitwise: the per-slots GemmCall cache, the
planned calls (dtq.nn.linear_plan), the no-recipe path on the weight's plain data, outputs
returned without a reshape."""

import copy

import pytest
import torch

import dtq
from dtq.codec import QuantizePlan

K, N = 64, 32


def _recipes():
    return [dtq.Float8CurrentScaling(), dtq.MXFP8BlockScaling()]


def _step(module, x, recipe, *, x_grad: bool, w_grad: bool, no_grad: bool):
    """Output and gradients (x, weight, bias) of one call; None where none is computed."""
    module.weight.requires_grad_(w_grad)
    x = x.detach().clone().requires_grad_(x_grad)
    with dtq.autocast(recipe, enabled=recipe is not None), torch.set_grad_enabled(not no_grad):
        y = module(x)
    if y.requires_grad:
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
    grads = (x.grad, module.weight.grad, module.bias.grad if module.bias is not None else None)
    for p in module.parameters():
        p.grad = None
    return y.detach(), grads


def _equal(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("bias", [False, True])
def test_cached_calls_follow_grad_mode_requires_grad_and_recipe(bias, monkeypatch):
    """Each call matches a fresh module's (which has nothing cached) whatever the calls before it
    asked for, down to the directions it quantizes: a cached GemmCall that kept another call's
    gradient flags or recipe would differ."""
    made = []
    real = QuantizePlan.__call__

    def spy(plan, xc, given, seed):  # every quantization, planned or not, runs a QuantizePlan
        made.append((type(plan.q).__name__, plan.directions))
        return real(plan, xc, given, seed)

    monkeypatch.setattr(QuantizePlan, "__call__", spy)
    torch.manual_seed(0)
    module = dtq.nn.Linear(K, N, bias=bias, params_dtype=torch.bfloat16)
    x = torch.randn(32, K, dtype=torch.bfloat16)
    flags = [(True, True, False), (False, True, False), (True, False, False), (True, True, True), (True, True, False)]
    for recipe in [*_recipes(), None, _recipes()[0]]:
        for x_grad, w_grad, no_grad in flags:
            fresh = copy.deepcopy(module)
            fresh._slot_cache = {}
            made.clear()
            got = _step(module, x, recipe, x_grad=x_grad, w_grad=w_grad, no_grad=no_grad)
            got_made = list(made)
            made.clear()
            want = _step(fresh, x, recipe, x_grad=x_grad, w_grad=w_grad, no_grad=no_grad)
            assert got_made == made, (recipe, x_grad, w_grad, no_grad)
            dgrad, wgrad = x_grad and not no_grad, w_grad and not no_grad
            both, row, col = ("rowwise", "columnwise"), ("rowwise",), ("columnwise",)
            expect = [both if wgrad else row, both if dgrad else row]  # x, then the weight
            if dgrad or wgrad:
                expect.append(both if dgrad and wgrad else row if dgrad else col)  # dy
            assert [d for _, d in made] == (expect if recipe is not None else []), (recipe, x_grad, w_grad, no_grad)
            assert torch.equal(got[0], want[0])
            assert all(_equal(g, w) for g, w in zip(got[1], want[1])), (recipe, x_grad, w_grad, no_grad)
            expect_dx = x_grad and not no_grad
            expect_dw = w_grad and not no_grad
            assert (got[1][0] is not None) == expect_dx and (got[1][1] is not None) == expect_dw
    module.weight.requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(8, K), (2, 4, K)])
def test_no_recipe_is_torch_linear_bitwise(dtype, bias, shape):
    """Outside dtq.autocast the module is torch's linear on the weight's data: outputs, gradients
    (accumulated over two backward passes) and the gradient's layout are torch.nn.Linear's."""
    torch.manual_seed(1)
    ref = torch.nn.Linear(K, N, bias=bias, dtype=dtype)
    module = dtq.nn.Linear(K, N, bias=bias, params_dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(ref.weight)
        if bias:
            module.bias.copy_(ref.bias)
    x = torch.randn(*shape, dtype=dtype)
    for _ in range(2):
        xr, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr = ref(xr)
        with dtq.autocast(enabled=False):
            yd = module(xd)
        g = torch.randn_like(yr)
        yr.backward(g)
        yd.backward(g)
        assert torch.equal(yd, yr) and torch.equal(xd.grad, xr.grad)
    assert torch.equal(module.weight.grad, ref.weight.grad)
    assert module.weight.grad.stride() == ref.weight.grad.stride()
    assert type(module.weight.grad) is torch.Tensor
    if bias:
        assert torch.equal(module.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("bias", [False, True])
def test_output_is_not_a_view_and_matches_flattened_input(bias):
    """The output of a 2-D input is the GEMM's own tensor, of a 3-D input a reshape that is not a
    view (FSDP2 warns about views); both give the bits of the same rows as one 2-D input."""
    torch.manual_seed(2)
    module = dtq.nn.Linear(K, N, bias=bias, params_dtype=torch.bfloat16)
    x = torch.randn(2, 16, K, dtype=torch.bfloat16)
    outs = []
    for inp in (x.reshape(32, K), x):
        inp = inp.clone().requires_grad_()
        with dtq.autocast(dtq.Float8CurrentScaling()):
            y = module(inp)
        assert not y._is_view() and y.shape == (*inp.shape[:-1], N)
        y.backward(torch.ones_like(y))
        outs.append((y.reshape(32, N), inp.grad.reshape(32, K), module.weight.grad))
        module.weight.grad = None
    for a, b in zip(*outs):
        assert torch.equal(a, b)
