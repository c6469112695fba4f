"""Format-level properties of every dtq quantizer (docs/design.md sections 1, 2, 5.1, 6).

Random data with fixed seeds, small shapes. Bitwise claims compare raw bytes (``bits``), never
``allclose``.
"""

from __future__ import annotations

import math

import pytest
import torch

import dtq

try:
    from _quantizers import (
        PLAIN,
        QUANTIZERS,
        SEED,
        assert_payload_equal,
        assert_qt_equal,
        bits,
        by_id,
        element_scale,
        params,
        payload_rows,
        quantize,
        randn,
        ref_dequantize,
        replace,
        rows_per_payload_row,
        shape2d,
        sub,
        unpack_e2m1,
        uses_rht,
        uses_sr,
    )
except ImportError:  # tests/ imported as a package
    from tests._quantizers import (
        PLAIN,
        QUANTIZERS,
        SEED,
        assert_payload_equal,
        assert_qt_equal,
        bits,
        by_id,
        element_scale,
        params,
        payload_rows,
        quantize,
        randn,
        ref_dequantize,
        replace,
        rows_per_payload_row,
        shape2d,
        sub,
        unpack_e2m1,
        uses_rht,
        uses_sr,
    )

SHAPES = [pytest.param((256, 384), id="256x384"), pytest.param((4, 64, 256), id="4x64x256")]


def _two_d_block(s) -> bool:
    return (isinstance(s, dtq.Float8BlockQuantizer) and s.block == (128, 128)) or (
        isinstance(s, dtq.NVFP4Quantizer) and s.block == (16, 16)
    )


def _nvfp4(s) -> bool:
    return isinstance(s, dtq.NVFP4Quantizer)


# =================================================================================================
# columnwise(x) == rowwise(x.T)
# =================================================================================================


def _transposed_rowwise(q, x2, amax):
    """Rowwise payload of X^T quantized by the columnwise sub-quantizer, with the same global amax."""
    cs = sub(q, "columnwise")
    a = amax.get("columnwise") if isinstance(amax, dict) else None
    return quantize(cs, x2.T.contiguous(), columnwise=False, amax=a).payload("rowwise")


def _assert_col_is_rowT(q, col: dict, rowT: dict, codes_too: bool = True):
    """``col`` (stored [M, K]) equals ``rowT`` (the rowwise payload of X^T, stored [K, M]) transposed."""
    s = sub(q, "columnwise")
    assert set(col) == set(rowT)
    for k in col:
        a, b = col[k], rowT[k]
        assert a.dtype == b.dtype, k
        if rows_per_payload_row(q, "columnwise", k) is None:  # per-tensor value
            assert torch.equal(bits(a), bits(b)), k
        elif k == "data" and _nvfp4(s):
            if codes_too:
                # two E2M1 codes per byte, element 2i in the low nibble: compare element codes
                assert torch.equal(unpack_e2m1(a), unpack_e2m1(b).T), "E2M1 codes differ"
        elif k == "data" and not codes_too:
            pass
        else:
            assert tuple(a.shape) == tuple(b.T.shape), (k, tuple(a.shape), tuple(b.shape))
            assert torch.equal(bits(a), bits(b.T.contiguous())), f"{k} differs from rowwise(x.T)[{k}].T"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params([p for p in QUANTIZERS if not uses_rht(p[1])]))
