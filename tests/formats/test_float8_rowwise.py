"""FP8 row-wise scaling (``Float8RowwiseQuantizer`` / ``Float8RowwiseScaling``): the bits of the
reference on hand-computed cases, the per-column amax that shards share, and which GEMM operand
layouts Hopper's row-wise scaled GEMM can take. (Every generic property, shard = slice, FSDP2,
sequence parallel, master weights, checkpoints, runs over this format in the suites shared by all
formats.)"""

import pytest
import torch

import dtq
from dtq.gemm import Operand, _row_scales

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _codes(p):
    return p["data"].float()


def test_scales_per_row_and_per_column_exact_values():
    # Every scaled value is an E4M3 number: the codes are exact, scales are 448 / amax.
    x = torch.tensor([[1.0, -2.0, 4.0], [0.5, 0.25, 0.0]])
    t = dtq.Float8RowwiseQuantizer().quantize(x)
    r, c = t.payload("rowwise"), t.payload("columnwise")
    assert r["scale_inv"].shape == (2, 1) and c["scale_inv"].shape == (1, 3)
    assert torch.equal(r["scale_inv"], torch.reciprocal(torch.tensor([[112.0], [896.0]])))
    assert torch.equal(_codes(r), torch.tensor([[112.0, -224.0, 448.0], [448.0, 224.0, 0.0]]))
    assert torch.equal(c["scale_inv"], torch.reciprocal(torch.tensor([[448.0, 224.0, 112.0]])))
    assert torch.equal(_codes(c), torch.tensor([[448.0, -448.0, 448.0], [224.0, 56.0, 0.0]]))
    assert torch.equal(t.dequantize(direction="rowwise"), x) and torch.equal(t.dequantize(direction="columnwise"), x)


def test_rounding_zero_nan_inf_and_pow2():
    q = dtq.Float8RowwiseQuantizer()
    # 0.3 * 448 = 134.4: E4M3 neighbours 128 and 144 (step 16 in [128, 256)), nearest 128
    assert _codes(q.quantize(torch.tensor([[1.0, 0.3]]), columnwise=False).payload("rowwise")).tolist() == [
        [448.0, 128.0]
    ]
    p = q.quantize(torch.tensor([[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]]), columnwise=False).payload(
        "rowwise"
    )
    # amax 0 or non-finite -> scale 1; NaN -> code 0x7F; inf saturates to 448
    assert torch.equal(p["scale_inv"], torch.ones(3, 1))
    assert p["data"].view(torch.uint8)[1, 0].item() == 0x7F
    assert p["data"][2].float().tolist() == [448.0, 1.0]
    # pow2: 448 / 3 = 149.3 rounds down to 128; E5M2 max 57344
    p = (
        dtq.Float8RowwiseQuantizer(pow2_scales=True)
        .quantize(torch.tensor([[3.0, 1.0]]), columnwise=False)
        .payload("rowwise")
    )
    assert p["scale_inv"].item() == 1 / 128 and _codes(p).tolist() == [[384.0, 128.0]]
    p = dtq.Float8RowwiseQuantizer(E5).quantize(torch.tensor([[2.0, 1.0]]), columnwise=False).payload("rowwise")
    assert p["data"].dtype == E5 and _codes(p).tolist() == [[57344.0, 28672.0]]


def test_shards_share_the_column_amax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-3, 3, 32)
    q = dtq.Float8RowwiseQuantizer()
    amax = q.local_amax(x)
    assert set(amax) == {"columnwise"} and amax["columnwise"].shape == (1, 32)  # rowwise needs nothing global
    whole = q.quantize(x)
    shard = q.quantize(x[16:32], amax=amax)
    for d in whole.directions:
        for k, v in whole[16:32].payload(d).items():
            assert torch.equal(shard.payload(d)[k].view(torch.uint8), v.view(torch.uint8)), (d, k)
    with pytest.raises(
        ValueError,
        match=r"the columnwise amax has shape \[\], but a tensor viewed as \[M, K\] = "
        r"\[64, 32\] needs \[1, 32\] for Float8RowwiseQuantizer",
    ):
        q.quantize(x, amax=torch.tensor(3.0))


def test_recipe_quantizers():
    role = lambda t: dtq.QuantizerRole("linear", t, "l")  # noqa: E731
    r = dtq.Float8RowwiseScaling()
    assert all(r.quantizer(role(t)) == dtq.Float8RowwiseQuantizer() for t in ("input", "weight", "grad_output"))
    h = dtq.Float8RowwiseScaling(fp8_format="HYBRID", pow2_scales=True)
    assert h.quantizer(role("grad_output")) == dtq.Float8RowwiseQuantizer(E5, pow2_scales=True)
    with pytest.raises(ValueError, match="Float8RowwiseScaling: fp8_format='E5M2'"):
        dtq.Float8RowwiseScaling(fp8_format="E5M2")
    with pytest.raises(ValueError, match="Float8RowwiseQuantizer: dtype=torch.bfloat16 is not an FP8 element type"):
        dtq.Float8RowwiseQuantizer(torch.bfloat16)


def test_row_scaled_operands_of_the_three_gemms():
    """The operand layouts dtq's Linear uses give one scale per row of op(A) and column of op(B)
    (what torch._scaled_mm's row-wise scaling applies after the product); the others do not."""
    q = dtq.Float8RowwiseQuantizer()
    x, w, dy = (q.quantize(torch.randn(s)) for s in ((32, 64), (48, 64), (32, 48)))
    gemms = {
        "fprop": (Operand(x), Operand(w, transpose=True)),
        "dgrad": (Operand(dy), Operand(w, "columnwise")),
        "wgrad": (Operand(dy, "columnwise", transpose=True), Operand(x, "columnwise")),
    }
    for name, (a, b) in gemms.items():
        assert _row_scales(a, False) and _row_scales(b, True), name
    # a direction whose scales run along the contraction dim
    assert not _row_scales(Operand(x, "columnwise"), False)
    assert not _row_scales(Operand(w, "columnwise", transpose=True), True)
    # per-tensor FP8 broadcasts; block formats are not row-scaled
    assert _row_scales(Operand(dtq.Float8Quantizer().quantize(torch.randn(48, 64)), transpose=True), True)
    assert not _row_scales(Operand(dtq.MXFP8Quantizer().quantize(torch.randn(32, 64))), False)
