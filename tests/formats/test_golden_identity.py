"""Golden tests of the reference IdentityQuantizer (docs/design.md section 2).
Every expected code and scale is written literally and derived by hand in a comment; the bit
patterns and the ``f32`` convention are in _golden.py."""

from __future__ import annotations

import torch

import dtq
from tests.formats._golden import INF, NAN, assert_f32, fp32


def test_identity_bitwise_passthrough():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = NAN, -INF, -0.0, 1e-40  # NaN, inf, -0, (bf16) subnormal
    t = dtq.IdentityQuantizer().quantize(x)
    for d in ("rowwise", "columnwise"):
        data = t.payload(d)["data"]
        assert data.dtype == torch.bfloat16
        assert torch.equal(data.view(torch.int16), x.view(torch.int16))
    # a copy, not an alias of the input
    before = x.view(torch.int16).clone()
    x.fill_(1.0)
    assert torch.equal(t.payload("rowwise")["data"].view(torch.int16), before)


def test_identity_dtype_option():
    # bf16 -> fp32 is exact
    x = torch.tensor([[1.5, -2.25, 3e-3, -0.0]], dtype=torch.bfloat16)
    p = dtq.IdentityQuantizer(dtype=torch.float32).quantize(x).payload("rowwise")
    assert p["data"].dtype == torch.float32
    assert_f32(p["data"], fp32([[1.5, -2.25, float(x[0, 2]), -0.0]]))
    # fp32 -> bf16 rounds to nearest even (7 mantissa bits, ulp at 1 = 2^-7):
    #   1 + 2^-8   : tie between 1.0 (0x3F80) and 1+2^-7 (0x3F81) -> even 0x3F80
    #   1 + 3*2^-8 : tie between 0x3F81 and 0x3F82 -> even 0x3F82
    #   -2.0 -> 0xC000
    x = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-8, -2.0]])
    p = dtq.IdentityQuantizer(dtype=torch.bfloat16).quantize(x).payload("rowwise")
    assert p["data"].dtype == torch.bfloat16
    assert torch.equal(p["data"].view(torch.int16), torch.tensor([[0x3F80, 0x3F82, -0x4000]], dtype=torch.int16))