def test_columnwise_is_rowwise_of_transpose(q, shape):
    x = randn(*shape, seed=11)
    x2 = x.reshape(shape2d(shape))
    amax = q.local_amax(x)  # NVFP4: both quantizations must use one global amax
    t = quantize(q, x, amax=amax)
    col, row = t.payload("columnwise"), t.payload("rowwise")
    cs = sub(q, "columnwise")
    rowT = _transposed_rowwise(q, x2, amax)

    if uses_sr(q):
        # Stochastic rounding draws from a separate random stream per direction, indexed by the
        # element's position in the stored [M, K] tensor, so the *codes* of columnwise(x) and
        # rowwise(x.T) are two different random roundings. Scales and amax are deterministic and must
        # match; each code is one of the two E2M1 neighbours of the same scaled value, so the values
        # differ by at most one grid step (<= 2 code units, the widest E2M1 gap).
        _assert_col_is_rowT(q, col, rowT, codes_too=False)
        m, k = x2.shape
        dq_col = ref_dequantize(q, "columnwise", col, (m, k))
        dq_rowT = ref_dequantize(q, "rowwise", rowT, (k, m)).T
        unit = element_scale(q, "columnwise", col, (m, k))
        assert torch.all((dq_col - dq_rowT).abs() <= 2 * unit * (1 + 1e-6))
        return

    _assert_col_is_rowT(q, col, rowT)
    if _two_d_block(cs):
        # 128x128 / 16x16 tiles serve both directions; both payloads are stored in the logical
        # [M, K] orientation, so they are bitwise identical.
        assert_payload_equal(col, row, "columnwise vs rowwise")
    if isinstance(cs, dtq.Float8Quantizer):
        # one per-tensor scale: the codes of the two directions are identical
        assert torch.equal(bits(col["data"]), bits(row["data"]))
        assert torch.equal(bits(col["scale_inv"]), bits(row["scale_inv"]))


def test_columnwise_transpose_partial_blocks():
    # Float8Block accepts partial edge blocks; the transpose property still holds there.
    x = randn(200, 300, seed=12)
    for q in (dtq.Float8BlockQuantizer((1, 128)), dtq.Float8BlockQuantizer((128, 128))):
        t = q.quantize(x)
        _assert_col_is_rowT(q, t.payload("columnwise"), _transposed_rowwise(q, x, {}))


def test_random_hadamard_columnwise():
    """RHT transforms the columnwise (wgrad) space, so columnwise != rowwise(x.T); instead: it
    dequantizes back close to x, its payload differs from plain NVFP4's, and rowwise is untouched."""
    x = randn(256, 384, seed=13)
    rht, plain = by_id("nvfp4_rht"), by_id("nvfp4_1x16")
    t, p = rht.quantize(x), plain.quantize(x)
    # rowwise is not transformed: bitwise plain NVFP4
    assert_payload_equal(t.payload("rowwise"), p.payload("rowwise"), "RHT rowwise vs NVFP4 rowwise")
    # columnwise payload lives in the transformed space
    tc, pc = t.payload("columnwise"), p.payload("columnwise")
    assert not torch.equal(tc["data"], pc["data"])
    assert not torch.equal(bits(tc["scale"]), bits(pc["scale"]))
    # amax is that of T x (T orthogonal, mixes 16 rows): different from max|x|, and what local_amax reports
    assert torch.equal(tc["amax"], rht.local_amax(x)["columnwise"])
    assert not torch.equal(tc["amax"], pc["amax"])
    # ... and dequantizes (T^T applied) back to x with NVFP4 accuracy: T is orthogonal, so the
    # Frobenius error equals the error in the transformed space, bounded like plain NVFP4 (see
    # test_dequantization_error_bounds for the 0.12 derivation).
    dq = t.dequantize(direction="columnwise")
    assert _rel_fro(dq, x) <= 0.12
    # the transform must actually be inverted: without it the result is far from x
    assert _rel_fro(ref_dequantize(plain, "columnwise", tc, (256, 384)), x) > 0.5


# =================================================================================================
# shard = slice of whole (docs/design.md §5.1)
# =================================================================================================

# Stochastic rounding is exempt: its random bits are indexed by the element's position in the
# tensor being quantized, so element i of a shard draws the bits of element i of the whole tensor,
# not those of element (offset + i). Reproducing the whole tensor's bits from a shard would need the
# offset; the contract only promises seeded reproducibility.


