"""Golden tests of the reference Float8BlockQuantizer (docs/design.md section 2): 1x128 and
128x128 blocks, partial edge blocks and zero blocks.
Every expected code and scale is written literally and derived by hand in a comment; the bit
patterns and the ``f32`` convention are in _golden.py."""

from __future__ import annotations

import torch

import dtq
from tests.formats._golden import E4, E5, assert_f32, assert_fp8, f32, fp32


def _block_1x128_input():
    # [2, 256]: four (1,128) blocks
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, -1.0, 0.1  # block (0,0): amax 3
    # block (0,1): all zero
    x[1, 0], x[1, 5] = 0.5, -0.25  # block (1,0): amax 0.5
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
    x[5, 7], x[127, 127] = 3.0, -1.0  # block (0,0): amax 3
    x[0, 199], x[127, 128] = 1000.0, 1.0  # block (0,1): amax 1000 (partial along K)
    x[129, 0], x[128, 127] = 0.5, -0.25  # block (1,0): amax 0.5 (partial along M)
    x[129, 199], x[128, 128] = 7.0, 0.1  # block (1,1): amax 7 (partial along both)
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
