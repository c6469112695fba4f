"""Codecs bound to (quantizer, direction): ``q.codec(d)`` is built once and kept on the quantizer,
its one ``dequantize`` entry point covers the factored / rotated / kernel reads, the transitional
and a new format is one registered class."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch

import dtq
from dtq import _bits
from dtq import codec as base
from dtq.gemm import Operand

QUANTIZERS = [
    dtq.Float8Quantizer(),
    dtq.Float8Quantizer(torch.float8_e5m2, pow2_scales=True),
    dtq.Float8RowwiseQuantizer(),
    dtq.Float8BlockQuantizer((1, 128)),
    dtq.Float8BlockQuantizer((128, 128)),
    dtq.MXFP8Quantizer(),
    dtq.MXFP8Quantizer(scale_rounding="floor"),
    dtq.NVFP4Quantizer(),
    dtq.NVFP4Quantizer((16, 16)),
    dtq.NVFP4Quantizer(stochastic_rounding=True),
    dtq.NVFP4Quantizer(random_hadamard=True),
    dtq.NVFP4Quantizer(row_scaled=True, random_hadamard=True),
    dtq.NVFP4Quantizer(four_over_six=True),
    dtq.IdentityQuantizer(),
    dtq.IdentityQuantizer(torch.bfloat16),
]
HYBRID = dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer(random_hadamard=True))
SHAPE = (128, 256)


def _fresh(q):
    """An equal quantizer object that has not bound its codecs yet."""
    return dataclasses.replace(q)


def _x(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*SHAPE, generator=g) * torch.logspace(-2, 2, SHAPE[1])
    x[3, 5] = float("nan")
    return x.to(dtype)


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits_of(a), _bits_of(b))


def test_every_registered_format_is_covered():
    assert {type(q) for q in QUANTIZERS} == set(dtq.formats.registered_quantizers())


@pytest.mark.parametrize("q", QUANTIZERS + [HYBRID], ids=repr)
def test_binding_is_cached_on_the_quantizer(q):
    q = _fresh(q)
    for d in dtq.DIRECTIONS:
        c = q.codec(d)
        assert c is q.codec(d), "a second bind built a new codec"
        assert c.q is q.for_direction(d) and c.direction == d
        assert c.name == q.for_direction(d).format_name
        # a hybrid hands out its sub-quantizer's own (cached) codec
        assert c is q.for_direction(d).codec(d)
    with pytest.raises(ValueError, match="direction must be 'rowwise' or 'columnwise'"):
        q.codec("rows")


def test_unregistered_quantizer_has_no_codec():
    @dataclasses.dataclass(frozen=True)
    class Unregistered(dtq.Quantizer):
        pass

    with pytest.raises(TypeError, match="Unregistered has no registered codec"):
        Unregistered().codec("rowwise")


@pytest.mark.parametrize("q", QUANTIZERS + [HYBRID], ids=repr)
def test_binding_leaves_the_quantizer_value_alone(q):
    """The cache is not a field: equality, hashing, repr, pickles and copies are those of the config."""
    fresh, bound = _fresh(q), _fresh(q)
    before = pickle.dumps(bound)
    bound.codec("rowwise")
    assert pickle.dumps(bound) == before
    assert bound == fresh and hash(bound) == hash(fresh) and repr(bound) == repr(fresh)
    clone = copy.deepcopy(bound)
    assert clone == bound and "_codecs" not in vars(clone)
    assert clone.codec("columnwise") is not bound.codec("columnwise") and clone.codec(
        "columnwise"
    ).q is clone.for_direction("columnwise")
    t = bound.quantize(_x(), seed=3)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert back.quantizer == bound and all(_same(back.payload(d), t.payload(d)) for d in t.directions)


@pytest.mark.parametrize("q", QUANTIZERS + [HYBRID], ids=repr)
def test_hot_paths_hold_the_cached_codec(q):
    t = q.quantize(_x(), seed=3)
    plan = base.quantize_plan(q, dtq.DIRECTIONS, SHAPE, torch.float32, torch.device("cpu"))
    for d in dtq.DIRECTIONS:
        assert plan.codecs[d] is plan.q.codec(d) and plan.q == q  # plans are shared by equal quantizers
        assert Operand(t, d).codec is q.codec(d)
        assert Operand(t.quantizer.quantize_data(_x(), seed=3), d).codec is q.codec(d)


@pytest.mark.parametrize("q", QUANTIZERS, ids=repr)
@pytest.mark.parametrize("d", dtq.DIRECTIONS)
def test_bound_codec_is_what_quantize_and_dequantize_use(q, d):
    x = _x()
    t = q.quantize(x, seed=7)
    c = q.codec(d)
    amax = c.local_amax(x) if c.needs_amax() else None
    payload = c.quantize(x, amax, torch.tensor(7) if c.uses_rng() else None)
    assert _same(payload, dict(t.payload(d)))
    assert _same(c.dequantize(payload, SHAPE), t.dequantize(torch.float32, direction=d))
    assert set(payload) == set(c.fields())
    empty = c.empty(SHAPE, torch.device("cpu"), torch.float32)
    assert {k: (v.shape, v.dtype) for k, v in empty.items()} == {k: (v.shape, v.dtype) for k, v in payload.items()}
    assert torch.equal(c.dequantize(empty, SHAPE), torch.zeros(SHAPE))


@pytest.mark.parametrize("q", QUANTIZERS, ids=repr)
@pytest.mark.parametrize("d", dtq.DIRECTIONS)
def test_dequantize_options(q, d):
    c = q.codec(d)
    payload = q.quantize(_x(), seed=7).payload(d)
    plain = c.dequantize(payload, SHAPE)
    assert plain.dtype == torch.float32 and tuple(plain.shape) == SHAPE
    assert _same(c.dequantize(payload, SHAPE, torch.bfloat16), plain.to(torch.bfloat16))
    for dtype in (torch.float32, torch.bfloat16):
        vals, factor = c.dequantize(payload, SHAPE, dtype, factored=True)
        assert vals.dtype == dtype and tuple(vals.shape) == SHAPE
        if factor is None:  # (NaN bits may differ between the two roundings; positions may not)
            torch.testing.assert_close(vals, plain.to(dtype), rtol=0, atol=0, equal_nan=True)
        else:  # the factor lies along the output dims: 0-dim, [M, 1] or [1, K]
            assert factor.dim() == 0 or tuple(factor.shape) in ((SHAPE[0], 1), (1, SHAPE[1]))
            if dtype == torch.float32:  # the same values up to fp32 rounding (cancellation in an inverse Hadamard)
                scale = plain.nan_to_num(0, 0, 0).abs().max().item()
                torch.testing.assert_close(vals * factor, plain, rtol=1e-6, atol=1e-6 * scale, equal_nan=True)
        rvals, rfactor = c.dequantize(payload, SHAPE, dtype, rotated=True)
        assert _same(rfactor, factor)
        if c.rotation() is None:
            assert _same(rvals, vals)
        elif dtype == torch.float32:  # rotated values are the factored ones before the inverse transform
            assert not _same(rvals, vals)
            assert _same(_bits.hadamard_rows(rvals, q.hadamard_seed, inverse=True), vals)
        # CPU payloads: no kernel applies
        assert c.dequantize(payload, SHAPE, dtype, kernel_only=True) is None
        assert c.dequantize(payload, SHAPE, dtype, factored=True, kernel_only=True) is None
        assert c.dequantize(payload, SHAPE, dtype, rotated=True, kernel_only=True) is None


def test_a_hybrid_has_no_codec_of_its_own():
    """A hybrid binds each direction to its sub-quantizer's codec; the registry has none for it."""
    with pytest.raises(TypeError, match="HybridQuantizer has no registered codec"):
        base.codec_class(HYBRID)
    for d in dtq.DIRECTIONS:
        assert HYBRID.codec(d) is HYBRID.for_direction(d).codec(d)