@pytest.mark.parametrize(
    "shape,rows",
    [
        pytest.param((384, 256), (128, 256), id="384x256[128:256]"),
        pytest.param((4, 64, 256), (2, 4), id="4x64x256[2:4]"),
    ],
)
@pytest.mark.parametrize("q", params([p for p in QUANTIZERS if not uses_sr(p[1])]))
def test_shard_is_slice_of_whole(q, shape, rows):
    full = randn(*shape, seed=21)
    full.view(-1)[0] = 50.0  # global max outside the shard: the global amax must matter
    a, b = rows
    shard_x = full[a:b]
    amax = q.local_amax(full)
    for d, v in amax.items():  # sanity: the shard's own amax differs, so passing amax= is tested
        assert not torch.equal(v, q.local_amax(shard_x)[d])

    whole = quantize(q, full)
    shard = quantize(q, shard_x, amax=amax)
    # through the QuantizedTensor dim-0 slice policy
    sliced = whole[a:b]
    assert isinstance(sliced, dtq.QuantizedTensor)
    assert_qt_equal(sliced, shard)
    # and against the payload rows cut directly by the documented layout
    r = math.prod(shape[1:-1])
    for d in dtq.DIRECTIONS:
        assert_payload_equal(shard.payload(d), payload_rows(q, d, whole.payload(d), a * r, b * r), d)


# =================================================================================================
# dequantization error bounds
# =================================================================================================


def _rel_fro(dq, x):
    x = x.double()
    return ((dq.double() - x).norm() / x.norm()).item()


# Relative Frobenius bounds, per plain sub-quantizer; each is derived in the comment next to it.
def _fro_bound(s, direction) -> float:
    if isinstance(s, dtq.IdentityQuantizer):
        # None: exact passthrough. bf16: RNE to 8 significant bits -> |err| <= 2^-8 |x| per element.
        return 0.0 if s.dtype is None else 2.0**-8
    if isinstance(s, (dtq.Float8Quantizer, dtq.Float8RowwiseQuantizer, dtq.Float8BlockQuantizer, dtq.MXFP8Quantizer)):
        # RNE to m mantissa bits: |err| <= half ulp = 2^-(m+1) * 2^floor(log2|v|) <= 2^-(m+1) |v|.
        # E4M3 m=3 -> 2^-4 = 0.0625, E5M2 m=2 -> 2^-3 = 0.125. Per-element relative bounds carry to
        # the Frobenius norm. No saturation: a per-tensor (or per-row) scale maps amax to fp8_max; pow2 scales and
        # MXFP8 "ceil" round the scale so amax lands at or below fp8_max. Subnormal codes (|v| <
        # 2^-6 for E4M3) add an absolute half-step of 2^-10 * scale_inv, negligible here (gaussian
        # data: those elements hold < 1e-6 of the norm).
        bound = 2.0**-4 if s.dtype == torch.float8_e4m3fn else 2.0**-3
        if isinstance(s, dtq.MXFP8Quantizer) and s.scale_rounding == "floor":
            # OCP floor: amax / 2^e lies in [256, 512) and saturates at 448, so an element in
            # (448, 512) * 2^e loses at most 1 - 448/512 = 1/8 of its value. Worst case 2^-3.
            bound = max(bound, 1.0 - 448.0 / 512.0)
        return bound
    if isinstance(s, dtq.NVFP4Quantizer):
        # E2M1 has no relative worst case (0.25 absolute near 0), so this is a model bound for
        # gaussian data: scaled values v = x * S_enc / s_b, block max -> ~6. Rounding error is about
        # uniform over a cell of width D: variance D^2 / 12 (RTN) or D^2 / 6 (stochastic rounding,
        # E[(v-lo)(hi-v)]). Cells: D = 0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6].
        #  * 1x16: E[max of 16 |N(0,1)|] ~ 2.05 sigma, so sigma -> 2.9; P(|v|<2, <4, <6) ~ .51/.32/.13
        #    -> E[err^2] ~ .51*.021 + .32*.083 + .13*.333 = .081 -> rel ~ sqrt(.081)/2.9 = 0.098.
        #  * 16x16: max of 256 |N| ~ 3.0 sigma, sigma -> 2.0 -> rel ~ 0.114.
        #  * stochastic rounding: variance doubles -> 0.098 * sqrt(2) = 0.139.
        #  * random Hadamard (columnwise): T orthogonal, T x again ~ gaussian -> ~0.098.
        # Bounds: model + ~20% (E4M3 block-scale rounding, finite-sample spread; 98k elements keep
        # the sample estimate within ~1% of its mean).
        if s.stochastic_rounding:
            return 0.16
        return 0.13 if s.block == (16, 16) else 0.12
    raise AssertionError(s)


