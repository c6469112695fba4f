"""GEMM dispatch: every pairing of formats runs for all three GEMMs; native paths, where the device
has them, are taken and agree with emulation."""

import pytest
import torch

import dtq
from dtq.gemm import Operand, mm, record_paths

from _quantizers import ALL, IDS

M, K, N = 64, 128, 96
torch.manual_seed(0)
X, W, DY = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _gemms(qa, qb):
    """(name, A operand, B operand, exact fp64 product of the dequantized operands) per GEMM."""
    xq, wq = qa.quantize(X, seed=1), qb.quantize(W, seed=2)
    gq = qa.quantize(DY, seed=3)
    d = lambda t, dirn: t.dequantize(torch.float64, direction=dirn)  # noqa: E731
    return [
        ("fprop", Operand(xq, "rowwise"), Operand(wq, "rowwise", transpose=True), d(xq, "rowwise") @ d(wq, "rowwise").T),
        ("dgrad", Operand(gq, "rowwise"), Operand(wq, "columnwise"), d(gq, "rowwise") @ d(wq, "columnwise")),
        ("wgrad", Operand(gq, "columnwise", transpose=True), Operand(xq, "columnwise"),
         d(gq, "columnwise").T @ d(xq, "columnwise")),
    ]


@pytest.mark.parametrize("qa", ALL, ids=IDS)
@pytest.mark.parametrize("qb", ALL, ids=IDS)
def test_every_pairing_runs_on_cpu(qa, qb):
    for name, a, b, ref in _gemms(qa, qb):
        with record_paths() as paths:
            out = mm(a, b, torch.float32)
        assert paths == ["emulated"]
        # fp32 accumulation over at most 128 products of exactly representable values:
        # relative error far below 1e-5 (float32 epsilon is 1.2e-7).
        assert _rel(out, ref) < 1e-5, (name, _rel(out, ref))


def test_plain_high_precision_operand_and_shape_error():
    q = dtq.MXFP8Quantizer()
    out = mm(Operand(q.quantize(X), "rowwise"), Operand(W, transpose=True))
    assert _rel(out, q.quantize(X).dequantize(torch.float64) @ W.double().T) < 1e-5
    with pytest.raises(ValueError, match=r"op\(A\) is \[64, 128\].*op\(B\) is \[96, 128\]"):
        mm(Operand(q.quantize(X)), Operand(W))


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                          reason="needs an FP8-capable GPU (sm_89+)")


@cuda
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_tensorwise_native_path_agrees_with_emulation(out_dtype, grad_dtype):
    fwd, bwd = dtq.Float8Quantizer(), dtq.Float8Quantizer(grad_dtype)
    x, w, dy = X.cuda() * 3, W.cuda(), DY.cuda() * 1e-3
    xq, wq, gq = fwd.quantize(x), fwd.quantize(w), bwd.quantize(dy)
    cases = [(Operand(xq), Operand(wq, transpose=True)), (Operand(gq), Operand(wq, "columnwise")),
             (Operand(gq, "columnwise", transpose=True), Operand(xq, "columnwise"))]
    for a, b in cases:
        with record_paths() as paths:
            native = mm(a, b, out_dtype)
        assert paths == ["fp8_tensorwise_scaled_mm"]
        emulated = dtq.gemm._emulated(a, b, torch.float32)
        # Same exact products, but Hopper's FP8 tensor cores accumulate a 128-deep chunk with about
        # 14 mantissa bits before promoting to fp32 (2**-13 ~ 1.2e-4 relative; measured 1.3e-4 on an
        # H200); a bf16 output adds its own rounding (2**-9).
        tol = 5e-4 if out_dtype == torch.float32 else 4e-3
        assert _rel(native, emulated) < tol


hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                            reason="needs a Hopper GPU (sm_90) for cuBLAS blockwise FP8")


@hopper
@pytest.mark.parametrize("shape", [(256, 512, 384), (128, 384, 256), (384, 256, 640)], ids=str)
@pytest.mark.parametrize("w_block", [(128, 128), (1, 128)])
def test_fp8_blockwise_native_path_agrees_with_emulation(shape, w_block):
    m, k, n = shape
    a_q, w_qz = dtq.Float8BlockQuantizer((1, 128)), dtq.Float8BlockQuantizer(w_block)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-2, 2, k, device="cuda")
    w, dy = torch.randn(n, k, device="cuda", generator=g), torch.randn(m, n, device="cuda", generator=g)
    xq, wq, gq = a_q.quantize(x), w_qz.quantize(w), a_q.quantize(dy)
    cases = [(Operand(xq), Operand(wq, transpose=True)), (Operand(gq), Operand(wq, "columnwise")),
             (Operand(gq, "columnwise", transpose=True), Operand(xq, "columnwise"))]
    for a, b in cases:
        with record_paths() as paths:
            native = mm(a, b, torch.float32)
        assert paths == ["fp8_blockwise_scaled_mm"], paths
        # Per-block scales are applied exactly (powers of two); the difference is the FP8 tensor
        # cores' ~14-bit accumulation within each 128-deep block (see the tensorwise test).
        assert _rel(native, dtq.gemm._emulated(a, b, torch.float32)) < 5e-4


@cuda
def test_modules_take_native_path_on_gpu():
    lin = dtq.nn.Linear(K, N).cuda()
    with record_paths() as paths, dtq.autocast(dtq.Float8CurrentScaling()):
        lin(torch.randn(M, K, device="cuda", requires_grad=True)).sum().backward()
    assert paths == ["fp8_tensorwise_scaled_mm"] * 3
    if torch.cuda.get_device_capability()[0] == 9:
        lin = dtq.nn.Linear(256, 384).cuda()
        with record_paths() as paths, dtq.autocast(dtq.Float8BlockScaling()):
            lin(torch.randn(128, 256, device="cuda", requires_grad=True)).sum().backward()
        assert paths == ["fp8_blockwise_scaled_mm"] * 3
