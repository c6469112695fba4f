"""Per-tensor FP8 codes written transposed by the quantize launch (``quantize_plan(...,
transposed=True)``, the ``data_t`` field a GEMM's columnwise operand carries): bitwise the
transpose of the codes the plain launch writes, beside rowwise payloads bitwise the plain ones,
for every input dtype, both FP8 element types, power-of-two scales, given amaxes, special values,
partial tiles, shapes the specialised kernel takes and shapes that take the quantize-then-transpose
fall-back, and the generic kernel. On the CPU the option changes nothing (no kernel writes them)."""

from __future__ import annotations

import pytest
import torch

import dtq
from dtq import kernels
from dtq.codec import COLUMNWISE, DIRECTIONS, ROWWISE, quantize_plan

needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.available("cuda"),
    reason="the kernels need a CUDA GPU with sm_90 (CPU-only here)",
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _input(shape, dtype, specials: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g) * 3
    if specials:  # saturation, zeros, infinities and a NaN (canonical 0x7F codes, scale 1)
        x[0, :5] = torch.tensor([1e30, -1e30, 0.0, float("inf"), -float("inf")])
        x[-1, -1] = float("nan")
    return x.to(dtype).cuda()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "q",
    [dtq.Float8Quantizer(), dtq.Float8Quantizer(torch.float8_e5m2, pow2_scales=True)],
    ids=["e4m3", "e5m2_pow2"],
)
@pytest.mark.parametrize("shape", [(256, 384), (48, 160), (16, 16), (40, 96), (130, 64)])
@pytest.mark.parametrize("generic", [False, True])
def test_transposed_codes_are_the_plain_codes_transposed(dtype, q, shape, generic, monkeypatch):
    if generic:  # the generic kernel (then the fall-back transpose) instead of the specialised pair
        monkeypatch.setenv("DTQ_GENERIC_QUANTIZE", "1")
    dev = torch.device("cuda")
    for specials in (False, True):
        x = _input(shape, dtype, specials)
        plain = quantize_plan(q, DIRECTIONS, shape, dtype, dev)
        plan = quantize_plan(q, DIRECTIONS, shape, dtype, dev, transposed=True)
        assert plan.transposed and not plain.transposed
        for given in ({}, {ROWWISE: x.float().abs().amax() * 2}):
            want, got = plain(x, dict(given), None), plan(x, dict(given), None)
            for d in DIRECTIONS:
                for name in ("data", "scale_inv"):
                    assert torch.equal(_bits(got[d][name]), _bits(want[d][name])), (d, name, specials, given)
            t = got[COLUMNWISE]["data_t"]
            assert t.shape == (shape[1], shape[0]) and t.is_contiguous() and t.dtype == q.dtype
            assert torch.equal(_bits(t), _bits(want[COLUMNWISE]["data"].t())), (specials, given)
            assert "data_t" not in got[ROWWISE]


@needs_kernels
def test_only_identical_direction_formats_write_transposed_codes():
    """A format whose directions differ (MXFP8: blocks along different dims) has no such field."""
    plan = quantize_plan(dtq.MXFP8Quantizer(), DIRECTIONS, (64, 64), torch.bfloat16, torch.device("cuda"), True)
    assert not plan.transposed
    assert "data_t" not in plan(torch.randn(64, 64, dtype=torch.bfloat16, device="cuda"), {}, None)[COLUMNWISE]


def test_on_the_cpu_the_option_changes_nothing():
    q = dtq.Float8Quantizer()
    x = torch.randn(32, 48, dtype=torch.bfloat16)
    plan = quantize_plan(q, DIRECTIONS, (32, 48), torch.bfloat16, torch.device("cpu"), transposed=True)
    assert not plan.transposed
    got, want = plan(x, {}, None), q.quantize(x)
    assert set(got[COLUMNWISE]) == {"data", "scale_inv"}
    assert torch.equal(_bits(got[ROWWISE]["data"]), _bits(want.payload(ROWWISE)["data"]))


@pytest.mark.parametrize("shape", [(32, 48), (1, 16), (16, 1)])
def test_transposed_codes_op_is_a_fresh_transposed_copy(shape):
    """``dtq::transposed_codes`` (what compiled graphs call for ``data_t``): the transposed codes,
    contiguous and never aliasing its input (a [1, K] transpose is a view, so the op copies), with
    a fake implementation torch's op checks accept (uint8: the CPU checks cannot do FP8 arithmetic)."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.dtq.transposed_codes.default, (codes,))
    x = codes.view(torch.float8_e4m3fn)
    t = kernels.transposed_codes(x)
    assert t.shape == (shape[1], shape[0]) and t.is_contiguous() and t.dtype == x.dtype
    assert t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(_bits(t), _bits(x.t()))
