"""In-place ops on views of a QuantizedTensor (dtq/tensor.py module docstring).

* A dim-0 slice of part of the rows of a tensor with a tensor-wide field (FP8's per-tensor scale,
  NVFP4's amax, FP8 row-wise's columnwise per-column scales) is a *partial view*: every in-place
  write into it is refused before anything is written, since it would rescale the other rows. The
  one write allowed is a same-quantizer copy_ that leaves the other rows' values as they are.
* Formats whose scales are all row-structured (MXFP8, FP8 blocks, FP8 row-wise rowwise only) write
  into a slice's rows and leave every other row bitwise as it was.
* In-place ops on a same-size view of a whole tensor (view(-1), reshape, as_strided) requantize
  the [M, K] matrix the payloads describe: bitwise quantize(the modified whole).
"""

from __future__ import annotations

import io
import re

import pytest
import torch

import dtq

try:
    from _quantizers import assert_payload_equal, bits, payload_rows, randn
except ImportError:  # tests/ imported as a package
    from tests._quantizers import assert_payload_equal, bits, payload_rows, randn

HYBRID = dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer((16, 16)))

# (id, quantizer, quantize kwargs, the shared fields the error names: written from the format docs)
PARTIAL = [
    ("fp8", dtq.Float8Quantizer(), {}, "rowwise scale_inv and columnwise scale_inv (fp8) are"),
    ("nvfp4_1x16", dtq.NVFP4Quantizer(), {}, "rowwise amax and columnwise amax (nvfp4) are"),
    ("nvfp4_16x16", dtq.NVFP4Quantizer((16, 16)), {}, "rowwise amax and columnwise amax (nvfp4) are"),
    ("hybrid_mxfp8_nvfp4", HYBRID, {}, "columnwise amax (nvfp4) is"),
    ("fp8row_both", dtq.Float8RowwiseQuantizer(), {}, "columnwise scale_inv (fp8_row) is"),
]
SAFE = [
    ("mxfp8", dtq.MXFP8Quantizer(), {}),
    ("fp8block_1x128", dtq.Float8BlockQuantizer((1, 128)), {}),
    ("fp8block_128x128", dtq.Float8BlockQuantizer((128, 128)), {}),
    ("fp8row_rowwise_only", dtq.Float8RowwiseQuantizer(), {"columnwise": False}),
]
PARTIAL_QS = [pytest.param(q, kw, id=i) for i, q, kw, _ in PARTIAL]
OPS = ["mul_", "add_", "copy_plain", "copy_quantized", "zero_", "fill_", "foreach_mul_"]
M, K = 384, 128
A, B = 128, 256  # the slice: rows [128, 256), with rows on both sides


def _apply(op, v, q, kw):
    """Run ``op`` in place on ``v``; returns the high-precision rows it should leave (None: see source)."""
    shape = tuple(v.shape)
    if op == "mul_":
        v.mul_(100)
    elif op == "add_":
        v.add_(1)
    elif op == "copy_plain":
        v.copy_(randn(*shape, seed=11))
    elif op == "copy_quantized":
        v.copy_(q.quantize(randn(*shape, seed=12), **kw))
    elif op == "zero_":
        v.zero_()
    elif op == "fill_":
        v.fill_(0.5)
    elif op == "foreach_mul_":
        torch._foreach_mul_([v], 3.0)
    else:
        raise AssertionError(op)


def _expected_rows(op, before, q, kw):
    """What ``op`` leaves in the slice when it is allowed (formats without tensor-wide fields)."""
    rows = before.dequantize()[A:B]
    shape = tuple(rows.shape)
    if op == "copy_quantized":
        return q.quantize(randn(*shape, seed=12), **kw)  # raw payload copy
    value = {
        "mul_": lambda: rows * 100,
        "add_": lambda: rows + 1,
        "copy_plain": lambda: randn(*shape, seed=11),
        "zero_": lambda: torch.zeros(shape),
        "fill_": lambda: torch.full(shape, 0.5),
        "foreach_mul_": lambda: rows * 3.0,
    }[op]()
    return q.quantize(value, **kw)


def _snapshot(t):
    return {d: {k: v.clone() for k, v in t.payload(d).items()} for d in t.directions}


def _assert_unchanged(t, snap):
    for d in t.directions:
        assert_payload_equal(t.payload(d), snap[d], f"{d} payload")