def _elementwise_bound(q, direction, payload, x2):
    """Per-element worst-case |dq - x| from the format's rounding rule and the stored block scale
    (None where no simple bound applies: random Hadamard columnwise lives in another space)."""
    s = sub(q, direction)
    ax = x2.abs()
    if isinstance(s, dtq.IdentityQuantizer):
        return torch.zeros_like(ax) if s.dtype is None else ax * 2.0**-8
    if _nvfp4(s) and s.random_hadamard and direction == "columnwise":
        return None
    u = element_scale(q, direction, payload, tuple(x2.shape))  # x-space size of one code unit
    v = torch.where(u > 0, ax / u, torch.zeros_like(ax))  # the magnitude that was rounded
    if _nvfp4(s):
        # E2M1 half-step by cell: 0.25 on [0, 2], 0.5 on (2, 4], 1 on (4, 6]; stochastic rounding
        # can go to either neighbour: a full step. Above 6 (block scale rounded down by E4M3):
        # saturates at 6.
        step = torch.where(v <= 2, 0.5, torch.where(v <= 4, 1.0, 2.0))
        err = step if s.stochastic_rounding else step / 2
        err = torch.maximum(err, v - 6.0)
    else:
        m = 3 if s.dtype == torch.float8_e4m3fn else 2
        min_normal = 2.0**-6 if s.dtype == torch.float8_e4m3fn else 2.0**-14
        sub_step = 2.0**-9 if s.dtype == torch.float8_e4m3fn else 2.0**-16
        fmax = 448.0 if s.dtype == torch.float8_e4m3fn else 57344.0
        half_ulp = torch.where(v >= min_normal, v * 2.0 ** -(m + 1), torch.full_like(v, sub_step / 2))
        err = torch.maximum(half_ulp, v - fmax)  # saturation (MXFP8 floor)
    bound = err * u
    # fp32 arithmetic in scale / factor / dequant products: a few ulps of |x|
    return torch.where(u > 0, bound + ax * 2.0**-20 + 1e-30, ax)


DATA = [pytest.param("gaussian", id="gaussian"), pytest.param("rowscaled", id="rowscaled")]


def _data(kind, shape):
    x = randn(*shape, seed=31)
    if kind == "rowscaled":  # rows spanning 6 decades: exercises block scales and subnormal codes
        x2 = x.reshape(shape2d(shape))
        g = torch.Generator().manual_seed(32)
        x2 *= 10.0 ** (torch.rand(x2.shape[0], 1, generator=g) * 6 - 3)
    return x


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params())
def test_dequantization_error_bounds(q, shape, kind):
    x = _data(kind, shape)
    x2 = x.reshape(shape2d(shape))
    t = quantize(q, x)
    for d in dtq.DIRECTIONS:
        s = sub(q, d)
        dq = t.dequantize(direction=d)
        assert dq.shape == x.shape and dq.dtype == x.dtype
        dq2 = dq.reshape(x2.shape)
        eb = _elementwise_bound(q, d, t.payload(d), x2)
        if eb is not None:
            over = (dq2 - x2).abs() > eb
            assert not over.any(), (
                f"{d}: {int(over.sum())} elements exceed the elementwise bound, e.g. "
                f"x={x2[over][:3].tolist()} dq={dq2[over][:3].tolist()}"
            )
        if isinstance(s, dtq.IdentityQuantizer) and s.dtype is None:
            assert torch.equal(dq, x)
        if kind == "gaussian":
            err = _rel_fro(dq, x)
            assert err <= _fro_bound(s, d), f"{d}: relative Frobenius error {err:.4f} > {_fro_bound(s, d)}"


def test_error_bounds_are_not_vacuous():
    # The FP8 bound is a worst case; a correct quantizer sits well below it, and a broken one (e.g.
    # codes cast without the scale) is far above. Guards against a bound so loose nothing fails.
    x = randn(256, 384, seed=33)
    t = dtq.Float8Quantizer().quantize(x)
    err = _rel_fro(t.dequantize(), x)
    assert 2.0**-7 < err < 2.0**-4  # ~0.027: RMS of a uniform 3-bit-mantissa rounding error
    # the elementwise bound catches a single flipped code
    p = dict(t.payload("rowwise"))
    data = p["data"].view(torch.uint8).clone()
    data[3, 5] ^= 0x08  # flip a mantissa bit
    p["data"] = data.view(torch.float8_e4m3fn)
    eb = _elementwise_bound(dtq.Float8Quantizer(), "rowwise", p, x)
    assert ((ref_dequantize(dtq.Float8Quantizer(), "rowwise", p, (256, 384)) - x).abs() > eb).any()


