"""QuantizedTensor dispatch policy (dtq/tensor.py module docstring, docs/design.md sections 2 and 6),
for every quantizer of tests/_quantizers.py."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

import dtq

try:
    from _quantizers import (
        QUANTIZERS,
        SEED,
        assert_payload_equal,
        assert_qt_equal,
        bits,
        by_id,
        params,
        payload_rows,
        quantize,
        randn,
        ref_dequantize,
        rows_per_payload_row,
        shape2d,
        storage_ptr,
        sub,
        uses_rht,
        uses_sr,
    )
except ImportError:  # tests/ imported as a package
    from tests._quantizers import (
        QUANTIZERS,
        SEED,
        assert_payload_equal,
        assert_qt_equal,
        bits,
        by_id,
        params,
        payload_rows,
        quantize,
        randn,
        ref_dequantize,
        rows_per_payload_row,
        shape2d,
        storage_ptr,
        sub,
        uses_rht,
        uses_sr,
    )

SHAPES = [pytest.param((256, 384), id="256x384"), pytest.param((4, 64, 256), id="4x64x256")]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _fresh_warning_registry(monkeypatch):
    # dtq warns about a misaligned slice once per (format, direction) and process; every test that
    # expects the warning must see it regardless of test order.
    monkeypatch.setattr(dtq._warn, "_warned", set())


def _tensors(t):
    """Every payload tensor of a QuantizedTensor as ((direction, field), tensor)."""
    return [((d, k), v) for d in t.directions for k, v in t.payload(d).items()]


def _ptrs(t):
    return {key: v.data_ptr() for key, v in _tensors(t)}


def _assert_shares_storage(a, b):
    for (key, va), (_, vb) in zip(_tensors(a), _tensors(b)):
        assert storage_ptr(va) == storage_ptr(vb), f"{key} does not share storage"


def _assert_owns_storage(a, b):
    for (key, va), (_, vb) in zip(_tensors(a), _tensors(b)):
        assert storage_ptr(va) != storage_ptr(vb), f"{key} shares storage with the source"


def _rows_per_index(shape):
    return math.prod(shape[1:-1])


def _block_rows(q, direction):
    """dim-0 alignment from the documented payload layouts (independent of Quantizer.block_rows)."""
    s = sub(q, direction)
    fields = {
        "Float8Quantizer": ("data", "scale_inv"),
        "Float8BlockQuantizer": ("data", "scale_inv"),
        "Float8RowwiseQuantizer": ("data", "scale_inv"),
        "MXFP8Quantizer": ("data", "scale"),
        "NVFP4Quantizer": ("data", "scale", "amax"),
        "IdentityQuantizer": ("data",),
    }[type(s).__name__]
    return max(r or 1 for r in (rows_per_payload_row(q, direction, f) for f in fields))


# =================================================================================================
# detach / clone / *_like / to
# =================================================================================================


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params())
def test_detach_shares_payloads(q, shape):
    t = quantize(q, randn(*shape))
    d = t.detach()
    assert type(d) is dtq.QuantizedTensor and d is not t
    assert d.quantizer == t.quantizer and d.directions == t.directions
    assert d.shape == t.shape and d.dtype == t.dtype
    for (key, a), (_, b) in zip(_tensors(d), _tensors(t)):
        assert a.data_ptr() == b.data_ptr(), key
    assert_qt_equal(d, t)


@pytest.mark.parametrize("q", params())
def test_clone_copies_payloads(q):
    x = randn(256, 384)
    t = quantize(q, x)
    c = t.clone()
    assert type(c) is dtq.QuantizedTensor
    assert_qt_equal(c, t)
    _assert_owns_storage(c, t)
    c.zero_()  # writing the clone leaves the source alone
    assert_qt_equal(t, quantize(q, x))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params())
def test_new_like_ops_keep_subclass_and_draw_no_random_numbers(q, shape):
    t = quantize(q, randn(*shape))
    half = (shape[0] // 2, *shape[1:])
    ops = {
        "empty_like": lambda: torch.empty_like(t),
        "zeros_like": lambda: torch.zeros_like(t),
        "new_zeros": lambda: t.new_zeros(half),
        "new_empty": lambda: t.new_empty(half),
        "empty_like_bf16": lambda: torch.empty_like(t, dtype=torch.bfloat16),
    }
    for name, op in ops.items():
        state = torch.get_rng_state()
        out = op()
        assert torch.equal(torch.get_rng_state(), state), f"{name} consumed random numbers"
        assert type(out) is dtq.QuantizedTensor, name
        assert out.quantizer == t.quantizer and out.directions == t.directions, name
        assert tuple(out.shape) == (half if name.startswith("new") else shape), name
        assert out.dtype == (torch.bfloat16 if name.endswith("bf16") else t.dtype), name
        for d in out.directions:
            assert not out.dequantize(direction=d).any(), f"{name} {d} is not zero"


def test_stochastic_rounding_quantize_does_draw_random_numbers():
    # Counterpart of the RNG check above: with seed=None, SR quantization does consume the
    # generator, so an empty_like implemented as quantize(zeros) would be caught.
    q, x = by_id("nvfp4_sr"), randn(64, 64)
    state = torch.get_rng_state()
    q.quantize(x)
    assert not torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("q", params())
def test_to_dtype_changes_nominal_dtype_only(q):
    t = quantize(q, randn(4, 64, 256))
    u = t.to(torch.bfloat16)
    assert type(u) is dtq.QuantizedTensor
    assert u.dtype == torch.bfloat16 and u.shape == t.shape
    assert u.quantizer == t.quantizer and u.directions == t.directions
    for d in t.directions:
        assert_payload_equal(u.payload(d), t.payload(d), d)
        assert torch.equal(u.dequantize(direction=d), t.dequantize(direction=d).to(torch.bfloat16))
    back = u.to(torch.float32)
    assert back.dtype == torch.float32
    assert_qt_equal(back, t)


@pytest.mark.parametrize("q", params())
def test_to_cpu_keeps_subclass_and_copies(q):
    t = quantize(q, randn(256, 384))
    # Already on CPU: like a plain tensor, .cpu() / .to("cpu") may return the tensor itself; if they
    # return something else it must be a full copy.
    for r in (t.cpu(), t.to("cpu")):
        assert type(r) is dtq.QuantizedTensor
        assert_qt_equal(r, t)
        if r is not t:
            _assert_owns_storage(r, t)
    # an explicit copy goes through _to_copy: every payload copied, subclass kept
    for r in (t.to("cpu", copy=True), torch.ops.aten._to_copy.default(t), t.to(torch.device("cpu"), copy=True)):
        assert type(r) is dtq.QuantizedTensor and r is not t
        assert_qt_equal(r, t)
        _assert_owns_storage(r, t)


@cuda
@pytest.mark.parametrize("q", params())
def test_pin_memory(q):
    t = quantize(q, randn(256, 384))
    p = t.pin_memory()
    assert type(p) is dtq.QuantizedTensor and p.is_pinned()
    assert all(v.is_pinned() for _, v in _tensors(p))
    assert_qt_equal(p, t)


@cuda
@pytest.mark.parametrize("q", params())
def test_cuda_round_trip(q):
    t = quantize(q, randn(256, 384))
    g = t.cuda()
    assert type(g) is dtq.QuantizedTensor and g.device.type == "cuda"
    assert all(v.device.type == "cuda" for _, v in _tensors(g))
    assert g.quantizer == t.quantizer and g.directions == t.directions
    back = g.cpu()
    assert type(back) is dtq.QuantizedTensor and all(v.device.type == "cpu" for _, v in _tensors(back))
    assert_qt_equal(back, t)
    g2 = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert_qt_equal(g2.cpu(), t)


# =================================================================================================
# copy_
# =================================================================================================


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params())
def test_copy_same_config_is_raw_payload_copy(q, shape):
    src = quantize(q, randn(*shape, seed=1))
    dst = quantize(q, randn(*shape, seed=2), seed=SEED + 1)
    ptrs = _ptrs(dst)
    before = torch.get_rng_state()
    out = dst.copy_(src)
    assert out is dst and type(dst) is dtq.QuantizedTensor
    assert _ptrs(dst) == ptrs, "copy_ replaced the destination's payload storage"
    assert torch.equal(torch.get_rng_state(), before), "a raw copy must not requantize"
    assert_qt_equal(dst, src)


def _other_config(q):
    return dtq.MXFP8Quantizer() if q == dtq.Float8Quantizer() else dtq.Float8Quantizer()


@pytest.mark.parametrize("q", params())
def test_copy_different_config_requantizes(q):
    x1, x2 = randn(256, 384, seed=1), randn(256, 384, seed=2)
    src = _other_config(q).quantize(x1)
    dst = quantize(q, x2)
    ptrs = _ptrs(dst)
    torch.manual_seed(3)
    dst.copy_(src)
    torch.manual_seed(3)
    expect = q.quantize(src.dequantize())
    assert type(dst) is dtq.QuantizedTensor and dst.quantizer == q
    assert _ptrs(dst) == ptrs, "requantization must write into the existing payloads"
    assert_qt_equal(dst, expect)


@pytest.mark.parametrize("q", params())
def test_copy_plain_source_requantizes(q):
    x1, x2 = randn(4, 64, 256, seed=1), randn(4, 64, 256, seed=2)
    dst = quantize(q, x2, columnwise=False)  # only the held direction is written
    torch.manual_seed(4)
    dst.copy_(x1)
    torch.manual_seed(4)
    assert_qt_equal(dst, q.quantize(x1, columnwise=False))
    # a lower-precision source is converted to the nominal dtype first, like Tensor.copy_
    torch.manual_seed(4)
    dst.copy_(x1.to(torch.bfloat16))
    torch.manual_seed(4)
    assert_qt_equal(dst, q.quantize(x1.to(torch.bfloat16).float(), columnwise=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("q", params())
def test_copy_quantized_into_plain_dequantizes(q, dtype):
    t = quantize(q, randn(256, 384))
    y = torch.full((256, 384), 7.0, dtype=dtype)
    out = y.copy_(t)
    assert type(y) is torch.Tensor and out.data_ptr() == y.data_ptr()
    assert torch.equal(y, t.dequantize(dtype))


@pytest.mark.parametrize("q", params([p for p in QUANTIZERS if not uses_sr(p[1])]))
def test_copy_shards_into_slices_reassembles_whole(q):
    # FSDP-style: copy shard payloads (quantized with the global amax) into dim-0 views of an empty
    # buffer; the buffer then holds exactly quantize(full). (Stochastic rounding: see
    # test_formats_properties, its random stream is indexed by position.)
    full = randn(384, 256, seed=5)
    full[0, 0] = 40.0
    amax = q.local_amax(full)
    whole = quantize(q, full)
    buf = torch.empty_like(whole)
    for a, b in ((0, 128), (128, 256), (256, 384)):
        view = buf[a:b]
        assert type(view) is dtq.QuantizedTensor
        view.copy_(quantize(q, full[a:b], amax=amax))
    assert_qt_equal(buf, whole)


# =================================================================================================
# dim-0 views
# =================================================================================================


def _check_piece(piece, t, a, b):
    """``piece`` is rows [a, b) of ``t`` (in dim-0 indices) as payload views."""
    assert type(piece) is dtq.QuantizedTensor, type(piece)
    assert piece.quantizer == t.quantizer and piece.directions == t.directions
    assert tuple(piece.shape) == (b - a, *t.shape[1:]) and piece.dtype == t.dtype
    r = _rows_per_index(t.shape)
    _assert_shares_storage(piece, t)
    for d in t.directions:
        assert_payload_equal(piece.payload(d), payload_rows(t.quantizer, d, t.payload(d), a * r, b * r), d)
        assert torch.equal(piece.dequantize(direction=d), t.dequantize(direction=d)[a:b]), d


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params())
def test_dim0_views(q, shape):
    t = quantize(q, randn(*shape))
    n = shape[0]
    h = n // 2  # 128 rows of the [M, K] view in both shapes: aligned for every format
    for name, pieces, bounds in [
        ("split", t.split(h), [(0, h), (h, n)]),
        ("split_sizes", t.split([h, h]), [(0, h), (h, n)]),
        ("torch.split", torch.split(t, h, dim=0), [(0, h), (h, n)]),
        ("chunk", torch.chunk(t, 2), [(0, h), (h, n)]),
        ("slice", [t[h:n]], [(h, n)]),
        ("slice_open", [t[:h]], [(0, h)]),
        ("narrow", [t.narrow(0, h, n - h)], [(h, n)]),
    ]:
        assert len(pieces) == len(bounds), name
        for piece, (a, b) in zip(pieces, bounds):
            _check_piece(piece, t, a, b)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params())
def test_view_reshape_keeping_last_dim(q, shape):
    t = quantize(q, randn(*shape))
    m, k = shape2d(shape)
    for new in [(m, k), (2, m // 2, k), (-1, k), (1, m, k)]:
        for v in (t.view(*new), t.reshape(*new)):
            assert type(v) is dtq.QuantizedTensor
            size = (m, k) if new == (-1, k) else new
            assert tuple(v.shape) == size and v.quantizer == t.quantizer and v.directions == t.directions
            _assert_shares_storage(v, t)
            for d in t.directions:
                assert_payload_equal(v.payload(d), t.payload(d), d)
                assert torch.equal(v.dequantize(direction=d), t.dequantize(direction=d).reshape(size))
    # Any reshape is a payload view (FSDP2 keeps view(-1) of every sharded parameter); the payloads
    # still describe the same [M, K] matrix, so values come back in the new shape.
    flat = t.reshape(-1)
    assert type(flat) is dtq.QuantizedTensor and flat.shape2d == (m, k)
    _assert_shares_storage(flat, t)
    assert torch.equal(flat.dequantize(), t.dequantize().reshape(-1))
    assert torch.equal(flat.view(m, k).dequantize(), t.dequantize().reshape(m, k))
    # A view whose last dim is not K has no row structure: dim-0 slices of it are dequantized.
    assert type(flat[:k]) is torch.Tensor and torch.equal(flat[:k], t.dequantize().reshape(-1)[:k])


@pytest.mark.parametrize(
    "shape,rows",
    [pytest.param((256, 384), (0, 40), id="256x384[0:40]"), pytest.param((4, 64, 256), (0, 1), id="4x64x256[0:1]")],
)
@pytest.mark.parametrize("q", params())
def test_misaligned_slice_falls_back_and_warns(q, shape, rows):
    t = quantize(q, randn(*shape))
    a, b = rows
    r = _rows_per_index(shape)
    aligned = all((a * r) % _block_rows(q, d) == 0 and (b * r) % _block_rows(q, d) == 0 for d in t.directions)
    if aligned:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            piece = t[a:b]
        _check_piece(piece, t, a, b)
    else:
        with pytest.warns(UserWarning, match="dequantized") as rec:
            piece = t[a:b]
        msg = str(rec[0].message)
        assert sub(q, "rowwise").format_name in msg or sub(q, "columnwise").format_name in msg
        assert type(piece) is torch.Tensor
        assert torch.equal(piece, t.dequantize()[a:b])
        # split at the same boundary falls back the same way
        with pytest.warns(UserWarning, match="dequantized"):
            dtq._warn._warned.clear()
            pieces = t.split(b - a)
        assert all(type(p) is torch.Tensor for p in pieces)
        assert torch.equal(torch.cat(pieces), t.dequantize())


def test_misaligned_only_for_held_directions():
    # MXFP8 columnwise needs 32-row alignment; a rowwise-only tensor slices anywhere.
    q, x = dtq.MXFP8Quantizer(), randn(256, 384)
    with pytest.warns(UserWarning, match=r"columnwise.*32|32.*columnwise"):
        assert type(q.quantize(x)[0:40]) is torch.Tensor
    t = q.quantize(x, columnwise=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_piece(t[0:40], t, 0, 40)
        _check_piece(t[40:41], t, 40, 41)


# =================================================================================================
# update_usage
# =================================================================================================


def _exactly_derivable(q, target) -> bool:
    """Whether ``target`` can be built from the other direction without the high-precision source:
    same codes under one per-tensor scale, a 2-D block serving both directions, a passthrough
    direction, or (different sub-formats) requantizing a lossless passthrough."""
    have = "rowwise" if target == "columnwise" else "columnwise"
    st, sh = sub(q, target), sub(q, have)
    if st == sh:
        return isinstance(st, (dtq.Float8Quantizer, dtq.IdentityQuantizer)) or (
            isinstance(st, (dtq.Float8BlockQuantizer, dtq.NVFP4Quantizer)) and st.block[0] == st.block[1]
        )
    return isinstance(sh, dtq.IdentityQuantizer) and sh.dtype is None


@pytest.mark.parametrize("q", params())
def test_update_usage_drops_direction(q):
    t = quantize(q, randn(256, 384))
    row = t.payload("rowwise")
    assert t.update_usage(columnwise=False) is t
    assert t.directions == ("rowwise",)
    assert all(t.payload("rowwise")[k] is v for k, v in row.items())
    with pytest.raises(KeyError, match="update_usage"):
        t.payload("columnwise")
    with pytest.raises(ValueError, match="at least one"):
        t.update_usage(rowwise=False)
    assert t.directions == ("rowwise",)
    t2 = quantize(q, randn(256, 384))
    t2.update_usage(rowwise=False)
    assert t2.directions == ("columnwise",)


@pytest.mark.parametrize("target", ["columnwise", "rowwise"])
@pytest.mark.parametrize("q", params())
def test_update_usage_builds_missing_direction(q, target):
    x = randn(256, 384, seed=7)
    have = "rowwise" if target == "columnwise" else "columnwise"
    torch.manual_seed(8)
    full = q.quantize(x)
    t = quantize(q, x, **{target: False})
    held = {k: v for k, v in t.payload(have).items()}
    if _exactly_derivable(q, target):
        t.update_usage(**{target: True})
        assert t.directions == dtq.DIRECTIONS
        assert_payload_equal(t.payload(target), full.payload(target), target)
    else:
        with pytest.raises(ValueError) as e:
            t.update_usage(**{target: True})
        assert "source=" in str(e.value) and target in str(e.value)
        assert t.directions == (have,)
        torch.manual_seed(8)
        t.update_usage(**{target: True}, source=x)
        assert t.directions == dtq.DIRECTIONS
        assert_payload_equal(t.payload(target), full.payload(target), f"{target} built from source")
    assert all(t.payload(have)[k] is v for k, v in held.items()), "the held direction was touched"


# Formats whose missing direction shares the held direction's per-tensor scale (or has none).
# Left out: stochastic rounding (position-indexed stream, see test_formats_properties), and the
# formats whose missing direction needs an amax that the held payload cannot supply (NVFP4 random
# Hadamard: the columnwise amax is that of T x; hybrid MXFP8/NVFP4: MXFP8 holds no amax). For those
# update_usage has no amax= argument, so a shard cannot be completed consistently at all. FP8
# row-wise likewise: its rowwise payload holds row scales, its columnwise direction needs the
# column amaxes of the whole tensor.
_SHARD_REBUILD = [
    p
    for p in QUANTIZERS
    if not uses_sr(p[1]) and not uses_rht(p[1]) and p[0] != "hybrid_mxfp8_nvfp4" and not p[0].startswith("fp8row")
]


@pytest.mark.parametrize("q", params(_SHARD_REBUILD))
def test_update_usage_source_on_shard_keeps_global_scale(q):
    # A shard quantized rowwise with the global amax, then given its columnwise direction from its
    # own high-precision values, must equal the shard of quantize(full) (docs/design.md §5.1); the tensor.py
    # docstring promises "a per-tensor amax/scale already held ... keeps a rebuilt direction
    # consistent (e.g. shards quantized with a global amax)".
    full = randn(384, 256, seed=9)
    full[0, 0] = 40.0
    amax = q.local_amax(full)
    shard_x = full[128:256]
    shard = quantize(q, shard_x, amax=amax, columnwise=False)
    shard.update_usage(columnwise=True, source=shard_x)
    assert_payload_equal(shard.payload("columnwise"), quantize(q, full)[128:256].payload("columnwise"))


def test_update_usage_source_shape_checked():
    t = dtq.MXFP8Quantizer().quantize(randn(256, 384), columnwise=False)
    with pytest.raises(ValueError, match=r"\[128, 384\]"):
        t.update_usage(columnwise=True, source=randn(128, 384))


# =================================================================================================
# everything else: dequantize and run in high precision
# =================================================================================================


@pytest.mark.parametrize("directions", ["both", "columnwise"])
@pytest.mark.parametrize("q", params())
def test_other_ops_dequantize(q, directions):
    x = randn(256, 384)
    t = quantize(q, x, rowwise=directions == "both")
    hp = t.dequantize()
    w = randn(384, 16, seed=3)
    u = quantize(q, randn(256, 384, seed=4))
    for name, got, want in [
        ("add", t + 1, hp + 1),
        ("radd", 1 + t, 1 + hp),
        ("matmul", torch.matmul(t, w), torch.matmul(hp, w)),
        ("linear", torch.nn.functional.linear(t, w.T), torch.nn.functional.linear(hp, w.T)),
        ("sum", t.sum(), hp.sum()),
        ("t", t.t(), hp.t()),
        ("mul_qt", t * u, hp * u.dequantize()),
        ("transpose", t.transpose(0, 1), hp.transpose(0, 1)),
        ("strided_slice", t[::2], hp[::2]),
        ("dim1_slice", t[:, :128], hp[:, :128]),
    ]:
        assert type(got) is torch.Tensor, f"{name} returned {type(got).__name__}"
        assert torch.equal(got, want), name


@pytest.mark.parametrize("op", ["mul_", "add_"])
@pytest.mark.parametrize("directions", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("q", params())
def test_inplace_ops_requantize(q, op, directions):
    x = randn(4, 64, 256)
    kw = {"rowwise": directions != "columnwise", "columnwise": directions != "rowwise"}
    t = quantize(q, x, **kw)
    hp = t.dequantize().clone()  # clone: see test_dequantize_does_not_alias_payloads
    ptrs = _ptrs(t)
    torch.manual_seed(6)
    out = t.mul_(2) if op == "mul_" else t.add_(1)
    torch.manual_seed(6)
    expect = q.quantize(hp * 2 if op == "mul_" else hp + 1, **kw)
    assert out is t and type(t) is dtq.QuantizedTensor
    assert t.quantizer == q and t.directions == expect.directions
    assert _ptrs(t) == ptrs, "in-place op replaced payload storage"
    assert_qt_equal(t, expect)


# =================================================================================================
# torch.save / torch.load(weights_only=True)
# =================================================================================================


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("directions", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("q", params())
def test_save_load_roundtrip(q, directions):
    kw = {"rowwise": directions != "columnwise", "columnwise": directions != "rowwise"}
    t = quantize(q, randn(4, 64, 256), **kw)
    b = quantize(q, randn(256, 384, dtype=torch.bfloat16))  # bf16 nominal dtype
    sd = _roundtrip({"w": t, "b": b, "slice": b[128:256]})
    for key, ref in (("w", t), ("b", b), ("slice", b[128:256])):
        got = sd[key]
        assert type(got) is dtq.QuantizedTensor, key
        assert type(got.quantizer) is type(ref.quantizer) and got.quantizer == ref.quantizer, key
        assert_qt_equal(got, ref)
        assert torch.equal(bits(got.dequantize()), bits(ref.dequantize())), key
    _assert_owns_storage(sd["w"], t)


# =================================================================================================
# dequantize(direction=...)
# =================================================================================================


@pytest.mark.parametrize("q", params())
def test_dequantize_direction(q):
    x = randn(256, 384)
    t = quantize(q, x)
    row, col = t.dequantize(direction="rowwise"), t.dequantize(direction="columnwise")
    assert torch.equal(t.dequantize(), row)  # default: rowwise when present
    for d, v in (("rowwise", row), ("columnwise", col)):
        assert v.dtype == torch.float32 and v.shape == x.shape
        if not (d == "columnwise" and uses_rht(q)):
            assert torch.equal(v, ref_dequantize(q, d, t.payload(d), (256, 384)))
    assert torch.equal(t.dequantize(torch.bfloat16, direction="columnwise"), col.to(torch.bfloat16))
    c = quantize(q, x, rowwise=False)
    assert torch.equal(c.dequantize(), col)  # default without rowwise: columnwise
    with pytest.raises(KeyError, match="rowwise"):
        c.dequantize(direction="rowwise")
    r = quantize(q, x, columnwise=False)
    assert torch.equal(r.dequantize(), row)
    with pytest.raises(KeyError, match="columnwise"):
        r.dequantize(direction="columnwise")
    with pytest.raises(ValueError, match="direction"):
        t.dequantize(direction="both")
    # nominal dtype is the default output dtype
    tb = quantize(q, x.to(torch.bfloat16))
    assert tb.dtype == torch.bfloat16 and tb.dequantize().dtype == torch.bfloat16


@pytest.mark.parametrize("q", params())
def test_dequantize_does_not_alias_payloads(q):
    # dequantize() hands out high-precision values; writing to them must not change the codes.
    x = randn(256, 384)
    t = quantize(q, x)
    ref = t.clone()
    for d in dtq.DIRECTIONS:
        v = t.dequantize(direction=d)
        v.mul_(0)
    assert_qt_equal(t, ref)


def test_dequantize_directions_differ_for_hybrid():
    # guards the direction argument: a hybrid's two directions carry different formats
    q = by_id("hybrid_mxfp8_nvfp4")
    t = q.quantize(randn(256, 384))
    assert not torch.equal(t.dequantize(direction="rowwise"), t.dequantize(direction="columnwise"))
    assert torch.equal(
        t.dequantize(direction="columnwise"),
        dtq.NVFP4Quantizer().quantize(randn(256, 384)).dequantize(direction="columnwise"),
    )


@pytest.mark.parametrize(
    "q",
    [
        dtq.Float8Quantizer(),
        dtq.Float8BlockQuantizer((128, 128)),
        dtq.NVFP4Quantizer((16, 16)),
        dtq.IdentityQuantizer(),
    ],
    ids=repr,
)
def test_identical_directions_share_storage(q):
    """Formats whose two directions are bitwise equal store one payload (half the memory), and
    every copy-like op keeps it shared."""
    t = q.quantize(randn(256, 256))
    for u in (t, t.clone(), t.new_zeros((128, 256)), torch.empty_like(t), t[:128], t.detach(), t.view(-1)):
        for k in u.payload("rowwise"):
            assert (
                u.payload("rowwise")[k] is u.payload("columnwise")[k]
                or u.payload("rowwise")[k].data_ptr() == u.payload("columnwise")[k].data_ptr()
            ), (k, u.shape)
