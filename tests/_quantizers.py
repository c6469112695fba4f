"""Shared test helpers: the quantizer list ("every format and a hybrid") and bit-level comparisons.

Nothing here calls into dtq's codecs for the facts it checks: payload layouts (which logical rows
one payload row covers) and reference dequantization are written from the format docstrings and
docs/design.md section 2, so the tests compare dtq against an independent reading of the contract.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtq

SEED = 1234  # stochastic-rounding seed passed to every quantize() call in the tests

# (id, quantizer). Ids are what pytest prints.
QUANTIZERS = [
    ("fp8_e4m3", dtq.Float8Quantizer()),
    ("fp8_e5m2_pow2", dtq.Float8Quantizer(torch.float8_e5m2, pow2_scales=True)),
    ("fp8row_e4m3", dtq.Float8RowwiseQuantizer()),
    ("fp8row_e5m2_pow2", dtq.Float8RowwiseQuantizer(torch.float8_e5m2, pow2_scales=True)),
    ("fp8block_1x128", dtq.Float8BlockQuantizer((1, 128))),
    ("fp8block_128x128", dtq.Float8BlockQuantizer((128, 128))),
    ("mxfp8_ceil", dtq.MXFP8Quantizer()),
    ("mxfp8_floor", dtq.MXFP8Quantizer(scale_rounding="floor")),
    ("nvfp4_1x16", dtq.NVFP4Quantizer()),
    ("nvfp4_16x16", dtq.NVFP4Quantizer((16, 16))),
    ("nvfp4_sr", dtq.NVFP4Quantizer(stochastic_rounding=True)),
    ("nvfp4_rht", dtq.NVFP4Quantizer(random_hadamard=True)),
    ("identity", dtq.IdentityQuantizer()),
    ("identity_bf16", dtq.IdentityQuantizer(torch.bfloat16)),
    ("hybrid_mxfp8_nvfp4", dtq.HybridQuantizer(rowwise=dtq.MXFP8Quantizer(), columnwise=dtq.NVFP4Quantizer())),
    ("hybrid_fp8row_mxfp8", dtq.HybridQuantizer(rowwise=dtq.Float8RowwiseQuantizer(), columnwise=dtq.MXFP8Quantizer())),
    (
        "hybrid_fp8block_identity",
        dtq.HybridQuantizer(rowwise=dtq.Float8BlockQuantizer(), columnwise=dtq.IdentityQuantizer()),
    ),
]
IDS = [i for i, _ in QUANTIZERS]
ALL = [q for _, q in QUANTIZERS]
PLAIN = [(i, q) for i, q in QUANTIZERS if not isinstance(q, dtq.HybridQuantizer)]


def params(items=QUANTIZERS):
    """``pytest.mark.parametrize`` argument list with readable ids."""
    return [pytest.param(q, id=i) for i, q in items]


def by_id(name: str):
    return dict(QUANTIZERS)[name]


def is_hybrid(q) -> bool:
    return isinstance(q, dtq.HybridQuantizer)


def sub(q, direction):
    return q.for_direction(direction)


def uses_sr(q) -> bool:
    return any(isinstance(sub(q, d), dtq.NVFP4Quantizer) and sub(q, d).stochastic_rounding for d in dtq.DIRECTIONS)


def uses_rht(q) -> bool:
    return any(isinstance(sub(q, d), dtq.NVFP4Quantizer) and sub(q, d).random_hadamard for d in dtq.DIRECTIONS)


def quantize(q, x, **kw):
    """``q.quantize`` with a fixed stochastic-rounding seed (ignored by deterministic formats)."""
    kw.setdefault("seed", SEED)
    return q.quantize(x, **kw)


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


# -- bit-level comparison -------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (fp8 / fp32 / bf16 all viewed as uint8), so NaN == NaN and -0 != +0."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def assert_payload_equal(a: dict, b: dict, what: str = "payload"):
    assert set(a) == set(b), f"{what}: fields {sorted(a)} != {sorted(b)}"
    for k in a:
        assert a[k].dtype == b[k].dtype, f"{what}[{k}]: dtype {a[k].dtype} != {b[k].dtype}"
        assert tuple(a[k].shape) == tuple(b[k].shape), f"{what}[{k}]: shape {tuple(a[k].shape)} != {tuple(b[k].shape)}"
        assert torch.equal(bits(a[k]), bits(b[k])), f"{what}[{k}]: bytes differ"


def assert_qt_equal(a, b, directions=None):
    """Same class, quantizer, directions, shape, dtype and bitwise payloads."""
    assert isinstance(a, dtq.QuantizedTensor) and isinstance(b, dtq.QuantizedTensor)
    assert a.quantizer == b.quantizer
    assert a.directions == b.directions
    assert tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
    for d in directions or a.directions:
        assert_payload_equal(a.payload(d), b.payload(d), f"{d} payload")


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# -- independent reading of the documented layouts ------------------------------------------------


def rows_per_payload_row(q, direction: str, field: str):
    """How many logical rows of the [M, K] view one row of payload ``field`` covers (None: 0-dim
    per-tensor value, or one row of per-column values, shared by every slice). Written from the
    format docstrings."""
    s = sub(q, direction)
    if field == "data":
        return 1
    if isinstance(s, dtq.Float8Quantizer):
        return None  # scale_inv 0-dim
    if isinstance(s, dtq.Float8RowwiseQuantizer):
        return 1 if direction == "rowwise" else None  # [M, 1] per row; [1, K] per column, shared by all rows
    if isinstance(s, dtq.Float8BlockQuantizer):
        return 1 if (s.block == (1, 128) and direction == "rowwise") else 128
    if isinstance(s, dtq.MXFP8Quantizer):
        return 1 if direction == "rowwise" else 32
    if isinstance(s, dtq.NVFP4Quantizer):
        if field == "amax":  # 0-dim; row_scaled: [M, 1] per row, [1, K] per column (shared by all rows)
            return 1 if s.row_scaled and direction == "rowwise" else None
        return 1 if (s.block == (1, 16) and direction == "rowwise") else 16
    raise AssertionError(f"unknown field {field} of {s}")


def payload_rows(q, direction, payload: dict, start: int, end: int) -> dict:
    """Rows [start, end) of the [M, K] view, cut from each payload tensor by the documented layout."""
    out = {}
    for k, v in payload.items():
        r = rows_per_payload_row(q, direction, k)
        out[k] = v if r is None else v[start // r : -(-end // r)]
    return out


def expand(s: torch.Tensor, tile, shape):
    """One value per (br, bc) tile -> [M, K] element grid, edge tiles cropped."""
    br, bc = tile
    m, k = shape
    return s.repeat_interleave(br, 0)[:m].repeat_interleave(bc, 1)[:, :k]


def tile_of(s, direction):
    if isinstance(s, dtq.Float8BlockQuantizer):
        b = s.block
    elif isinstance(s, dtq.MXFP8Quantizer):
        b = (1, 32)
    elif isinstance(s, dtq.NVFP4Quantizer):
        b = s.block
    else:
        raise AssertionError(s)
    return b if (direction == "rowwise" or b[0] == b[1]) else (b[1], b[0])


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [M, K/2] -> codes [M, K]; element 2i in the low nibble (float4_e2m1fn_x2 order)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), -1).reshape(packed.shape[0], -1)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    mag = E2M1[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def nvfp4_s_enc(amax: torch.Tensor, e4m3_max: float = 448.0) -> torch.Tensor:
    """S_enc = e4m3_max * 6 / amax (per tensor, or per row / column: amax [M, 1] / [1, K])."""
    a = amax.float()
    ok = torch.isfinite(a) & (a > 0)
    return torch.where(ok, torch.tensor(e4m3_max * 6.0) / torch.where(ok, a, torch.ones_like(a)), torch.ones_like(a))


def element_scale(q, direction, payload, shape2):
    """Per-element dequantization multiplier (x-space value of one unit of the element code) for
    the block-scaled formats, from the documented payload layout."""
    s = sub(q, direction)
    if isinstance(s, (dtq.Float8Quantizer, dtq.Float8RowwiseQuantizer)):
        return payload["scale_inv"].float().expand(shape2)  # 0-dim, [M, 1] or [1, K]
    if isinstance(s, dtq.Float8BlockQuantizer):
        return expand(payload["scale_inv"].float(), tile_of(s, direction), shape2)
    if isinstance(s, dtq.MXFP8Quantizer):
        e = payload["scale"].to(torch.float32) - 127
        return expand(torch.ldexp(torch.ones_like(e), e), tile_of(s, direction), shape2)
    if isinstance(s, dtq.NVFP4Quantizer):
        return expand(payload["scale"].float(), tile_of(s, direction), shape2) / nvfp4_s_enc(
            payload["amax"], s.e4m3_max
        )
    raise AssertionError(s)


def ref_dequantize(q, direction, payload, shape2):
    """Reference dequantization from the documented layout (not for random_hadamard columnwise)."""
    s = sub(q, direction)
    if isinstance(s, dtq.IdentityQuantizer):
        return payload["data"].float()
    if isinstance(s, dtq.NVFP4Quantizer):
        assert not (s.random_hadamard and direction == "columnwise")
        vals = decode_e2m1(unpack_e2m1(payload["data"]))
        s_b = expand(payload["scale"].float(), tile_of(s, direction), shape2)
        return (vals * s_b) / nvfp4_s_enc(payload["amax"], s.e4m3_max)
    return payload["data"].float() * element_scale(q, direction, payload, shape2)


def shape2d(shape):
    m = 1
    for s in shape[:-1]:
        m *= s
    return (m, shape[-1])


def replace(q):
    """An equal but distinct quantizer object."""
    return dataclasses.replace(q)