def _message(op, fmt, fields):
    return re.escape(
        f"dtq: {op} cannot write into a {fmt} QuantizedTensor of shape [{B - A}, {K}]: it is a dim-0 "
        f"slice covering rows [{A}, {B}) of the {M} rows of a tensor whose {fields} tensor-wide"
    )


# =================================================================================================
# partial views refuse in-place writes, before writing anything
# =================================================================================================


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("q,kw,fields", [pytest.param(q, kw, f, id=i) for i, q, kw, f in PARTIAL])
def test_write_into_partial_view_is_refused(q, kw, fields, op):
    t = q.quantize(randn(M, K), **kw)
    snap = _snapshot(t)
    name = {"copy_plain": "copy_", "copy_quantized": "copy_", "foreach_mul_": "_foreach_mul_"}.get(op, op)
    with pytest.raises(ValueError, match=_message(name, q.format_name, fields)) as err:
        _apply(op, t[A:B], q, kw)
    msg = str(err.value)
    assert f"change the other {M - (B - A)} rows" in msg
    assert f"w = t.dequantize(); w[{A}:{B}]." in msg and "t.copy_(w)" in msg
    assert "MXFP8, FP8 blocks, FP8 row-wise with the rowwise direction only" in msg
    _assert_unchanged(t, snap)  # nothing written: every row and the tensor-wide fields as they were


@pytest.mark.parametrize("q,kw,fields", [pytest.param(q, kw, f, id=i) for i, q, kw, f in PARTIAL])
def test_foreach_refuses_before_writing_any_tensor(q, kw, fields):
    t = q.quantize(randn(M, K), **kw)
    snap = _snapshot(t)
    plain = torch.ones(8)
    with pytest.raises(ValueError, match=r"_foreach_add_ cannot write into"):
        torch._foreach_add_([plain, t[A:B]], 1.0)
    assert torch.equal(plain, torch.ones(8)), "the plain tensor before the partial view was written"
    _assert_unchanged(t, snap)


@pytest.mark.parametrize("q,kw", PARTIAL_QS)
def test_partial_flag_survives_views(q, kw):
    t = q.quantize(randn(M, K), **kw)
    snap = _snapshot(t)
    v = t[A:B]
    views = {
        "detach": v.detach(),
        "alias": torch.ops.aten.alias(v),
        "view": v.view(2, 64, K),
        "view_flat": v.view(-1),
        "reshape": v.reshape(-1, K),
        "unsafe_view": torch.ops.aten._unsafe_view(v, (2, 64, K)),
        "as_strided": v.as_strided((B - A, K), (K, 1)),
        "slice_of_slice": v[32:96],
        "whole_slice_of_slice": v[:],
        "split": v.split(64)[1],
        "chunk": v.chunk(2)[0],
        "narrow": v.narrow(0, 0, 64),
        "slice_of_view": t.view(3, 128, K)[1:2],
        "with_directions": v.with_directions(v.directions[-1]),
        "split_of_whole": t.split(128)[1],
        "chunk_of_whole": t.chunk(3)[2],
    }
    for name, w in views.items():
        assert type(w) is dtq.QuantizedTensor, name
        with pytest.raises(ValueError, match="cannot write into"):
            w.mul_(2)
        with pytest.raises(ValueError, match="cannot write into"):
            w.zero_()
    _assert_unchanged(t, snap)
    # the rows a nested slice covers are given in the whole tensor's rows
    with pytest.raises(ValueError, match=re.escape(f"rows [{A + 32}, {A + 96}) of the {M} rows")):
        v[32:96].fill_(1.0)


@pytest.mark.parametrize("q,kw", PARTIAL_QS)
def test_results_owning_payloads_are_writable(q, kw):
    t = q.quantize(randn(M, K), **kw)
    snap = _snapshot(t)
    v = t[A:B]
    owned = {
        "clone": v.clone(),
        "to_dtype": v.to(torch.float64),
        "to_copy": v.to("cpu", copy=True),
        "empty_like": torch.empty_like(v),
        "zeros_like": torch.zeros_like(v),
        "new_zeros": v.new_zeros((B - A, K)),
        "new_empty": v.new_empty((B - A, K)),
    }
    for name, w in owned.items():
        assert type(w) is dtq.QuantizedTensor, name
        base = w.dequantize().clone()
        w.mul_(2)
        expect = q.quantize(base * 2, **kw)
        for d in w.directions:
            assert_payload_equal(w.payload(d), expect.payload(d), f"{name} {d}")
        w.zero_()
        assert not w.dequantize().any(), name
    _assert_unchanged(t, snap)
    # a slice covering every row is the whole, not a partial view
    for name, cover in {
        "slice_all": lambda u: u[0:M],
        "split_all": lambda u: u.split(M)[0],
        "narrow_all": lambda u: u.narrow(0, 0, M),
    }.items():
        u = q.quantize(randn(M, K), **kw)
        before = u.dequantize().clone()
        cover(u).add_(1)
        expect = q.quantize(before + 1, **kw)
        for d in u.directions:
            assert_payload_equal(u.payload(d), expect.payload(d), f"{name} {d}")