@pytest.mark.parametrize("q", params([p for p in QUANTIZERS if not uses_rht(p[1])]))
def test_dequantize_matches_documented_layout(q):
    """dequantize() equals the reference decoding of the documented payload layout, bit for bit."""
    x = randn(256, 384, seed=34)
    t = quantize(q, x)
    for d in dtq.DIRECTIONS:
        assert torch.equal(t.dequantize(direction=d), ref_dequantize(q, d, t.payload(d), (256, 384))), d


# =================================================================================================
# same-format hybrid == plain format
# =================================================================================================


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params(PLAIN))
def test_same_format_hybrid_is_plain(q, shape):
    x = randn(*shape, seed=41)
    h = dtq.HybridQuantizer(rowwise=q, columnwise=replace(q))
    a, b = quantize(q, x, seed=SEED), quantize(h, x, seed=SEED)
    assert b.quantizer == h and a.quantizer == q
    assert a.directions == b.directions == dtq.DIRECTIONS
    for d in dtq.DIRECTIONS:
        assert_payload_equal(a.payload(d), b.payload(d), d)
    # seed drawn from torch's generator: same generator state -> same bits
    torch.manual_seed(5)
    a = q.quantize(x)
    torch.manual_seed(5)
    b = h.quantize(x)
    for d in dtq.DIRECTIONS:
        assert_payload_equal(a.payload(d), b.payload(d), d)


def test_stochastic_rounding_depends_on_seed_only():
    # Makes the seed=None comparison above meaningful: different seeds give different codes, the
    # same seed (explicit, or via torch's generator) gives the same ones.
    q, x = by_id("nvfp4_sr"), randn(256, 384, seed=42)
    a, b = q.quantize(x, seed=1), q.quantize(x, seed=2)
    assert not torch.equal(a.payload("rowwise")["data"], b.payload("rowwise")["data"])
    assert_payload_equal(a.payload("rowwise"), q.quantize(x, seed=1).payload("rowwise"))
    torch.manual_seed(9)
    c = q.quantize(x)
    torch.manual_seed(9)
    assert_payload_equal(c.payload("columnwise"), q.quantize(x).payload("columnwise"))
    # and it is not round-to-nearest in disguise
    assert not torch.equal(a.payload("rowwise")["data"], by_id("nvfp4_1x16").quantize(x).payload("rowwise")["data"])


# =================================================================================================
# construction errors
# =================================================================================================


def test_hybrid_rejects_same_object():
    q = dtq.MXFP8Quantizer()
    with pytest.raises(ValueError) as e:
        dtq.HybridQuantizer(rowwise=q, columnwise=q)
    msg = str(e.value)
    assert "same" in msg and "rowwise" in msg and "columnwise" in msg
    # tells the user what to do instead
    assert "dataclasses.replace" in msg or "two" in msg
    assert "plain quantizer" in msg
    # equal but distinct objects are fine
    h = dtq.HybridQuantizer(rowwise=q, columnwise=replace(q))
    assert h.rowwise == h.columnwise and h.rowwise is not h.columnwise


@pytest.mark.parametrize("where", ["rowwise", "columnwise"])
def test_hybrid_rejects_nesting(where):
    inner = dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer())
    other = dtq.Float8Quantizer()
    kw = {"rowwise": other, "columnwise": other}
    kw[where] = inner
    with pytest.raises((TypeError, ValueError)) as e:
        dtq.HybridQuantizer(**kw)
    msg = str(e.value)
    assert "nest" in msg and where in msg
    # names the plain quantizer to pass instead
    assert repr(inner.for_direction(where)) in msg


def test_hybrid_rejects_non_quantizer():
    with pytest.raises(TypeError, match="must be a dtq quantizer"):
        dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise="nvfp4")
    with pytest.raises(TypeError):
        dtq.HybridQuantizer(rowwise=torch.float8_e4m3fn, columnwise=dtq.MXFP8Quantizer())


