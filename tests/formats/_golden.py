"""Shared pieces of the golden tests of the reference format semantics (test_golden_*.py,
docs/design.md section 2).

Every expected code / scale there is written literally and derived by hand in a comment; nothing is
computed with dtq itself. Bit patterns used throughout:

* E4M3 (float8_e4m3fn): s eeee mmm, bias 7, max 448 = 1.75*2^8 = 0x7E, NaN 0x7F,
  subnormals m*2^-9 (m = 1..7), min normal 2^-6 = 0x08. 1.0 = 0x38.
* E5M2 (float8_e5m2):   s eeeee mm, bias 15, max 57344 = 1.75*2^15 = 0x7B, subnormals m*2^-16,
  1.0 = 0x3C. dtq writes 0x7F for NaN in both formats.
* E2M1 (fp4): s ee m, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} = codes 0..7, sign in bit 3.
* E8M0: biased exponent, 2^(b - 127); 0xFF = NaN.

fp32 constants that are not exact are written as ``f32(python_expr)``: Python evaluates the
expression in double and ``f32`` rounds it to the nearest fp32. For a single +,-,*,/ of fp32
operands that double rounding is innocuous (53 >= 2*24 + 2), so this equals the fp32 operation.
"""

from __future__ import annotations

import struct

import torch

E4 = torch.float8_e4m3fn
E5 = torch.float8_e5m2
NAN = float("nan")
INF = float("inf")


def f32(v: float) -> float:
    """Round a Python float to the nearest fp32 (RNE)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def codes(values, shape=None) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.uint8)
    return t.reshape(shape) if shape is not None else t


def fp32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def assert_fp8(actual: torch.Tensor, dtype: torch.dtype, expected_u8: torch.Tensor) -> None:
    assert actual.dtype == dtype, actual.dtype
    got = u8(actual)
    assert torch.equal(got, expected_u8), (
        f"\n got      {[hex(v) for v in got.flatten().tolist()]}\n expected "
        f"{[hex(v) for v in expected_u8.flatten().tolist()]}"
    )


def assert_f32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32, actual.dtype
    # compare bit patterns so that NaN == NaN and -0.0 != +0.0
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual.view(torch.int32), expected.to(torch.float32).view(torch.int32)), (actual, expected)
