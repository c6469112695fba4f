"""The emulated NVFP4 GEMMs' per-operand factor 1 / S_enc in one launch (``dtq.kernels.inverse_scale``)
against its reference (``torch.reciprocal(dtq._bits.per_tensor_scale(...))``, seven torch ops), bit
for bit: zeros of both signs, NaN, infinities, negative and subnormal amaxes, amaxes so small that
``fmax / amax`` overflows to the fp32 cap, random amaxes over the whole exponent range, every
``fmax`` an NVFP4 quantizer can have, and the 0-dim, per-row and per-column shapes the codec passes.
An NVFP4 Linear (Hadamard wgrad operands, row-scaled weights) then computes bitwise the same
outputs and gradients with the kernel and with the reference."""

from __future__ import annotations

import pytest
import torch

import dtq
from dtq import _bits, kernels
from dtq.formats import nvfp4

needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.available("cuda"),
    reason="the kernels need a CUDA GPU with sm_90 (CPU-only here)",
)


def _reference(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    return torch.reciprocal(_bits.per_tensor_scale(amax, fmax, pow2=False))


def _amaxes() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    random = torch.rand(4096, generator=g) * torch.exp2(torch.randint(-149, 128, (4096,), generator=g).float())
    special = torch.tensor(
        [0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1.0, 1e-45, 1e-40, 1e-38, 1e-36, 3e-36]
        + [1.0, 6.0, 448.0, 2688.0, 3.4028234663852886e38, 1.17549435e-38, 5.877472e-39]
    )
    return torch.cat([special, random, -random[:64]]).float()


def _bits32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32).cpu()


@needs_kernels
@pytest.mark.parametrize("e4m3_max", [448.0, 256.0, 224.0, 1.0])
def test_matches_reference(e4m3_max):
    fmax = e4m3_max * 6.0
    a = _amaxes().cuda()
    got = kernels.inverse_scale(a, fmax)
    assert torch.equal(_bits32(got), _bits32(_reference(a, fmax)))
    for shape in [(), (1,), (7, 1), (1, 5)]:  # per tensor, per row, per column
        x = a[: max(1, torch.Size(shape).numel())].reshape(shape)
        out = kernels.inverse_scale(x, fmax)
        assert out.shape == x.shape and torch.equal(_bits32(out), _bits32(_reference(x, fmax))), shape
    col = a[:64].reshape(8, 8).t()  # non-contiguous: copied first
    assert torch.equal(_bits32(kernels.inverse_scale(col, fmax)), _bits32(_reference(col, fmax)))
    assert kernels.inverse_scale(a[:0], fmax).numel() == 0


def _linear_run(q, x, w, dy):
    recipe = dtq.CustomRecipe(lambda role: q)
    lin = dtq.nn.Linear(w.shape[1], w.shape[0], bias=False, name="fc", device="cuda", params_dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    xx = x.clone().requires_grad_(True)
    with dtq.autocast(recipe):
        y = lin(xx)
    y.backward(dy)
    return y, xx.grad, lin.weight.grad


@needs_kernels
@pytest.mark.parametrize(
    "q",
    [
        dtq.NVFP4Quantizer((1, 16)),
        dtq.NVFP4Quantizer((1, 16), random_hadamard=True),
        dtq.NVFP4Quantizer((1, 16), row_scaled=True),
        dtq.NVFP4Quantizer((16, 16), e4m3_max=256.0),
    ],
    ids=["1x16", "hadamard", "row_scaled", "16x16"],
)
def test_nvfp4_linear_same_bits_as_reference(q, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(128, 256, device="cuda", generator=g).bfloat16()
    w = torch.randn(192, 256, device="cuda", generator=g).bfloat16()
    dy = torch.randn(128, 192, device="cuda", generator=g).bfloat16()
    calls = []
    real = kernels.inverse_scale

    def counted(amax, fmax):
        calls.append(amax.shape)
        return real(amax, fmax)

    monkeypatch.setattr(kernels, "inverse_scale", counted)
    fast = _linear_run(q, x, w, dy)
    assert calls, "the emulated GEMMs did not take the factor from the kernel"
    monkeypatch.setattr(kernels, "inverse_scale", lambda amax, fmax: None)  # the torch ops
    ref = _linear_run(q, x, w, dy)
    for a, b in zip(fast, ref):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_reference_runs_where_the_kernel_does_not():
    a = _amaxes()
    assert kernels.inverse_scale(a, 2688.0) is None  # CPU tensors
    q = dtq.NVFP4Quantizer()
    assert torch.equal(_bits32(nvfp4.inverse_global_scale(a, q)), _bits32(_reference(a, 2688.0)))