# -- a new format is one registered class ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Bf16Quantizer(dtq.Quantizer):
    """A toy format: values rounded to bfloat16, no scale."""


class _Bf16Codec(base.Codec):
    name = "toy_bf16"

    def fields(self):
        return {"data": 1}

    def quantize(self, x, amax=None, seed=None):
        return {"data": x.to(torch.bfloat16)}

    def _reference(self, payload, shape):
        return payload["data"].to(torch.float32)

    def empty(self, shape, device, dtype):
        return {"data": torch.zeros(shape, dtype=torch.bfloat16, device=device)}


def test_a_new_format_is_one_registered_codec(monkeypatch):
    for registry in ("_REGISTRY", "_BY_NAME"):  # leave the real registry as it was
        monkeypatch.setattr(base, registry, dict(getattr(base, registry)))
    base.register(_Bf16Quantizer)(_Bf16Codec)
    q = _Bf16Quantizer()
    x = _x().nan_to_num()
    t = q.quantize(x)
    assert q.format_name == "toy_bf16" and isinstance(q.codec("columnwise"), _Bf16Codec)
    assert torch.equal(t.dequantize(), x.to(torch.bfloat16).float())
    vals, factor = q.codec("rowwise").dequantize(t.payload("rowwise"), SHAPE, torch.bfloat16, factored=True)
    assert factor is None and torch.equal(vals, x.to(torch.bfloat16))
    piece = t[:64]  # generic dim-0 slicing reads the codec's fields
    assert type(piece) is dtq.QuantizedTensor and torch.equal(piece.dequantize(), t.dequantize()[:64])
    with pytest.raises(RuntimeError, match="already has a codec"):
        base.register(_Bf16Quantizer)(_Bf16Codec)


@pytest.mark.parametrize("q", QUANTIZERS, ids=repr)
@pytest.mark.parametrize("d", base.DIRECTIONS)
def test_a_tensor_max_amax_commutes_with_casts(q, d):
    """A codec that says its amax is the tensor-wide max|x| (``amax_is_tensor_max``) is relied on
    for two shortcuts: both directions share one value, and ``precompute_amax`` takes the amax of
    an FP32 shard and casts it instead of casting the shard. Check both claims where it is made."""
    c = q.codec(d)
    if not (c.needs_amax() and c.amax_is_tensor_max()):
        return
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, SHAPE[1])
    assert torch.equal(c.local_amax(x), x.abs().amax().float())
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(c.local_amax(x.to(dtype)), c.local_amax(x).to(dtype).float()), dtype


def test_which_codecs_take_the_tensor_max():
    assert dtq.Float8Quantizer().codec(base.ROWWISE).amax_is_tensor_max()
    assert not dtq.Float8RowwiseQuantizer().codec(base.COLUMNWISE).amax_is_tensor_max()  # one per column
    assert not dtq.NVFP4Quantizer(random_hadamard=True).codec(base.COLUMNWISE).amax_is_tensor_max()