@pytest.mark.parametrize(
    "make,words",
    [
        pytest.param(lambda: dtq.Float8Quantizer(torch.float16), ["Float8Quantizer", "float16"], id="fp8-fp16"),
        pytest.param(lambda: dtq.Float8Quantizer(torch.int8), ["Float8Quantizer", "int8"], id="fp8-int8"),
        pytest.param(lambda: dtq.Float8BlockQuantizer((1, 64)), ["Float8BlockQuantizer", "(1, 64)"], id="blk-1x64"),
        pytest.param(lambda: dtq.Float8BlockQuantizer((128, 1)), ["Float8BlockQuantizer", "(128, 1)"], id="blk-128x1"),
        pytest.param(
            lambda: dtq.Float8BlockQuantizer(dtype=torch.bfloat16), ["Float8BlockQuantizer", "bfloat16"], id="blk-bf16"
        ),
        pytest.param(lambda: dtq.MXFP8Quantizer(torch.float32), ["MXFP8Quantizer", "float32"], id="mx-fp32"),
        pytest.param(
            lambda: dtq.MXFP8Quantizer(scale_rounding="nearest"), ["MXFP8Quantizer", "nearest"], id="mx-rounding"
        ),
        pytest.param(lambda: dtq.NVFP4Quantizer((1, 32)), ["NVFP4Quantizer", "(1, 32)"], id="nv-1x32"),
        pytest.param(
            lambda: dtq.NVFP4Quantizer((16, 16), random_hadamard=True),
            ["NVFP4Quantizer", "random_hadamard", "(16, 16)"],
            id="nv-rht-16x16",
        ),
        pytest.param(lambda: dtq.IdentityQuantizer(torch.int32), ["IdentityQuantizer", "int32"], id="id-int32"),
        pytest.param(
            lambda: dtq.IdentityQuantizer(torch.float8_e4m3fn), ["IdentityQuantizer", "Float8Quantizer"], id="id-fp8"
        ),
    ],
)
def test_constructor_rejects_bad_settings(make, words):
    with pytest.raises(ValueError) as e:
        make()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("q", params())
def test_quantizers_are_immutable_value_configs(q):
    import copy
    import dataclasses

    twin = copy.deepcopy(q)
    assert twin == q and hash(twin) == hash(q) and twin is not q
    field = dataclasses.fields(q)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(q, field, getattr(q, field))
    assert q != dtq.IdentityQuantizer(torch.float16)


# =================================================================================================
# shapes a format cannot take
# =================================================================================================


