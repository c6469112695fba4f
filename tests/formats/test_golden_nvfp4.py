"""Golden tests of the reference NVFP4Quantizer (docs/design.md section 2): E2M1 codes and
nibble order, two-level scales and their operation order, 16x16 blocks.
Every expected code and scale is written literally and derived by hand in a comment; the bit
patterns and the ``f32`` convention are in _golden.py."""

from __future__ import annotations

import torch

import dtq
from tests.formats._golden import E4, NAN, assert_f32, assert_fp8, codes, f32, fp32, u8

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
    assert (int(p["data"][0, 1]) & 0x0F) == 0x7  # element 2 -> low nibble of byte 1
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
