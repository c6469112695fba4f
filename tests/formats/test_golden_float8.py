"""Golden tests of the reference Float8Quantizer (docs/design.md section 2): per-tensor current
scaling, power-of-two scales, saturation, non-finite inputs, subnormals.
Every expected code and scale is written literally and derived by hand in a comment; the bit
patterns and the ``f32`` convention are in _golden.py."""

from __future__ import annotations

import pytest
import torch

import dtq
from dtq._bits import FLT_MAX
from tests.formats._golden import E4, E5, INF, NAN, assert_f32, assert_fp8, codes, f32, fp32


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


@pytest.mark.parametrize(
    "amax, scale_inv",
    [
        (3.5, 2.0**-7),  # 448/3.5 = 128 exactly, already a power of two -> kept
        (7.0, 2.0**-6),  # 448/7 = 64
        (1.0, 2.0**-8),  # 448 -> 256
        (1000.0, 4.0),  # 0.448 -> 0.25
    ],
)
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


@pytest.mark.parametrize("amax", [-0.0, -1.0, 2.0**-149, 1e-37, 2.0**-110], ids=str)
def test_float8_scale_from_edge_amaxes(amax):
    """The scale for an explicit amax: not above 0 -> 1; positive -> 448 / amax rounded once to
    fp32 (an fp64 quotient rounded to fp32 is that: 53 >= 2 * 24 + 2 bits), capped at the fp32
    max where the quotient overflows (448 / 2^-149 and 448 / 1e-37). scale_inv = 1 / scale."""
    q = dtq.Float8Quantizer()
    p = q.quantize(torch.tensor([[0.0, 0.0]]), amax=torch.tensor(amax)).payload("rowwise")
    if amax <= 0:
        scale = 1.0
    else:
        quotient = 448.0 / amax
        scale = float(torch.tensor(quotient, dtype=torch.float64).float()) if quotient < 3.4e38 else FLT_MAX
    assert_f32(p["scale_inv"], fp32(float(torch.tensor(1.0) / torch.tensor(scale))))


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
    x = torch.tensor([[448.0, 2**-9, 3 * 2**-9, 2**-10, 3 * 2**-10, 7 * 2**-9, 15 * 2**-10, -(2**-9), -(2**-11), -0.0]])
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


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_traced_form_gives_the_quantize_bits(dtype):
    """``Float8Codec.traced_quantize`` (what inductor compiles in place of the quantize ops, its
    divisions in fp64) against ``quantize`` on edge amaxes (0, subnormals, NaN, inf, near the fp32
    max, random bit patterns) and edge values (NaN, inf, saturating, subnormal): the same bits."""
    from dtq.codec import COLUMNWISE, ROWWISE

    codec = dtq.Float8Quantizer(dtype=dtype).codec(ROWWISE)
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (4000,), generator=g, dtype=torch.int32).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, 1e-45, 1e-40, 1.1754942e-38, 1.0, 448.0, 3.0e38, 3.4028235e38])
    edges = torch.cat([edges, torch.tensor([float("nan"), float("inf"), -float("inf")])])
    x = torch.randn(16, 32, generator=g) * 1e3
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-42, -1e30, 0.0])
    for amax in torch.cat([edges, bits.abs()]):
        want = codec.quantize(x, amax)
        got = codec.traced_quantize(x, amax, transposed=True)
        assert got["data"].view(torch.uint8).equal(want["data"].view(torch.uint8)), amax
        assert got["scale_inv"].view(torch.int32).equal(want["scale_inv"].view(torch.int32)), amax
        assert got["data_t"].view(torch.uint8).equal(want["data"].t().contiguous().view(torch.uint8))
    assert dtq.Float8Quantizer(pow2_scales=True).codec(COLUMNWISE).traced_quantize(x, amax) is None