@pytest.mark.parametrize(
    "q,shape,direction,requirement,other",
    [
        pytest.param(dtq.NVFP4Quantizer(), (32, 24), "rowwise", "multiple of 16", None, id="nvfp4-K24"),
        pytest.param(dtq.NVFP4Quantizer(), (24, 64), "columnwise", "multiple of 16", "rowwise", id="nvfp4-col-M24"),
        pytest.param(dtq.NVFP4Quantizer((16, 16)), (24, 64), "rowwise", "multiple of 16", None, id="nvfp4-16x16-M24"),
        pytest.param(
            dtq.MXFP8Quantizer(), (64, 48), "rowwise", "multiple of the MX block size 32", "columnwise", id="mxfp8-K48"
        ),
        pytest.param(
            dtq.MXFP8Quantizer(),
            (40, 64),
            "columnwise",
            "multiple of the MX block size 32",
            "rowwise",
            id="mxfp8-col-M40",
        ),
    ],
)
def test_unsupported_shape_raises(q, shape, direction, requirement, other):
    x = randn(*shape, seed=51)
    with pytest.raises(ValueError) as e:
        q.quantize(x)
    msg = str(e.value)
    assert type(q).__name__ in msg  # the format
    assert str(list(shape)) in msg  # the shape
    assert requirement in msg and direction in msg  # the requirement and the direction that needs it
    # the failing direction alone fails too
    with pytest.raises(ValueError):
        q.quantize(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    if other is not None:
        # the other direction alone has no such requirement
        t = q.quantize(x, rowwise=other == "rowwise", columnwise=other == "columnwise")
        assert t.directions == (other,)
        assert _rel_fro(t.dequantize(), x) <= _fro_bound(q, other)


def test_unsupported_shape_through_hybrid_names_the_sub_format():
    h = by_id("hybrid_mxfp8_nvfp4")
    x = randn(24, 64, seed=52)  # fine for MXFP8 rowwise (K=64), not for NVFP4 columnwise (M=24)
    with pytest.raises(ValueError, match=r"NVFP4Quantizer \(columnwise\).*\[24, 64\]"):
        h.quantize(x)
    assert h.quantize(x, columnwise=False).directions == ("rowwise",)


def test_unsupported_shape_3d_names_the_2d_view():
    x = randn(3, 8, 64, seed=53)  # M = 24
    with pytest.raises(ValueError, match=r"\[M, K\] = \[24, 64\]"):
        dtq.NVFP4Quantizer().quantize(x)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("shape", [(200, 300), (1, 5), (3, 130, 129)])
def test_float8_block_accepts_partial_blocks(block, shape):
    q = dtq.Float8BlockQuantizer(block)
    x = randn(*shape, seed=54)
    t = q.quantize(x)
    m, k = shape2d(shape)
    nb = lambda n, b: -(-n // b)  # noqa: E731
    expect = {
        "rowwise": (nb(m, block[0]), nb(k, block[1])),
        "columnwise": (nb(m, block[1]), nb(k, block[0])) if block[0] == 1 else (nb(m, 128), nb(k, 128)),
    }
    for d in dtq.DIRECTIONS:
        assert tuple(t.payload(d)["scale_inv"].shape) == expect[d]
        assert tuple(t.payload(d)["data"].shape) == (m, k)
        eb = _elementwise_bound(q, d, t.payload(d), x.reshape(m, k))
        assert ((t.dequantize(direction=d).reshape(m, k) - x.reshape(m, k)).abs() <= eb).all()


# =================================================================================================
# empty payloads == quantize(zeros)
# =================================================================================================


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("q", params())
def test_empty_payload_is_quantized_zeros(q, shape, dtype):
    x = randn(*shape, seed=61, dtype=dtype)
    t = quantize(q, x)
    z = quantize(q, torch.zeros(shape, dtype=dtype))
    for e in (torch.empty_like(t), torch.zeros_like(t), t.new_zeros(shape), t.new_empty(shape)):
        assert_qt_equal(e, z)
    # a different shape through new_zeros / new_empty
    half = (shape[0] // 2, *shape[1:])
    zh = quantize(q, torch.zeros(half, dtype=dtype))
    assert_qt_equal(t.new_zeros(half), zh)
    assert_qt_equal(t.new_empty(half), zh)
    # one direction only: the empty tensor has only that direction
    r = quantize(q, x, columnwise=False)
    assert_qt_equal(torch.empty_like(r), quantize(q, torch.zeros(shape, dtype=dtype), columnwise=False))
    # zero_() in place gives the same bytes
    t.zero_()
    assert_qt_equal(t, z)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(37,), (5, 9), (3, 1, 17), (2, 3, 4, 5)])
def test_stored_amax_is_the_flat_max_of_the_stored_bits(shape, dtype):
    """``stored_amax`` reduces rows first, then the rows (a shape inductor splits well): the same
    value, bit for bit, as one flat max over the bit patterns with the sign cleared, NaN payloads,
    infinities and -0 included, on a transposed (non-contiguous) view too."""
    from dtq._bits import stored_amax

    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    g = torch.Generator().manual_seed(len(shape))
    n = int(torch.tensor(shape).prod())
    bits = torch.randint(torch.iinfo(ints).min, torch.iinfo(ints).max, (n,), generator=g, dtype=torch.int64)
    for x in (bits.to(ints).view(dtype).reshape(shape), torch.randn(shape, generator=g).to(dtype)):
        x.view(-1)[:2] = torch.tensor([float("-inf"), -0.0], dtype=dtype)
        for t in (x, x.transpose(0, -1)):
            flat = (t.reshape(-1).view(ints) & torch.iinfo(ints).max).max().view(dtype).float()
            got = stored_amax(t)
            assert got.dtype == torch.float32 and got.shape == ()
            assert got.view(torch.int32) == flat.view(torch.int32), (t, got, flat)
