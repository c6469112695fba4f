"""Golden tests for the reference format semantics (docs/design.md section 2).

Every expected code / scale below is written literally and derived by hand in a comment; nothing is
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

import os

import pytest
import torch

import dtq

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
    assert torch.equal(got, expected_u8), f"\n got      {[hex(v) for v in got.flatten().tolist()]}\n expected " \
                                          f"{[hex(v) for v in expected_u8.flatten().tolist()]}"


def assert_f32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32, actual.dtype
    # compare bit patterns so that NaN == NaN and -0.0 != +0.0
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual.view(torch.int32), expected.to(torch.float32).view(torch.int32)), (actual, expected)


# =================================================================================================
# Float8Quantizer (per-tensor current scaling)


def test_float8_e4m3_basic_scale_and_codes():
    # amax = 4 -> scale = 448/4 = 112 (exact), scale_inv = 1/112.
    # x*112 = [112, -224, 56, 448]:
    #   112 = 1.75*2^6 -> e=6+7=13, m=6 -> 0 1101 110 = 0x6E
    #  -224 = 1.75*2^7 -> e=14,     m=6 -> 1 1110 110 = 0xF6
    #    56 = 1.75*2^5 -> e=12,     m=6 -> 0 1100 110 = 0x66
    #   448 = max                                      = 0x7E
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    t = dtq.Float8Quantizer().quantize(x)
    p = t.payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x6E, 0xF6], [0x66, 0x7E]]))
    assert_f32(p["scale_inv"], fp32(f32(1 / 112)))
    # one scale -> the columnwise payload holds the same codes
    c = t.payload("columnwise")
    assert_fp8(c["data"], E4, codes([[0x6E, 0xF6], [0x66, 0x7E]]))
    assert_f32(c["scale_inv"], fp32(f32(1 / 112)))


def test_float8_e4m3_non_pow2_scale():
    # amax = 3 -> scale = fl32(448/3) = 149.33332824707031 (rounded down), scale_inv = fl32(1/scale)
    #   3*scale  = 447.99998 -> nearest E4M3 is 448 (step 32 in [256,448])  -> 0x7E
    #   1*scale  = 149.33 -> [128,256) step 16: 144 = 1.125*2^7 -> 0 1110 001 = 0x71
    #  -1.5*scale= -224                                                     -> 0xF6
    #   0.1*scale= 14.93 -> [8,16) step 1: 15 = 1.875*2^3 -> 0 1010 111       = 0x57
    x = torch.tensor([[3.0, 1.0, -1.5, 0.1]])
    p = dtq.Float8Quantizer().quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x7E, 0x71, 0xF6, 0x57]]))
    assert_f32(p["scale_inv"], fp32(f32(1 / f32(448 / 3))))


def test_float8_e4m3_saturates_with_explicit_small_amax():
    # explicit amax 2 -> scale 224; x*224 = [224, 1792, -1792, 448, 112]
    #   224 -> 0x76; 1792 > 448 saturates -> 0x7E; -1792 -> 0xFE; 448 -> 0x7E; 112 -> 0x6E
    x = torch.tensor([[1.0, 8.0, -8.0, 2.0, 0.5]])
    p = dtq.Float8Quantizer().quantize(x, amax=torch.tensor(2.0)).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x76, 0x7E, 0xFE, 0x7E, 0x6E]]))
    assert_f32(p["scale_inv"], fp32(f32(1 / 224)))


def test_float8_e5m2_saturates_with_explicit_small_amax():
    # explicit amax 1 -> scale 57344; scale_inv = fl32(1/57344)
    #   1*57344 = 1.75*2^15 -> 0 11110 11 = 0x7B (max); 1000 -> saturates 0x7B; -1000 -> 0xFB
    #   0.5*57344 = 28672 = 1.75*2^14 -> 0 11101 11 = 0x77
    x = torch.tensor([[1.0, 1000.0, -1000.0, 0.5]])
    p = dtq.Float8Quantizer(dtype=E5).quantize(x, amax=torch.tensor(1.0)).payload("rowwise")
    assert_fp8(p["data"], E5, codes([[0x7B, 0x7B, 0xFB, 0x77]]))
    assert_f32(p["scale_inv"], fp32(f32(1 / 57344)))


def test_float8_e4m3_pow2_scales_round_down():
    # amax 3: 448/3 = 149.33 -> largest power of two below = 128 -> scale_inv = 2^-7 exactly.
    #   3*128 = 384 = 1.5*2^8 -> 0 1111 100 = 0x7C;  1*128 = 2^7 -> 0 1110 000 = 0x70
    #  -0.5*128 = -64 = -2^6 -> 1 1101 000 = 0xE8;  0.1*128 = 12.8 -> 13 = 1.625*2^3 -> 0 1010 101 = 0x55
    x = torch.tensor([[3.0, 1.0, -0.5, 0.1]])
    t = dtq.Float8Quantizer(pow2_scales=True).quantize(x)
    p = t.payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x7C, 0x70, 0xE8, 0x55]]))
    assert_f32(p["scale_inv"], fp32(2.0**-7))
    # dequant = codes * 2^-7, exact: [384, 128, -64, 13] / 128
    assert_f32(t.dequantize(torch.float32), fp32([[3.0, 1.0, -0.5, 13 / 128]]))


@pytest.mark.parametrize("amax, scale_inv", [
    (3.5, 2.0**-7),   # 448/3.5 = 128 exactly, already a power of two -> kept
    (7.0, 2.0**-6),   # 448/7 = 64
    (1.0, 2.0**-8),   # 448 -> 256
    (1000.0, 4.0),    # 0.448 -> 0.25
])
def test_float8_pow2_scale_values(amax, scale_inv):
    x = torch.tensor([[amax, -amax / 2]])
    p = dtq.Float8Quantizer(pow2_scales=True).quantize(x).payload("rowwise")
    assert_f32(p["scale_inv"], fp32(scale_inv))


def test_float8_e5m2_pow2_scales():
    # amax 3: 57344/3 = 19114.67 -> 2^14; scale_inv = 2^-14
    #   3*2^14 = 49152 = 1.5*2^15 -> 0 11110 10 = 0x7A;  1*2^14 -> 0 11101 00 = 0x74
    x = torch.tensor([[3.0, 1.0]])
    p = dtq.Float8Quantizer(dtype=E5, pow2_scales=True).quantize(x).payload("rowwise")
    assert_fp8(p["data"], E5, codes([[0x7A, 0x74]]))
    assert_f32(p["scale_inv"], fp32(2.0**-14))


def test_float8_amax_zero_scale_one():
    # all-zero input: amax 0 -> scale 1 -> codes 0, scale_inv 1
    p = dtq.Float8Quantizer().quantize(torch.zeros(2, 4)).payload("rowwise")
    assert_fp8(p["data"], E4, torch.zeros(2, 4, dtype=torch.uint8))
    assert_f32(p["scale_inv"], fp32(1.0))
    # explicit amax 0 with non-zero data: scale 1, so 0.5 -> 0x30 and 1000 saturates to 448 -> 0x7E
    p = dtq.Float8Quantizer().quantize(torch.tensor([[0.5, 1000.0]]), amax=torch.tensor(0.0)).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x30, 0x7E]]))
    assert_f32(p["scale_inv"], fp32(1.0))


@pytest.mark.parametrize("bad", [NAN, INF])
def test_float8_nonfinite_explicit_amax_scale_one(bad):
    # scale 1: 1.0 -> 0x38, -2 -> 1 1000 000 = 0xC0, 3 = 1.5*2 -> 0 1000 100 = 0x44
    x = torch.tensor([[1.0, -2.0, 3.0]])
    p = dtq.Float8Quantizer().quantize(x, amax=torch.tensor(bad)).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x38, 0xC0, 0x44]]))
    assert_f32(p["scale_inv"], fp32(1.0))


def test_float8_nan_input():
    # computed amax is NaN -> scale 1; NaN -> 0x7F whatever its sign; 1 -> 0x38, -2 -> 0xC0, 0.5 -> 0x30
    x = torch.tensor([[1.0, NAN, -2.0, 0.5, -NAN]])
    assert torch.signbit(x[0, 4])  # the last NaN really is negative
    p = dtq.Float8Quantizer().quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x38, 0x7F, 0xC0, 0x30, 0x7F]]))
    assert_f32(p["scale_inv"], fp32(1.0))
    # with a finite explicit amax (4 -> scale 112): NaN still 0x7F, 1 -> 112 -> 0x6E
    p = dtq.Float8Quantizer().quantize(torch.tensor([[NAN, 1.0]]), amax=torch.tensor(4.0)).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x7F, 0x6E]]))
    # E5M2 as well
    p = dtq.Float8Quantizer(dtype=E5).quantize(torch.tensor([[-NAN, 1.0]])).payload("rowwise")
    assert_fp8(p["data"], E5, codes([[0x7F, 0x3C]]))


def test_float8_inf_input_saturates():
    # computed amax = inf -> scale 1; +inf -> 448 (0x7E), -inf -> -448 (0xFE), 1 -> 0x38, 3 -> 0x44
    x = torch.tensor([[INF, -INF, 1.0, 3.0]])
    p = dtq.Float8Quantizer().quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x7E, 0xFE, 0x38, 0x44]]))
    assert_f32(p["scale_inv"], fp32(1.0))
    # explicit finite amax 1 -> scale 448: inf*448 = inf still saturates; 1*448 -> 0x7E
    p = dtq.Float8Quantizer().quantize(torch.tensor([[INF, -INF, 1.0]]), amax=torch.tensor(1.0)).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x7E, 0xFE, 0x7E]]))
    assert_f32(p["scale_inv"], fp32(f32(1 / 448)))
    # E5M2: +-inf -> +-57344 = 0x7B / 0xFB (never the inf code 0x7C)
    p = dtq.Float8Quantizer(dtype=E5).quantize(torch.tensor([[INF, -INF, 1.0]])).payload("rowwise")
    assert_fp8(p["data"], E5, codes([[0x7B, 0xFB, 0x3C]]))


def test_float8_e4m3_subnormals_and_negative_zero():
    # amax 448 -> scale 1 exactly, so the codes are the plain RNE E4M3 encodings:
    #   448      -> 0x7E
    #   2^-9     -> smallest subnormal, m=1              -> 0x01
    #   3*2^-9   -> m=3                                  -> 0x03
    #   2^-10    -> tie between 0 and 2^-9 -> even (0)  -> 0x00
    #   3*2^-10  -> tie between m=1 and m=2 -> even (2)  -> 0x02
    #   7*2^-9   -> largest subnormal                    -> 0x07
    #   15*2^-10 -> tie m=7 / 2^-6 (0x08) -> even        -> 0x08 (min normal)
    #   -2^-9    -> 0x81
    #   -2^-11   -> rounds to -0                         -> 0x80
    #   -0.0     -> 0x80 (sign kept)
    x = torch.tensor([[448.0, 2**-9, 3 * 2**-9, 2**-10, 3 * 2**-10, 7 * 2**-9, 15 * 2**-10, -(2**-9), -(2**-11),
                       -0.0]])
    p = dtq.Float8Quantizer().quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x7E, 0x01, 0x03, 0x00, 0x02, 0x07, 0x08, 0x81, 0x80, 0x80]]))
    assert_f32(p["scale_inv"], fp32(1.0))


def test_float8_e5m2_subnormals():
    # amax 57344 -> scale 1:
    #   57344 -> 0x7B; 2^-16 (min subnormal) -> 0x01; 3*2^-16 -> 0x03; 2^-17 tie 0/1 -> 0x00;
    #   3*2^-17 tie 1/2 -> 2 -> 0x02; 2^-14 (min normal) -> 0 00001 00 = 0x04; -2^-16 -> 0x81; -0.0 -> 0x80
    x = torch.tensor([[57344.0, 2**-16, 3 * 2**-16, 2**-17, 3 * 2**-17, 2**-14, -(2**-16), -0.0]])
    p = dtq.Float8Quantizer(dtype=E5).quantize(x).payload("rowwise")
    assert_fp8(p["data"], E5, codes([[0x7B, 0x01, 0x03, 0x00, 0x02, 0x04, 0x81, 0x80]]))
    assert_f32(p["scale_inv"], fp32(1.0))


def test_float8_subnormal_after_scaling():
    # amax 448*2^4 = 7168 -> scale 2^-4 = 448/7168 exactly; 2^-5 * 2^-4 = 2^-9 -> 0x01;
    # -3*2^-5 * 2^-4 = -3*2^-9 -> 0x83; 7168 -> 448 -> 0x7E. scale_inv = 16.
    x = torch.tensor([[7168.0, 2**-5, -3 * 2**-5]])
    p = dtq.Float8Quantizer().quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x7E, 0x01, 0x83]]))
    assert_f32(p["scale_inv"], fp32(16.0))


def test_float8_bf16_input_and_leading_dims():
    # bf16 [2, 1, 2] input is viewed as [M, K] = [2, 2]; amax 4 -> scale 112 as in the basic test
    x = torch.tensor([[[1.0, -2.0]], [[0.5, 4.0]]], dtype=torch.bfloat16)
    p = dtq.Float8Quantizer().quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, codes([[0x6E, 0xF6], [0x66, 0x7E]]))
    assert_f32(p["scale_inv"], fp32(f32(1 / 112)))


# =================================================================================================
# Float8BlockQuantizer


def _block_1x128_input():
    # [2, 256]: four (1,128) blocks
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, -1.0, 0.1        # block (0,0): amax 3
    # block (0,1): all zero
    x[1, 0], x[1, 5] = 0.5, -0.25                     # block (1,0): amax 0.5
    x[1, 128], x[1, 200], x[1, 255] = 1000.0, 1.0, -3.0  # block (1,1): amax 1000
    return x


def test_float8_block_1x128_pow2():
    # scales (pow2, default):
    #   (0,0) amax 3    : 448/3 = 149.3 -> 128   -> scale_inv 2^-7
    #   (0,1) amax 0    : scale 1                 -> scale_inv 1
    #   (1,0) amax 0.5  : 896 -> 512              -> scale_inv 2^-9
    #   (1,1) amax 1000 : 0.448 -> 0.25           -> scale_inv 4
    # codes:
    #   3*128 = 384 -> 0x7C; -1*128 -> 0xF0; 0.1*128 = 12.8 -> 13 -> 0x55
    #   0.5*512 = 256 = 2^8 -> 0 1111 000 = 0x78; -0.25*512 = -128 -> 0xF0
    #   1000*0.25 = 250 -> [128,256) step 16: 256 is nearest -> 0x78
    #   1*0.25 = 2^-2 -> 0 0101 000 = 0x28; -3*0.25 = -0.75 = -1.5*2^-1 -> 1 0110 100 = 0xB4
    x = _block_1x128_input()
    exp = torch.zeros(2, 256, dtype=torch.uint8)
    exp[0, 0], exp[0, 1], exp[0, 2] = 0x7C, 0xF0, 0x55
    exp[1, 0], exp[1, 5] = 0x78, 0xF0
    exp[1, 128], exp[1, 200], exp[1, 255] = 0x78, 0x28, 0xB4
    exp_si = fp32([[2.0**-7, 1.0], [2.0**-9, 4.0]])

    t = dtq.Float8BlockQuantizer().quantize(x)
    p = t.payload("rowwise")
    assert_fp8(p["data"], E4, exp)
    assert_f32(p["scale_inv"], exp_si)

    # columnwise (128,1) blocks along M are the rowwise blocks of x.T
    c = dtq.Float8BlockQuantizer().quantize(x.T.contiguous()).payload("columnwise")
    assert_fp8(c["data"], E4, exp.T.contiguous())
    assert_f32(c["scale_inv"], exp_si.T.contiguous())


def test_float8_block_1x128_no_pow2():
    # pow2_scales=False: scale = fl32(448/amax) per block, scale_inv = fl32(1/scale)
    #   (0,0) scale fl32(448/3) = 149.333328: 3 -> 447.99998 -> 448 0x7E; -1 -> -149.3 -> -144 0xF1;
    #         0.1 -> 14.93 -> 15 -> 0x57
    #   (0,1) zero block -> scale 1
    #   (1,0) scale 896: 0.5 -> 448 0x7E; -0.25 -> -224 0xF6
    #   (1,1) scale fl32(0.448) = 0.44800001: 1000 -> 448.00001 -> sat 448 0x7E;
    #         1 -> 0.448 -> [0.25,0.5) step 1/32: 14.34 -> 14/32 = 0.4375 = 1.75*2^-2 -> 0 0101 110 = 0x2E;
    #         -3 -> -1.344 -> [1,2) step 1/8: 10.75 -> 11/8 = 1.375 -> 1 0111 011 = 0xBB
    x = _block_1x128_input()
    exp = torch.zeros(2, 256, dtype=torch.uint8)
    exp[0, 0], exp[0, 1], exp[0, 2] = 0x7E, 0xF1, 0x57
    exp[1, 0], exp[1, 5] = 0x7E, 0xF6
    exp[1, 128], exp[1, 200], exp[1, 255] = 0x7E, 0x2E, 0xBB
    exp_si = fp32([[f32(1 / f32(448 / 3)), 1.0], [f32(1 / 896), f32(1 / f32(0.448))]])
    p = dtq.Float8BlockQuantizer(pow2_scales=False).quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, exp)
    assert_f32(p["scale_inv"], exp_si)


def test_float8_block_1x128_e5m2_and_partial_block():
    # K = 130: blocks [0,128) and a partial [128,130). E5M2, pow2:
    #   block 0 amax 3: 57344/3 -> 2^14 -> scale_inv 2^-14; 3*2^14 = 49152 -> 0x7A; 1*2^14 -> 0x74
    #   block 1 (2 elements) amax 0.5: 114688 -> 2^16 -> scale_inv 2^-16; -0.5*2^16 = -2^15 -> 1 11110 00 = 0xF8
    x = torch.zeros(1, 130)
    x[0, 0], x[0, 127], x[0, 129] = 3.0, 1.0, -0.5
    exp = torch.zeros(1, 130, dtype=torch.uint8)
    exp[0, 0], exp[0, 127], exp[0, 129] = 0x7A, 0x74, 0xF8
    p = dtq.Float8BlockQuantizer(dtype=E5).quantize(x).payload("rowwise")
    assert_fp8(p["data"], E5, exp)
    assert_f32(p["scale_inv"], fp32([[2.0**-14, 2.0**-16]]))


def _block_128_edge_input():
    # [130, 200]: (128,128) blocks rows [0,128) / [128,130), cols [0,128) / [128,200)
    x = torch.zeros(130, 200)
    x[5, 7], x[127, 127] = 3.0, -1.0        # block (0,0): amax 3
    x[0, 199], x[127, 128] = 1000.0, 1.0    # block (0,1): amax 1000 (partial along K)
    x[129, 0], x[128, 127] = 0.5, -0.25     # block (1,0): amax 0.5 (partial along M)
    x[129, 199], x[128, 128] = 7.0, 0.1     # block (1,1): amax 7 (partial along both)
    return x


def test_float8_block_128x128_edge_blocks_pow2():
    # scales: (0,0) 448/3 -> 128 (2^-7); (0,1) 0.448 -> 0.25 (4); (1,0) 896 -> 512 (2^-9); (1,1) 448/7 = 64 (2^-6)
    # codes:  3*128 = 384 -> 0x7C; -1*128 -> 0xF0
    #         1000*0.25 = 250 -> 256 -> 0x78; 1*0.25 -> 0x28
    #         0.5*512 = 256 -> 0x78; -0.25*512 = -128 -> 0xF0
    #         7*64 = 448 -> 0x7E; 0.1*64 = 6.4 -> [4,8) step 0.5: 12.8 -> 13*0.5 = 6.5 = 1.625*4 -> 0 1001 101 = 0x4D
    x = _block_128_edge_input()
    exp = torch.zeros(130, 200, dtype=torch.uint8)
    exp[5, 7], exp[127, 127] = 0x7C, 0xF0
    exp[0, 199], exp[127, 128] = 0x78, 0x28
    exp[129, 0], exp[128, 127] = 0x78, 0xF0
    exp[129, 199], exp[128, 128] = 0x7E, 0x4D
    exp_si = fp32([[2.0**-7, 4.0], [2.0**-9, 2.0**-6]])
    t = dtq.Float8BlockQuantizer(block=(128, 128)).quantize(x)
    for d in ("rowwise", "columnwise"):  # a 128x128 block serves both directions: identical payloads
        p = t.payload(d)
        assert_fp8(p["data"], E4, exp)
        assert_f32(p["scale_inv"], exp_si)


def test_float8_block_128x128_edge_blocks_no_pow2():
    # scale = fl32(448/amax): (0,0) 149.333 -> 3 -> 448 0x7E, -1 -> -144 0xF1
    #   (0,1) 0.448: 1000 -> sat 0x7E; 1 -> 0.4375 0x2E
    #   (1,0) 896: 0.5 -> 448 0x7E; -0.25 -> -224 0xF6
    #   (1,1) 64 (exact, same as pow2): 0x7E, 0x4D
    x = _block_128_edge_input()
    exp = torch.zeros(130, 200, dtype=torch.uint8)
    exp[5, 7], exp[127, 127] = 0x7E, 0xF1
    exp[0, 199], exp[127, 128] = 0x7E, 0x2E
    exp[129, 0], exp[128, 127] = 0x7E, 0xF6
    exp[129, 199], exp[128, 128] = 0x7E, 0x4D
    exp_si = fp32([[f32(1 / f32(448 / 3)), f32(1 / f32(0.448))], [f32(1 / 896), 2.0**-6]])
    p = dtq.Float8BlockQuantizer(block=(128, 128), pow2_scales=False).quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, exp)
    assert_f32(p["scale_inv"], exp_si)


def test_float8_block_128x128_zero_blocks():
    # [130, 200] with only block (0,0) non-zero (amax 448 -> scale 1 -> scale_inv 1, 448 -> 0x7E) and
    # one all-zero partial block (1,1) next to a non-zero partial block (1,0) (amax 0.5 -> 2^-9):
    # zero blocks get scale_inv 1 and zero codes.
    x = torch.zeros(130, 200)
    x[0, 0] = 448.0
    x[129, 3] = -0.5  # -0.5*512 = -256 -> 1 1111 000 = 0xF8
    exp = torch.zeros(130, 200, dtype=torch.uint8)
    exp[0, 0], exp[129, 3] = 0x7E, 0xF8
    p = dtq.Float8BlockQuantizer(block=(128, 128)).quantize(x).payload("rowwise")
    assert_fp8(p["data"], E4, exp)
    assert_f32(p["scale_inv"], fp32([[1.0, 1.0], [2.0**-9, 1.0]]))
    # fully zero tensor: every block scale_inv 1
    p = dtq.Float8BlockQuantizer(block=(128, 128), pow2_scales=False).quantize(torch.zeros(130, 200)).payload("rowwise")
    assert_fp8(p["data"], E4, torch.zeros(130, 200, dtype=torch.uint8))
    assert_f32(p["scale_inv"], torch.ones(2, 2))


# =================================================================================================
# MXFP8


# (dtype, scale_rounding, {position: value} of one 32-element block, biased E8M0, {position: code})
# Unlisted positions are 0 -> code 0x00.
_MX_CASES = [
    # ---- E4M3, ceil: e = ceil(log2(amax/448))
    # 448/448 = 1 -> e=0 -> 127. codes: 448 -> 0x7E, 1 -> 0x38, -0.5 -> 1 0110 000 = 0xB0
    ("e4m3-ceil-448", E4, "ceil", {0: 448.0, 1: 1.0, 2: -0.5}, 127, {0: 0x7E, 1: 0x38, 2: 0xB0}),
    # 449/448 = 1.0022 -> e=1 -> 128. /2: 224.5 -> 224 = 0x76; 0.5 -> 0x30; -1.5 = 1 0111 100 = 0xBC
    ("e4m3-ceil-449", E4, "ceil", {0: 449.0, 1: 1.0, 2: -3.0}, 128, {0: 0x76, 1: 0x30, 2: 0xBC}),
    # next fp32 below / above 448 (ulp 2^-15): quotient 1-2^-24 -> e=0 (127); 1+2^-23 -> e=1 (128)
    ("e4m3-ceil-448-ulp", E4, "ceil", {0: 448.0 - 2**-15}, 127, {0: 0x7E}),
    ("e4m3-ceil-448+ulp", E4, "ceil", {0: 448.0 + 2**-15}, 128, {0: 0x76}),  # 224.00002 -> 224
    # 1/448: log2 = -8.807 -> e=-8 -> 119. x*256: 1 -> 256 = 0x78; -0.5 -> -128 = 0xF0;
    # 0.01 -> 2.56 -> [2,4) step .25: 2.5 = 1.25*2 -> 0 1000 010 = 0x42
    ("e4m3-ceil-1", E4, "ceil", {0: 1.0, 1: -0.5, 2: 0.01}, 119, {0: 0x78, 1: 0xF0, 2: 0x42}),
    # amax -500 (negative): 500/448 -> e=1 -> 128; -250 -> -256 = 0xF8, 250 -> 0x78
    ("e4m3-ceil-500", E4, "ceil", {0: -500.0, 1: 500.0}, 128, {0: 0xF8, 1: 0x78}),
    # 896/448 = 2 exactly -> e=1 -> 128; 896/2 = 448 -> 0x7E
    ("e4m3-ceil-896", E4, "ceil", {0: 896.0}, 128, {0: 0x7E}),
    # 897/448 = 2.0022 -> e=2 -> 129; 897/4 = 224.25 -> 224 = 0x76
    ("e4m3-ceil-897", E4, "ceil", {0: 897.0}, 129, {0: 0x76}),
    # 0.9/448: log2 = -8.96 -> e=-8 -> 119; 0.9*256 = 230.4 -> 224 = 0x76
    ("e4m3-ceil-0.9", E4, "ceil", {0: 0.9}, 119, {0: 0x76}),
    # largest finite fp32 amax: log2(FLT_MAX/448) = 119.19 -> e=120 -> 247 (the +127 clamp is unreachable
    # from a finite amax); FLT_MAX/2^120 = 256*(1-2^-24) -> 256 = 0x78
    ("e4m3-ceil-fltmax", E4, "ceil", {0: torch.finfo(torch.float32).max}, 247, {0: 0x78}),
    # 2^100/448 -> log2 = 91.19 -> e=92 -> 219; 2^100/2^92 = 256 -> 0x78
    ("e4m3-ceil-2^100", E4, "ceil", {0: 2.0**100}, 219, {0: 0x78}),
    # 2^-118/448: log2 = -126.8 -> e=-126 -> biased 1; x*2^126: 256 -> 0x78
    ("e4m3-ceil-2^-118", E4, "ceil", {0: 2.0**-118}, 1, {0: 0x78}),
    # 2^-125/448: log2 = -133.8 -> -133 -> clamp -127 -> biased 0; q = x/2^-127 = x*2^127:
    # 2^-125 -> 4 = 0 1001 000 = 0x48; -2^-126 -> -2 = 0xC0
    ("e4m3-ceil-clamp", E4, "ceil", {0: 2.0**-125, 1: -(2.0**-126)}, 0, {0: 0x48, 1: 0xC0}),
    ("e4m3-ceil-zero", E4, "ceil", {}, 0, {}),
    # ---- E4M3, floor: e = floor(log2(amax)) - 8
    ("e4m3-floor-448", E4, "floor", {0: 448.0, 1: 1.0, 2: -0.5}, 127, {0: 0x7E, 1: 0x38, 2: 0xB0}),
    # floor(log2 449) = 8 -> e=0 -> 127: 449 -> 448 (0x7E); 1 -> 0x38; -3 -> 1 1000 100 = 0xC4
    ("e4m3-floor-449", E4, "floor", {0: 449.0, 1: 1.0, 2: -3.0}, 127, {0: 0x7E, 1: 0x38, 2: 0xC4}),
    ("e4m3-floor-1", E4, "floor", {0: 1.0, 1: -0.5, 2: 0.01}, 119, {0: 0x78, 1: 0xF0, 2: 0x42}),
    # 500: floor log2 = 8 -> e=0 -> 127; +-500 saturate to +-448
    ("e4m3-floor-500", E4, "floor", {0: 500.0, 1: -500.0}, 127, {0: 0x7E, 1: 0xFE}),
    # 512 - 2^-15: floor log2 = 8 -> 127 (saturates 0x7E); 512: 9-8 = 1 -> 128, 512/2 = 256 -> 0x78
    ("e4m3-floor-512-ulp", E4, "floor", {0: 512.0 - 2**-15}, 127, {0: 0x7E}),
    ("e4m3-floor-512", E4, "floor", {0: 512.0}, 128, {0: 0x78}),
    # 0.9: floor log2 = -1 -> e=-9 -> 118; 0.9*512 = 460.8 -> saturates 0x7E
    ("e4m3-floor-0.9", E4, "floor", {0: 0.9}, 118, {0: 0x7E}),
    # 2^-120: -120-8 = -128 -> clamp -127 -> 0; 2^-120*2^127 = 128 -> 0x70
    ("e4m3-floor-clamp", E4, "floor", {0: 2.0**-120}, 0, {0: 0x70}),
    ("e4m3-floor-zero", E4, "floor", {}, 0, {}),
    # ---- E5M2
    # ceil: 57344/57344 = 1 -> 127 -> 0x7B
    ("e5m2-ceil-max", E5, "ceil", {0: 57344.0}, 127, {0: 0x7B}),
    # ceil: 1/57344 -> log2 = -15.8 -> e=-15 -> 112; x*2^15: 1 -> 2^15 = 0 11110 00 = 0x78;
    # 0.3 -> 9830.4 -> [8192,16384) step 2048: 10240 = 1.25*2^13 -> 0 11100 01 = 0x71
    ("e5m2-ceil-1", E5, "ceil", {0: 1.0, 1: 0.3}, 112, {0: 0x78, 1: 0x71}),
    # ceil: 60000/57344 -> e=1 -> 128; 30000 -> [16384,32768) step 4096: 28672 = 1.75*2^14 -> 0x77
    ("e5m2-ceil-60000", E5, "ceil", {0: 60000.0}, 128, {0: 0x77}),
    # floor: 0 - 15 -> 112, same codes as ceil
    ("e5m2-floor-1", E5, "floor", {0: 1.0, 1: 0.3}, 112, {0: 0x78, 1: 0x71}),
    # floor: floor(log2 60000) = 15 -> e=0 -> 127; 60000 saturates to 57344 = 0x7B, -60000 -> 0xFB
    ("e5m2-floor-60000", E5, "floor", {0: 60000.0, 1: -60000.0}, 127, {0: 0x7B, 1: 0xFB}),
]


def _mx_block(vals: dict) -> torch.Tensor:
    x = torch.zeros(1, 32)
    for i, v in vals.items():
        x[0, i] = v
    return x


def _mx_codes(cds: dict, fill: int = 0) -> torch.Tensor:
    c = torch.full((1, 32), fill, dtype=torch.uint8)
    for i, v in cds.items():
        c[0, i] = v
    return c


@pytest.mark.parametrize("name, dtype, rounding, vals, biased, cds", _MX_CASES, ids=[c[0] for c in _MX_CASES])
def test_mxfp8_block_exponent_and_codes(name, dtype, rounding, vals, biased, cds):
    x = _mx_block(vals)
    p = dtq.MXFP8Quantizer(dtype=dtype, scale_rounding=rounding).quantize(x, columnwise=False).payload("rowwise")
    assert p["scale"].dtype == torch.uint8
    assert torch.equal(p["scale"], codes([[biased]])), (p["scale"], biased)
    assert_fp8(p["data"], dtype, _mx_codes(cds))


@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_mxfp8_nonfinite_block(dtype, rounding, bad):
    # a block holding NaN or +-Inf: biased exponent 0xFF and every code of that block NaN (0x7F);
    # the neighbouring block (amax 1.0 -> e = -8 (E4M3) / -15 (E5M2) in both modes) is unaffected.
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, bad, -2.0
    x[0, 32], x[0, 33] = 1.0, -0.5
    p = dtq.MXFP8Quantizer(dtype=dtype, scale_rounding=rounding).quantize(x, columnwise=False).payload("rowwise")
    good = 119 if dtype == E4 else 112
    assert torch.equal(p["scale"], codes([[0xFF, good]]))
    exp = torch.zeros(1, 64, dtype=torch.uint8)
    exp[0, :32] = 0x7F
    # E4M3: 1*2^8 -> 0x78, -0.5*2^8 -> -128 -> 0xF0; E5M2: 1*2^15 -> 0x78, -2^14 -> 1 11101 00 = 0xF4
    exp[0, 32], exp[0, 33] = (0x78, 0xF0) if dtype == E4 else (0x78, 0xF4)
    assert_fp8(p["data"], dtype, exp)


def test_mxfp8_layout_rowwise_and_columnwise():
    # [2, 64] = four blocks: (0,0) amax 448 -> 127; (0,1) amax 1 -> 119; (1,0) zero -> 0; (1,1) amax 449 -> 128
    x = torch.zeros(2, 64)
    x[0, 3] = -448.0          # -> 0xFE
    x[0, 40] = 1.0            # 256 -> 0x78
    x[1, 63], x[1, 32] = 449.0, 3.0  # /2: 224.5 -> 0x76; 1.5 -> 0 0111 100 = 0x3C
    exp_scale = codes([[127, 119], [0, 128]])
    exp = torch.zeros(2, 64, dtype=torch.uint8)
    exp[0, 3], exp[0, 40], exp[1, 63], exp[1, 32] = 0xFE, 0x78, 0x76, 0x3C
    q = dtq.MXFP8Quantizer()
    p = q.quantize(x, columnwise=False).payload("rowwise")
    assert torch.equal(p["scale"], exp_scale)
    assert_fp8(p["data"], E4, exp)
    # 3-D input with the same [M, K] view
    p3 = q.quantize(x.reshape(2, 1, 64), columnwise=False).payload("rowwise")
    assert torch.equal(p3["scale"], exp_scale)
    assert_fp8(p3["data"], E4, exp)
    # columnwise blocks of x.T run along M: payload [M/32, K] = transposed rowwise scales, [M, K] codes
    c = q.quantize(x.T.contiguous(), rowwise=False).payload("columnwise")
    assert torch.equal(c["scale"], exp_scale.T.contiguous())
    assert_fp8(c["data"], E4, exp.T.contiguous())


def test_mxfp8_dequantize_exact():
    # block amax 449 -> e=1: codes 224 (449), 0.5 (1.0), -1.5 (-3.0) -> dequant *2: [448, 1, -3]
    x = _mx_block({0: 449.0, 1: 1.0, 2: -3.0})
    t = dtq.MXFP8Quantizer().quantize(x, columnwise=False)
    exp = torch.zeros(1, 32)
    exp[0, 0], exp[0, 1], exp[0, 2] = 448.0, 1.0, -3.0
    assert_f32(t.dequantize(torch.float32), exp)


# torchao's _to_mx_rceil is the "ceil" (RCEIL) reference. Documented divergence, not exercised here:
# torchao multiplies by 1.0 (descale 1) when the biased exponent is 0 (block amax below about
# 448 * 2^-127 ~ 2.6e-36), while docs/design.md §2.3 says q = x / 2^-127 = x * 2^127. The random data below keeps
# every block amax many orders of magnitude above that.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_ceil_matches_torchao_rceil(dtype):
    if os.environ.get("CI"):  # CI installs the test extra: the cross-check must not vanish there
        import torchao.prototype.mx_formats.mx_tensor as mx
    else:
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    q = dtq.MXFP8Quantizer()
    total = 0
    for seed, mag in enumerate((1e-3, 3e-2, 1.0, 37.0, 1e3)):
        g = torch.Generator().manual_seed(1234 + seed)
        x = (torch.randn(32, 1024, generator=g) * mag).to(dtype)
        # a few blocks with widely varying scale inside one tensor
        x[::7] *= 64.0
        x[3::11] /= 50.0
        total += x.numel()
        p = q.quantize(x, columnwise=False).payload("rowwise")

        hp = x.float().reshape(-1, 32)
        amax = hp.abs().amax(dim=-1, keepdim=True)
        assert float(amax.min()) > 1e-30  # stay far from torchao's biased-exponent-0 special case
        e, data_lp = mx._to_mx_rceil(hp, amax, 448.0)
        ref_scale = e.reshape(32, 1024 // 32)
        ref_codes = u8(data_lp.to(E4)).reshape(32, 1024)
        assert torch.equal(p["scale"], ref_scale), (p["scale"] != ref_scale).nonzero()[:5]
        assert torch.equal(u8(p["data"]), ref_codes), (u8(p["data"]) != ref_codes).nonzero()[:5]
    assert total >= 150_000


# =================================================================================================
# NVFP4

# RNE block (used with global amax 2688 -> S_enc = 2688/2688 = 1): block amax 6.2 ->
# s_b = e4m3(6.2/6 * 1) = e4m3(1.0333) = 1.0 (0x38), factor S_enc/s_b = 1, so codes are plain e2m1(x):
#   6.2 -> saturates to 6 (7); ties to even: 0.25 -> 0 (0), 0.75 -> 1.0 (2), 1.25 -> 1.0 (2),
#   1.75 -> 2.0 (4), 2.5 -> 2.0 (4), 3.5 -> 4.0 (6), 5 -> 4.0 (6); negatives set bit 3
#   (-0.25 -> -0 = 0x8); 0.3 -> 0.5 (1)
_RNE_X = [6.2, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.3]
_RNE_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 1]
# packed, element 2i in the low nibble: (7|0<<4)=0x07, (2|2<<4)=0x22, 0x44, 0x66, (8|A<<4)=0xA8,
# (A|C<<4)=0xCA, (C|E<<4)=0xEC, (E|1<<4)=0x1E
_RNE_BYTES = [0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0x1E]


def test_nvfp4_e2m1_rne_ties_and_nibble_order():
    x = torch.tensor([_RNE_X])
    p = dtq.NVFP4Quantizer().quantize(x, columnwise=False, amax=torch.tensor(2688.0)).payload("rowwise")
    assert p["data"].dtype == torch.uint8
    assert torch.equal(p["data"], codes([_RNE_BYTES]))
    assert_fp8(p["scale"], E4, codes([[0x38]]))
    assert_f32(p["amax"], fp32(2688.0))


def test_nvfp4_e2m1_more_roundings():
    # same setting (S_enc 1, block amax 6 -> s_b 1): 2.9 -> 3 (5), 4.9 -> 4 (6), 5.1 -> 6 (7), 0.74 -> 0.5 (1),
    # 0.76 -> 1 (2), 0.26 -> 0.5 (1), 0.24 -> 0 (0), -6 -> 0xF, 1.5 -> 3, -1.0 -> 0xA, 2.0 -> 4, 0 -> 0,
    # -0.0 -> 0x8, 4.0 -> 6, 1.74 -> 3, 2.51 -> 5
    x = torch.tensor([[2.9, 4.9, 5.1, 0.74, 0.76, 0.26, 0.24, -6.0, 1.5, -1.0, 2.0, 0.0, -0.0, 4.0, 1.74, 2.51]])
    cds = [5, 6, 7, 1, 2, 1, 0, 0xF, 3, 0xA, 4, 0, 0x8, 6, 3, 5]
    packed = [cds[2 * i] | (cds[2 * i + 1] << 4) for i in range(8)]
    assert packed == [0x65, 0x17, 0x12, 0xF0, 0xA3, 0x04, 0x68, 0x53]
    p = dtq.NVFP4Quantizer().quantize(x, columnwise=False, amax=torch.tensor(2688.0)).payload("rowwise")
    assert torch.equal(p["data"], codes([[0x65, 0x17, 0x12, 0xF0, 0xA3, 0x04, 0x68, 0x53]]))


def test_nvfp4_two_level_scales():
    # global amax (computed) = 10 -> S_enc = fl32(2688/10) = fl32(268.8) = 268.79998779296875
    # block 0 (amax 10): s_b = e4m3(10/6*S_enc) = e4m3(447.99997) = 448 -> 0x7E; factor S/448 = 0.59999997
    #   10 -> 5.9999998 -> 6 (7); 1 -> 0.6 -> 0.5 (1); -4 -> -2.4 -> -2 (0xC); 5 -> 2.9999998 -> 3 (5);
    #   2.5 -> 1.4999999 -> 1.5 (3)
    #   bytes: 7|1<<4 = 0x17, 0xC|5<<4 = 0x5C, 3 = 0x03, then 0
    # block 1 (amax 1): s_b = e4m3(1/6*S_enc) = e4m3(44.8) -> [32,64) step 4: 44 = 1.375*2^5 -> 0 1100 011 = 0x63;
    #   factor S/44 = 6.109: 1 -> 6.1 -> 6 (7); -0.5 -> -3.05 -> -3 (0xD); 0.1 -> 0.61 -> 0.5 (1); 0.3 -> 1.83 -> 2 (4)
    #   bytes: 7|D<<4 = 0xD7, 1|4<<4 = 0x41, then 0
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([10.0, 1.0, -4.0, 5.0, 2.5])
    x[0, 16:20] = torch.tensor([1.0, -0.5, 0.1, 0.3])
    t = dtq.NVFP4Quantizer().quantize(x, columnwise=False)
    p = t.payload("rowwise")
    assert torch.equal(p["data"], codes([[0x17, 0x5C, 0x03, 0, 0, 0, 0, 0, 0xD7, 0x41, 0, 0, 0, 0, 0, 0]]))
    assert_fp8(p["scale"], E4, codes([[0x7E, 0x63]]))
    assert_f32(p["amax"], fp32(10.0))
    # dequant (q * s_b) / S_enc with S = fl32(268.8); q*s_b is exact
    S = f32(268.8)
    exp = torch.zeros(1, 32)
    for i, qsb in enumerate([6 * 448, 0.5 * 448, -2 * 448, 3 * 448, 1.5 * 448]):
        exp[0, i] = f32(qsb / S)
    for i, qsb in enumerate([6 * 44, -3 * 44, 0.5 * 44, 2 * 44]):
        exp[0, 16 + i] = f32(qsb / S)
    assert_f32(t.dequantize(torch.float32), exp)


def test_nvfp4_scale_factor_order():
    # Operation order is part of the bits: s_b = e4m3(fl32(block_amax / 6) * S_enc), then the element
    # scale is the single fp32 quotient S_enc / s_b, then one multiply x * (S_enc / s_b).
    # global amax 7 -> S_enc = 2688/7 = 384 exactly.
    # Block 0 (amax 7): s_b = e4m3(7/6*384) = 448 (0x7E); factor 384/448: 7 -> 6.0000001 -> 6 (7).
    # Block 1 (amax 0.6875): s_b = e4m3(fl32(0.6875/6)*384) = e4m3(44.0) = 44 = 1.375*2^5 (0x63);
    #   factor = fl32(384/44) = 0x1.1745d2p+3 = 8.72727299 (slightly above 96/11):
    #   0.6875                     * factor -> 6.0000              -> 6   (7)
    #   0x1.255556p-2 (0.28645834) * factor = 2.50000024 > 2.5     -> 3   (5)  [(x*384)/44 = 2.5 exactly -> 2]
    #   0x1.255556p-1 (0.57291669) * factor = 5.00000048 > 5       -> 6   (7)  [(x*384)/44 = 5.0 -> 4]
    #   0x1.255556p-3 (0.14322917) * factor = 1.25000012 > 1.25    -> 1.5 (3)  [(x*384)/44 = 1.25 -> 1]
    #   bytes: 7|5<<4 = 0x57, 7|3<<4 = 0x37
    # Block 2 (amax 0.203125 = 13*6/384): s_b = e4m3(13.0) = 1.625*2^3 (0x55);
    #   factor = fl32(384/13) = 0x1.d89d8ap+4 (while fl32(1/fl32(13/384)) = 0x1.d89d88p+4 is one ulp lower):
    #   0.203125 -> 6 (7); 0x1.5aaaacp-4 -> 2.50000024 -> 3 (5); 0x1.5aaaacp-3 -> 5.0000005 -> 6 (7);
    #   0x1.5aaaacp-5 -> 1.25000012 -> 1.5 (3)   -> bytes 0x57, 0x37
    # Block 3 (amax a = 0x1.d00002p+1 = 3.6250002): fl32(a/6) = 0x1.355556p-1, times 384 = 232.0 exactly, the
    #   tie between 224 (1.75*2^7, mantissa 6, even -> 0x76) and 240 (0x77) -> s_b = 224
    #   [fl32(a*384)/6 would be 232.00002 -> 240]. factor = fl32(384/224) = 1.71428573:
    #   a -> 6.21 -> 6 (7); -1 -> -1.714 -> -1.5 (0xB)  -> byte 7|0xB<<4 = 0xB7
    x = torch.zeros(1, 64)
    x[0, 0] = 7.0
    x[0, 16] = 0.6875
    x[0, 17] = float.fromhex("0x1.255556p-2")
    x[0, 18] = float.fromhex("0x1.255556p-1")
    x[0, 19] = float.fromhex("0x1.255556p-3")
    x[0, 32] = 0.203125
    x[0, 33] = float.fromhex("0x1.5aaaacp-4")
    x[0, 34] = float.fromhex("0x1.5aaaacp-3")
    x[0, 35] = float.fromhex("0x1.5aaaacp-5")
    x[0, 48] = float.fromhex("0x1.d00002p+1")
    x[0, 49] = -1.0
    p = dtq.NVFP4Quantizer().quantize(x, columnwise=False).payload("rowwise")
    exp = torch.zeros(1, 32, dtype=torch.uint8)
    exp[0, 0] = 0x07
    exp[0, 8], exp[0, 9] = 0x57, 0x37
    exp[0, 16], exp[0, 17] = 0x57, 0x37
    exp[0, 24] = 0xB7
    assert torch.equal(p["data"], exp), [hex(v) for v in p["data"].flatten().tolist()]
    assert_fp8(p["scale"], E4, codes([[0x7E, 0x63, 0x55, 0x76]]))


def test_nvfp4_amax_zero():
    # all-zero input: S_enc 1, block scales e4m3(0) = 0, codes 0, dequant 0
    t = dtq.NVFP4Quantizer().quantize(torch.zeros(2, 32), columnwise=False)
    p = t.payload("rowwise")
    assert torch.equal(p["data"], torch.zeros(2, 16, dtype=torch.uint8))
    assert_fp8(p["scale"], E4, torch.zeros(2, 2, dtype=torch.uint8))
    assert_f32(p["amax"], fp32(0.0))
    assert_f32(t.dequantize(torch.float32), torch.zeros(2, 32))
    # explicit amax 0 with data: S_enc = 1 -> s_b = e4m3(3/6) = 0.5 (0x30); factor 1/0.5 = 2:
    #   3 -> 6 (7), -1.5 -> -3 (0xD) -> byte 0xD7; dequant 6*0.5/1 = 3, -3*0.5 = -1.5
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 3.0, -1.5
    t = dtq.NVFP4Quantizer().quantize(x, columnwise=False, amax=torch.tensor(0.0))
    p = t.payload("rowwise")
    assert torch.equal(p["data"], codes([[0xD7, 0, 0, 0, 0, 0, 0, 0]]))
    assert_fp8(p["scale"], E4, codes([[0x30]]))
    exp = torch.zeros(1, 16)
    exp[0, 0], exp[0, 1] = 3.0, -1.5
    assert_f32(t.dequantize(torch.float32), exp)


def test_nvfp4_block_scale_underflow_gives_zero_codes():
    # S_enc 1 (amax 2688); block 1 amax 1e-4: s_b = e4m3(1.67e-5) = 0 (below half of 2^-9) -> codes 0,
    # including the negative element (no 0x8); block 0 holds 6 -> s_b 1, code 7.
    x = torch.zeros(1, 32)
    x[0, 0] = 6.0
    x[0, 16], x[0, 17] = 1e-4, -1e-4
    p = dtq.NVFP4Quantizer().quantize(x, columnwise=False, amax=torch.tensor(2688.0)).payload("rowwise")
    assert torch.equal(p["data"], codes([[0x07] + [0] * 15]))
    assert_fp8(p["scale"], E4, codes([[0x38, 0x00]]))


def test_nvfp4_16x16_block_scales():
    # [32, 32] with 16x16 tiles; global amax 6 -> S_enc = 2688/6 = 448 exactly.
    #   tile (0,0) amax 6   : s_b = e4m3(6/6*448)    = 448 (0x7E), factor 1: 6 -> 7, 3 -> 5
    #   tile (0,1) amax 3   : s_b = e4m3(0.5*448)    = 224 (0x76), factor 2: -3 -> -6 (0xF)
    #   tile (1,0) amax 1.5 : s_b = e4m3(0.25*448)   = 112 (0x6E), factor 4: 1.5 -> 6 (7)
    #   tile (1,1) amax .75 : s_b = e4m3(0.125*448)  = 56  (0x66), factor 8: .75 -> 6 (7), .25 -> 2 (4)
    # packed bytes (row r, byte c//2, low nibble for even c):
    #   (3,4)=5,(3,5)=7 -> byte (3,2) = 5|7<<4 = 0x75; (15,16) -> byte (15,8) low = 0x0F;
    #   (16,0) -> byte (16,0) = 0x07; (31,31) -> byte (31,15) high = 0x70; (20,20) -> byte (20,10) = 0x04
    x = torch.zeros(32, 32)
    x[3, 5], x[3, 4] = 6.0, 3.0
    x[15, 16] = -3.0
    x[16, 0] = 1.5
    x[31, 31], x[20, 20] = 0.75, 0.25
    exp = torch.zeros(32, 16, dtype=torch.uint8)
    exp[3, 2], exp[15, 8], exp[16, 0], exp[31, 15], exp[20, 10] = 0x75, 0x0F, 0x07, 0x70, 0x04
    exp_scale = codes([[0x7E, 0x76], [0x6E, 0x66]])
    t = dtq.NVFP4Quantizer(block=(16, 16)).quantize(x)
    for d in ("rowwise", "columnwise"):
        p = t.payload(d)
        assert torch.equal(p["data"], exp), d
        assert_fp8(p["scale"], E4, exp_scale)
        assert_f32(p["amax"], fp32(6.0))
    # dequant is exact here (q*s_b/448): the input values come back
    assert_f32(t.dequantize(torch.float32), x)


def test_nvfp4_columnwise_1x16_layout():
    # columnwise (1,16) blocks run along M; payload stays in [M, K] orientation packed along K.
    # Column 0 holds the RNE block (S_enc 1, s_b 1.0 = 0x38); other columns are zero (s_b 0).
    # Element (r, 0) is the low nibble of byte (r, 0).
    x = torch.zeros(16, 16)
    x[:, 0] = torch.tensor(_RNE_X)
    p = dtq.NVFP4Quantizer().quantize(x, rowwise=False, amax=torch.tensor(2688.0)).payload("columnwise")
    exp = torch.zeros(16, 8, dtype=torch.uint8)
    exp[:, 0] = codes(_RNE_CODES)
    assert torch.equal(p["data"], exp)
    exp_scale = torch.zeros(1, 16, dtype=torch.uint8)
    exp_scale[0, 0] = 0x38
    assert_fp8(p["scale"], E4, exp_scale)


def test_nvfp4_nan_input():
    # NaN has no E2M1 code: it becomes +6 (0x7) and dequantizes to NaN. The second block is unaffected:
    # global amax = NaN -> S_enc 1; block 1 amax 6 -> s_b 1: 6 -> 7, 3 -> 5 -> byte 0x57.
    x = torch.zeros(1, 32)
    x[0, 2] = NAN
    x[0, 0] = 1.0
    x[0, 16], x[0, 17] = 6.0, 3.0
    t = dtq.NVFP4Quantizer().quantize(x, columnwise=False)
    p = t.payload("rowwise")
    assert (int(p["data"][0, 1]) & 0x0F) == 0x7          # element 2 -> low nibble of byte 1
    assert torch.equal(p["data"][0, 8:], codes([0x57, 0, 0, 0, 0, 0, 0, 0]))
    assert u8(p["scale"])[0, 1].item() == 0x38
    dq = t.dequantize(torch.float32)
    assert torch.isnan(dq[0, 2])
    exp1 = torch.zeros(16)
    exp1[0], exp1[1] = 6.0, 3.0
    assert_f32(dq[0, 16:], exp1)
    # with a finite explicit global amax (2688 -> S_enc 1) the NaN element still encodes as 0x7
    p = dtq.NVFP4Quantizer().quantize(x, columnwise=False, amax=torch.tensor(2688.0)).payload("rowwise")
    assert (int(p["data"][0, 1]) & 0x0F) == 0x7
    assert torch.equal(p["data"][0, 8:], codes([0x57, 0, 0, 0, 0, 0, 0, 0]))


# =================================================================================================
# Identity


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