@pytest.mark.parametrize("q,kw", PARTIAL_QS)
def test_partial_flag_survives_save_load_with_its_whole(q, kw):
    t = q.quantize(randn(M, K), **kw)
    buf = io.BytesIO()
    torch.save({"w": t, "s": t[A:B]}, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    snap = _snapshot(sd["w"])
    with pytest.raises(ValueError, match="cannot write into"):
        sd["s"].mul_(2)
    _assert_unchanged(sd["w"], snap)
    sd["s"].clone().mul_(2)  # an owned copy is writable


# =================================================================================================
# the one safe write: a same-quantizer copy_ that leaves the other rows' values as they are
# =================================================================================================


@pytest.mark.parametrize("q,kw", PARTIAL_QS)
def test_copy_with_equal_tensor_wide_fields_is_allowed(q, kw):
    x = randn(M, K)
    t = q.quantize(x, **kw)
    snap = _snapshot(t)
    amax = q.local_amax(x, rowwise="rowwise" in t.directions, columnwise="columnwise" in t.directions)
    y = randn(B - A, K, seed=7) * 0.5  # within the whole's amax: quantized with it, a slice of some whole
    src = q.quantize(y, amax=amax, **kw)
    t[A:B].copy_(src)
    for d in t.directions:
        for a, b in ((0, A), (B, M)):
            assert_payload_equal(
                payload_rows(q, d, t.payload(d), a, b), payload_rows(q, d, snap[d], a, b), f"{d} {a}:{b}"
            )
        assert_payload_equal(payload_rows(q, d, t.payload(d), A, B), src.payload(d), f"{d} slice")


@pytest.mark.parametrize("q,kw", PARTIAL_QS)
def test_copy_into_zero_rows_is_allowed_once_they_are_not_zero_it_is_refused(q, kw):
    # FSDP2's uneven shard: new_zeros(padded shard).narrow(0, 0, rows).copy_(a chunk of the parameter)
    whole = q.quantize(randn(M, K), **kw)
    padded = whole.new_zeros((B - A + 64, K))
    sharded = padded.narrow(0, 0, B - A)
    sharded.copy_(whole[A:B])
    for d in whole.directions:
        assert_payload_equal(
            payload_rows(q, d, padded.payload(d), 0, B - A), payload_rows(q, d, whole.payload(d), A, B), d
        )
    assert torch.equal(padded.dequantize()[B - A :], torch.zeros(64, K))
    assert torch.equal(bits(sharded.dequantize()), bits(whole.dequantize()[A:B]))
    # the padded buffer's rows outside the shard are zeros; the shard itself is a partial view
    with pytest.raises(ValueError, match="cannot write into"):
        sharded.mul_(2)
    # a buffer filled slice by slice: the second slice's own scale would rescale the first
    buf = torch.empty_like(whole)
    buf[0:128].copy_(q.quantize(randn(128, K, seed=3), **kw))
    snap = _snapshot(buf)
    with pytest.raises(
        ValueError,
        match=r"copy_ cannot write into(.|\n)*A copy_ from a QuantizedTensor of the "
        r"same quantizer is allowed when its tensor-wide values are bitwise",
    ):
        buf[128:256].copy_(q.quantize(randn(128, K, seed=4), **kw))
    _assert_unchanged(buf, snap)


# =================================================================================================
# formats without tensor-wide fields: a slice's write changes only its rows
# =================================================================================================


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("q,kw", [pytest.param(q, kw, id=i) for i, q, kw in SAFE])
def test_write_into_slice_of_row_scaled_format_changes_only_its_rows(q, kw, op):
    t = q.quantize(randn(M, K), **kw)
    snap = _snapshot(t)
    expect = _expected_rows(op, t, q, kw)
    v = t[A:B]
    _apply(op, v, q, kw)
    for d in t.directions:
        for a, b in ((0, A), (B, M)):
            assert_payload_equal(
                payload_rows(q, d, t.payload(d), a, b), payload_rows(q, d, snap[d], a, b), f"{d} rows {a}:{b}"
            )
        assert_payload_equal(payload_rows(q, d, t.payload(d), A, B), expect.payload(d), f"{d} slice")


# =================================================================================================
# in-place ops on a same-size view of the whole: the [M, K] matrix is requantized
# =================================================================================================

WHOLE = [
    pytest.param(dtq.Float8Quantizer(), id="fp8"),
    pytest.param(dtq.MXFP8Quantizer(), id="mxfp8"),
    pytest.param(dtq.NVFP4Quantizer((16, 16)), id="nvfp4_16x16"),
    pytest.param(HYBRID, id="hybrid_mxfp8_nvfp4"),
]
VIEWS = {
    "view_flat": lambda t: t.view(-1),
    "view_3d": lambda t: t.view(2, 32, 128),
    "reshape_other_last_dim": lambda t: t.reshape(128, 64),
    "as_strided_flat": lambda t: t.as_strided((64 * 128,), (1,)),
    "detach_of_flat": lambda t: t.view(-1).detach(),
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("q", WHOLE)
def test_inplace_on_same_size_view_requantizes_the_whole(q, view):
    x = randn(64, 128)
    y = randn(64, 128, seed=9)
    for op, change in [
        ("add_", lambda w: w + 1),
        ("mul_", lambda w: w * 3),
        ("zero_", torch.zeros_like),
        ("fill_", lambda w: torch.full_like(w, -0.75)),
        ("copy_plain", lambda w: y),
        ("copy_other_quantizer", lambda w: y),
        ("foreach_add_", lambda w: w + 2),
    ]:
        t = q.quantize(x)
        before = t.dequantize().clone()
        v = VIEWS[view](t)
        assert type(v) is dtq.QuantizedTensor and v.shape2d == (64, 128)
        if op == "copy_plain":
            out = v.copy_(y.reshape(v.shape))
        elif op == "copy_other_quantizer":  # requantized from its (lossless) values
            out = v.copy_(dtq.IdentityQuantizer().quantize(y.reshape(v.shape)))
        elif op == "foreach_add_":
            torch._foreach_add_([v], 2.0)
            out = v
        else:
            out = {
                "add_": lambda: v.add_(1),
                "mul_": lambda: v.mul_(3),
                "zero_": v.zero_,
                "fill_": lambda: v.fill_(-0.75),
            }[op]()
        assert out is v, op
        expect = q.quantize(change(before))
        for d in t.directions:
            assert_payload_equal(t.payload(d), expect.payload(d), f"{op} {d}")
    # a raw copy between two views of the same [M, K] layout keeps the source's codes
    t, src = q.quantize(x), q.quantize(y)
    VIEWS[view](t).copy_(VIEWS[view](src))
    for d in t.directions:
        assert_payload_equal(t.payload(d), src.payload(d), f"raw copy {d}")


@pytest.mark.parametrize("q", WHOLE)
def test_like_ops_on_a_view_keep_its_matrix(q):
    t = q.quantize(randn(64, 128)).view(-1)
    for z in (torch.zeros_like(t), torch.empty_like(t)):
        assert z.shape == t.shape and z.shape2d == (64, 128)
        assert not z.dequantize().any()
        z.add_(1)
        assert torch.equal(bits(z.dequantize()), bits(q.quantize(torch.ones(64, 128)).dequantize().reshape(-1)))


@pytest.mark.parametrize("q", WHOLE)
def test_unmappable_write_describes_the_actual_tensor(q):
    t = q.quantize(randn(64, 128))
    snap = _snapshot(t)
    v = t.view(-1)
    with pytest.raises(ValueError) as err:
        v.copy_(torch.ones(3))
    msg = str(err.value)
    assert f"a {q.format_name} QuantizedTensor of shape [8192]" in msg, msg
    assert "its payloads describe the [M, K] = [64, 128] matrix" in msg, msg
    assert "[1, 8192]" not in msg, msg
    _assert_unchanged(t, snap)


@pytest.mark.parametrize("q", WHOLE + [pytest.param(dtq.Float8RowwiseQuantizer(), id="fp8row")])
def test_update_usage_on_a_view_builds_the_matrix_direction(q):
    x = randn(64, 128)
    v = q.quantize(x, columnwise=False).view(-1)
    v.update_usage(columnwise=True, source=x.view(-1))
    assert_payload_equal(v.payload("columnwise"), q.quantize(x).payload("columnwise"), "columnwise")
