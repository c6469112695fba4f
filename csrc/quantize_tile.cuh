// Fast fused quantization for the slot pairs dtq's formats produce (register tiles, no staging).
//
// One CTA of 256 threads owns a 128 x 128 input tile and holds it in registers: thread (warp w,
// lane l) loads 8 consecutive columns (cv = l % 16) of 8 consecutive rows (16 w + 8 (l / 16) ...),
// as 16-byte vectors issued all at once (8 independent loads in flight per thread, 32 KB per CTA
// for 16-bit inputs). Warp w thus holds the 16-row group w, split between its two half-warps.
//   * row blocks (1 x 16/32/128): in-thread max over 8 columns, then a reduce-scatter over the
//     2/4/16 lanes of a block (each lane derives 4/2/1 row scales) and an all-gather of multipliers;
//   * 16-row column groups: in-thread max over 8 rows, then one xor-16 shuffle; taller groups
//     (32, 128 rows) combine the warps' 16-row maxima through 4 KB of shared memory (one barrier);
//   * 2-D blocks (16 x 16, 128 x 128): the column-group maxima, then shuffles across lanes;
//   * the 16-point random Hadamard (columnwise NVFP4): three butterfly stages in-thread, the
//     fourth (rows i, i + 8) across the two half-warps by one shuffle per element;
//   * FP8 row-wise (one scale per whole row or column): the scales come from the amax vector of
//     the axis-amax pass, 8 per thread (its rows or its columns).
// Codes: FP8 through the packed cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (two values per instruction)
// with a branch-free byte fix-up that turns the hardware's NaN codes into the reference's 0x7F;
// 8-byte (FP8) / 4-byte (FP4) / 16-byte (identity) stores, 128 contiguous bytes per half-warp row.
// Each slot type is a compile-time parameter, so a launch carries only its own code. The slot
// pairs are enumerated in DTQ_FAST_PAIRS; anything else takes the generic kernel in quantize.cu.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "common.cuh"

namespace dtq {
namespace fast {

constexpr int kThreads = 256;
constexpr int kTile = 128;

// NVFP4 with an option: row-scaled S_enc, four-over-six scales, an e4m3_max other than 448.
inline bool nvfp4_options(const SlotCfg& s) { return s.row_scaled || s.fos || s.gmax != 2688.f; }

// Compile-time slot type: payload kind, block shape (0, 0: one scale per tensor), Hadamard, and
// OPT: NVFP4 with options (nvfp4_options; kept out of the plain slots' code, whose registers it
// would otherwise spill).
template <int KIND, int BR, int BC, bool HAD = false, bool OPT = false>
struct Slot {
  static constexpr int kind = KIND, br = BR, bc = BC;
  static constexpr bool had = HAD;
  static constexpr bool opt = OPT;
  static constexpr bool none = KIND == kNone;
  static constexpr bool ident = KIND == kIdentity;
  static constexpr bool tensor = (KIND == kFp8Scaled || KIND == kFp8ScaledT) && BR == 0;
  static constexpr bool transposed = KIND == kFp8ScaledT;  // codes stored [K, M]; slot a stores the scale
  static constexpr bool axis = KIND == kFp8Row;           // (1, 0): per row; (0, 1): per column
  static constexpr bool row = BR == 1 && !axis;           // 1 x BC blocks
  static constexpr bool col = BR > 1 && BC == 1 && !HAD;  // BR x 1 blocks
  static constexpr bool blk = BR > 1 && BC > 1;           // BR x BC blocks
  static constexpr bool fp4 = KIND == kNVFP4;
  static constexpr bool colmax = col || blk;  // needs the per-column maxima
  static constexpr bool tall = colmax && BR > 16;  // needs the shared-memory combine
  static bool match(const SlotCfg& s) {
    return s.kind == KIND && (KIND == kNone || (s.br == BR && s.bc == BC && bool(s.hadamard) == HAD &&
                                                (KIND != kNVFP4 || nvfp4_options(s) == OPT)));
  }
};

using None = Slot<kNone, 0, 0>;
using Fp8T = Slot<kFp8Scaled, 0, 0>;
using Fp8TT = Slot<kFp8ScaledT, 0, 0>;
using Fp8R = Slot<kFp8Scaled, 1, 128>;
using Fp8C = Slot<kFp8Scaled, 128, 1>;
using Fp8B = Slot<kFp8Scaled, 128, 128>;
using MxR = Slot<kMXFP8, 1, 32>;
using MxC = Slot<kMXFP8, 32, 1>;
using NvR = Slot<kNVFP4, 1, 16>;
using NvC = Slot<kNVFP4, 16, 1>;
using NvB = Slot<kNVFP4, 16, 16>;
using NvH = Slot<kNVFP4, 16, 1, true>;
using Id = Slot<kIdentity, 0, 0>;
using Fp8RowR = Slot<kFp8Row, 1, 0>;
using Fp8RowC = Slot<kFp8Row, 0, 1>;
using NvRo = Slot<kNVFP4, 1, 16, false, true>;
using NvCo = Slot<kNVFP4, 16, 1, false, true>;
using NvBo = Slot<kNVFP4, 16, 16, false, true>;
using NvHo = Slot<kNVFP4, 16, 1, true, true>;

// (rowwise-or-only slot, second slot): the pairs dtq's formats and hybrids produce.
#define DTQ_FAST_PAIRS(X)                                                                               \
  X(Fp8T, None) X(Fp8T, Fp8TT) X(Fp8R, None) X(Fp8C, None) X(Fp8B, None) X(MxR, None) X(MxC, None) X(NvR, None)       \
  X(NvC, None) X(NvB, None) X(NvH, None) X(Id, None)                                                    \
  X(Fp8R, Fp8C) X(MxR, MxC) X(NvR, NvC) X(NvR, NvH)                                                     \
  X(MxR, NvH) X(Fp8R, Fp8B) X(MxR, NvB) X(Fp8T, MxC) X(Fp8R, NvB) X(Id, NvC) X(NvR, Id) X(Fp8B, Id)     \
  X(NvR, MxC) X(MxR, Fp8C) X(Fp8RowR, None) X(Fp8RowC, None) X(Fp8RowR, Fp8RowC)                       \
  X(NvRo, None) X(NvCo, None) X(NvBo, None) X(NvHo, None) X(NvRo, NvCo) X(NvRo, NvHo) X(NvRo, MxC)      \
  X(NvRo, Id) X(MxR, NvBo) X(MxR, NvHo) X(MxR, NvC) X(MxR, Id) X(Id, MxC)

// ------------------------------------------------------------------------------------------
// Element access of one thread's 8 x 8 sub-tile, kept as the raw 16-byte vectors.
template <typename T>
struct Regs {
  static constexpr int kV = sizeof(T) == 4 ? 2 : 1;  // 16-byte vectors per 8-column row
  uint4 v[8][kV];
  __device__ __forceinline__ uint32_t word(int i, int w) const {
    const uint4& q = v[i][w / 4];
    const int k = w % 4;
    return k == 0 ? q.x : (k == 1 ? q.y : (k == 2 ? q.z : q.w));
  }
  __device__ __forceinline__ uint32_t raw(int i, int j) const {  // element bits (16-bit: in the low half)
    if constexpr (sizeof(T) == 4) return word(i, j);
    else return (j & 1) ? (word(i, j / 2) >> 16) : (word(i, j / 2) & 0xFFFFu);
  }
  __device__ __forceinline__ float f(int i, int j) const {
    if constexpr (sizeof(T) == 4) return u2f(word(i, j));
    else if constexpr (std::is_same<T, __nv_bfloat16>::value)
      return u2f((j & 1) ? (word(i, j / 2) & 0xFFFF0000u) : (word(i, j / 2) << 16));
    else return __half2float(__ushort_as_half(static_cast<unsigned short>(raw(i, j))));
  }
};

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Two fp32 -> two FP8 codes (lo in the low byte), saturating RNE; NaN codes fixed up later.
__device__ __forceinline__ uint32_t cvt2(float lo, float hi, bool e5m2) {
  unsigned short r;
  if (e5m2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
// _bits.cast_fp8 maps NaN to 0x7F. Under satfinite the hardware gives a NaN code for NaN only
// (e4m3: low 7 bits 0x7F; e5m2: low 7 bits 0x7D..0x7F) and saturates everything else, so the
// bytes whose low 7 bits reach that range are exactly the NaN inputs: set them to 0x7F.
__device__ __forceinline__ uint32_t fp8_fix_nan(uint32_t c, bool e5m2) {
  const uint32_t m = c & 0x7F7F7F7Fu;
  const uint32_t t = (m + (e5m2 ? 0x03030303u : 0x01010101u)) & 0x80808080u;  // no carries between bytes
  const uint32_t mask = (t >> 7) * 0xFFu;
  return (c & ~mask) | (mask & 0x7F7F7F7Fu);
}

// _bits.e2m1_encode (same function as common.cuh's e2m1_rne), branch-free.
__device__ __forceinline__ uint32_t e2m1_rne_bf(float x) {
  const uint32_t b = abs_bits(x);
  const uint32_t lo = (b > 0x3E800000u) + (b >= 0x3F400000u);        // |x| < 1: rint(2|x|), ties to even
  uint32_t hi = ((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252u;    // |x| >= 1 (NaN: > 7)
  hi = hi > 7u ? 7u : hi;
  const uint32_t m = b < 0x3F800000u ? lo : hi;
  const uint32_t s = b > 0x7F800000u ? 0u : ((f2u(x) >> 28) & 8u);    // NaN -> +6
  return m | s;
}

// _bits.e2m1_encode_stochastic (common.cuh's e2m1_sr) on the fp32 bits, its result from 1 up taking
// no compares over the grid and no int-to-float conversion (this encode bounds the NVFP4 kernels,
// which are instruction-bound on sm_90). v = min(|x|, 6). From 1 up the grid has one mantissa bit: the
// lower grid code is (bits >> 22) - 252 (2..7), and the fraction of the way to the next grid
// point, (v - glo) / spacing (exact), is the remaining 22 mantissa bits over 2**22, so the
// reference's u < frac with u = (r >> 8) * 2**-24 is the integer compare (r >> 8) < those bits
// * 4; at v = 6 they are 0 and the code stays 7. Below 1 the grid is 0, 0.5, 1: as the reference.
__device__ __forceinline__ uint32_t e2m1_sr_fast(float x, uint32_t r) {
  const uint32_t ax = abs_bits(x);
  const uint32_t b = ax > 0x40C00000u ? 0x40C00000u : ax;  // min(|x|, 6), on the bits (NaN: fixed below)
  const uint32_t hi_lo = (b >> 22) - 252u;
  const uint32_t hi = (r >> 8) < ((b & 0x3FFFFFu) << 2) ? hi_lo + 1 : hi_lo;
  const uint32_t lo_lo = b >= 0x3F000000u;       // 0 or 1 (0.5)
  const float frac = __fmul_rn(__fsub_rn(u2f(b), lo_lo ? 0.5f : 0.f), 2.f);
  const float u = __fmul_rn(float(r >> 8), 5.9604644775390625e-08f);  // * 2**-24
  const uint32_t lo = u < frac ? lo_lo + 1 : lo_lo;
  // Both halves computed, one selected: lanes of a warp hold values on both sides of 1, and a
  // branch here would run the two halves one after the other.
  const uint32_t m = b >= 0x3F800000u ? hi : lo;
  return ax > 0x7F800000u ? 7u : (m | ((f2u(x) >> 28) & 8));  // NaN -> +6
}

// Scale and multiplier of one block from its amax (bits: the stored scale).
template <int KIND>
__device__ __forceinline__ float block_params(const SlotCfg& s, float bam, float s_enc, uint32_t& bits) {
  if constexpr (KIND == kFp8Scaled) {
    const float sc = scale_from_amax(bam, s.fmax, s.pow2);
    bits = f2u(__frcp_rn(sc));
    return sc;
  } else if constexpr (KIND == kMXFP8) {
    const uint32_t b = e8m0_biased(bam, s.fmax, s.e5m2, s.floor_mode);
    bits = b;
    return e8m0_inv(b);
  } else {
    const uint8_t sb = nvfp4_block_scale(bam, s_enc);
    bits = sb;
    return nvfp4_factor(sb, s_enc);
  }
}

// idx: the element's flat index mod 2**32 (all the counter hash reads of it), in 32-bit arithmetic.
// SR is a compile-time choice: callers branch once per row or column on the slot's flag (uniform
// over the warp), so no lane computes the rounding it does not use.
template <bool SR>
__device__ __forceinline__ uint32_t fp4_code(float v, float mult, uint32_t key, uint32_t idx) {
  const float y = __fmul_rn(v, mult);
  uint32_t c;
  if constexpr (SR) c = e2m1_sr_fast(y, hash32(idx ^ key));
  else c = e2m1_rne_bf(y);
  return mult == 0.f ? 0u : c;  // s_b == 0: the whole block is code 0
}

// The eight FP4 codes (4 bits each, the first in the low bits) of values v(j) with multipliers
// mult(j) at flat indices idx + j.
template <bool SR, typename VFn, typename MultFn>
__device__ __forceinline__ uint32_t fp4_codes8(VFn v, MultFn mult, uint32_t key, uint32_t idx) {
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) w |= fp4_code<SR>(v(j), mult(j), key, idx + j) << (4 * j);
  return w;
}

__device__ __forceinline__ uint32_t identity_bits(float v, int od) {
  if (od == kF32) return is_nan(v) ? kCanonicalNaN : f2u(v);
  if (od == kBF16) return is_nan(v) ? 0x7FC0u : uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
  return is_nan(v) ? 0x7E00u : uint32_t(__half_as_ushort(__float2half_rn(v)));
}

// The FP8 codes of row i of the thread's sub-tile (8 columns, the first in the low byte).
template <typename T, typename MultFn>
__device__ __forceinline__ uint2 fp8_codes8(const Regs<T>& d, int i, MultFn mult, bool e5) {
  uint32_t w[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint32_t a = cvt2(__fmul_rn(d.f(i, 4 * q), mult(4 * q)), __fmul_rn(d.f(i, 4 * q + 1), mult(4 * q + 1)), e5);
    const uint32_t b = cvt2(__fmul_rn(d.f(i, 4 * q + 2), mult(4 * q + 2)), __fmul_rn(d.f(i, 4 * q + 3), mult(4 * q + 3)), e5);
    w[q] = fp8_fix_nan(a | (b << 16), e5);
  }
  return make_uint2(w[0], w[1]);
}

// One slot's codes for row i of the thread's sub-tile (8 columns at element offset off).
template <class S, typename T, typename MultFn>
__device__ __forceinline__ void store_row(const SlotCfg& s, const Regs<T>& d, int i, MultFn mult, int64_t off,
                                          uint32_t key) {
  if constexpr (S::kind == kFp8Scaled || S::kind == kMXFP8 || S::kind == kFp8Row) {
    *reinterpret_cast<uint2*>(reinterpret_cast<uint8_t*>(s.data) + off) = fp8_codes8(d, i, mult, s.e5m2);
  } else if constexpr (S::kind == kNVFP4) {
    auto v = [&](int j) { return d.f(i, j); };
    const uint32_t w = s.sr ? fp4_codes8<true>(v, mult, key, uint32_t(off)) : fp4_codes8<false>(v, mult, key, uint32_t(off));
    *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(s.data) + off / 2) = w;
  } else if constexpr (S::kind == kIdentity) {
    const int od = s.out_dtype;
    constexpr int in_code = sizeof(T) == 4 ? kF32 : (std::is_same<T, __nv_bfloat16>::value ? kBF16 : kF16);
    if (od == in_code) {  // same dtype: the input bits
      if constexpr (sizeof(T) == 4) {
        uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<uint32_t*>(s.data) + off);
        dst[0] = d.v[i][0];
        dst[1] = d.v[i][1];
      } else {
        *reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(s.data) + off) = d.v[i][0];
      }
    } else if (od == kF32) {
      uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<uint32_t*>(s.data) + off);
      dst[0] = make_uint4(identity_bits(d.f(i, 0), od), identity_bits(d.f(i, 1), od), identity_bits(d.f(i, 2), od),
                          identity_bits(d.f(i, 3), od));
      dst[1] = make_uint4(identity_bits(d.f(i, 4), od), identity_bits(d.f(i, 5), od), identity_bits(d.f(i, 6), od),
                          identity_bits(d.f(i, 7), od));
    } else {
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) w[q] = identity_bits(d.f(i, 2 * q), od) | (identity_bits(d.f(i, 2 * q + 1), od) << 16);
      *reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(s.data) + off) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Eight per-column scales (8 consecutive entries at idx) of one slot.
template <int KIND>
__device__ __forceinline__ void store_scales8(const SlotCfg& s, int64_t idx, const uint32_t (&b)[8]) {
  if constexpr (KIND == kFp8Scaled) {
    uint4* p = reinterpret_cast<uint4*>(reinterpret_cast<uint32_t*>(s.scale) + idx);
    p[0] = make_uint4(b[0], b[1], b[2], b[3]);
    p[1] = make_uint4(b[4], b[5], b[6], b[7]);
  } else {
    *reinterpret_cast<uint2*>(reinterpret_cast<uint8_t*>(s.scale) + idx) =
        make_uint2(b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24), b[4] | (b[5] << 8) | (b[6] << 16) | (b[7] << 24));
  }
}
template <int KIND>
__device__ __forceinline__ void store_scale1(const SlotCfg& s, int64_t idx, uint32_t b) {
  if constexpr (KIND == kFp8Scaled) reinterpret_cast<uint32_t*>(s.scale)[idx] = b;
  else reinterpret_cast<uint8_t*>(s.scale)[idx] = uint8_t(b);
}

// Per-launch constants of one slot: NVFP4 S_enc, per-tensor multiplier, SR key.
struct SlotConst {
  float s_enc = 1.f, tmult = 1.f;
  uint32_t key = 0;
};
template <class S>
__device__ __forceinline__ SlotConst slot_const(const SlotCfg& s) {
  SlotConst c;
  if constexpr (S::fp4) {
    if (!S::opt || !s.row_scaled) {  // row-scaled slots read S_enc per row / column (nvfp4_vector_senc)
      const float am = *s.amax_in;
      c.s_enc = nvfp4_senc(am, S::opt ? s.gmax : 2688.f);
      if (blockIdx.x == 0 && threadIdx.x == 0) *s.tensor_out = is_nan(am) ? u2f(kCanonicalNaN) : am;
    }
    if (s.sr) c.key = rng_key(s.seed, s.stream);
  } else if constexpr (S::tensor) {
    c.tmult = scale_from_amax(*s.amax_in, s.fmax, s.pow2);
    if (!S::transposed && blockIdx.x == 0 && threadIdx.x == 0) *s.tensor_out = __frcp_rn(c.tmult);
  }
  return c;
}

// S_enc of row / column idx (of n): the slot's per-tensor value, or a row-scaled slot's own; `store`
// writes a row-scaled slot's amax vector entry (the threads of the first column / row tile do).
template <class S>
__device__ __forceinline__ float slot_senc(const SlotCfg& s, const SlotConst& c, int64_t idx, int64_t n, bool store) {
  if constexpr (S::opt) {
    if (s.row_scaled) return nvfp4_vector_senc(s, idx, n, store);
  }
  return c.s_enc;
}

// Four-over-six scale of one block from both candidates' errors: this thread's sum over its part
// of the block (x(k), k < N, in the block's order) plus the other part's, held by the lanes `o1`
// (and then `o2`) away, in _bits.block_sum's order. Returns the multiplier; bits: the scale byte.
template <int N, typename XFn>
__device__ __forceinline__ float fos_pick(const SlotCfg& s, float bamax, float s_enc, XFn x, int o1, int o2,
                                          uint32_t& bits) {
  const Fp4Candidates c = nvfp4_candidates(bamax, s_enc);
  float e6, e4;
  nvfp4_errors<N>(x, s_enc, c, s.fos, e6, e4);
  e6 = __fadd_rn(e6, __shfl_xor_sync(0xFFFFFFFFu, e6, o1));
  e4 = __fadd_rn(e4, __shfl_xor_sync(0xFFFFFFFFu, e4, o1));
  if (o2) {
    e6 = __fadd_rn(e6, __shfl_xor_sync(0xFFFFFFFFu, e6, o2));
    e4 = __fadd_rn(e4, __shfl_xor_sync(0xFFFFFFFFu, e4, o2));
  }
  const bool four = e4 < e6;  // ties and NaN keep 6
  bits = four ? c.sb4 : c.sb6;
  return four ? c.m4 : c.m6;
}

// Everything of one slot for the thread's 8 x 8 sub-tile.
template <class S, typename T>
__device__ __forceinline__ void do_slot(const SlotCfg& s, const SlotConst& c, const Regs<T>& d,
                                        const uint32_t (&ra)[8], const uint32_t (&ca)[8],
                                        const uint4 (*red)[32], int64_t M, int64_t K, int64_t row0, int64_t col,
                                        int w, int h, int cv) {
  if constexpr (S::none) {
    return;
  } else {
    const bool cok = col < K;
    if constexpr (S::opt && !S::blk) {
      // a row-scaled slot's amax vector: stored by the threads of the first column (row) tile
      if (s.row_scaled) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          if constexpr (S::row) slot_senc<S>(s, c, row0 + k, M, col == 0);
          else slot_senc<S>(s, c, col + k, K, row0 == 0 && cok);
        }
      }
    }
    if constexpr (S::row && S::opt) {
      if (s.fos) {
        // 4/6 1 x 16 blocks over lane pairs (xor 1): both lanes derive both candidates of all 8
        // rows, add each other's error sums over their 8 columns and pick the same scale.
        const int64_t ld = K / 16;
        const int lane = threadIdx.x & 31;
        float m[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int64_t r = row0 + i;
          const uint32_t a = umax(ra[i], __shfl_xor_sync(0xFFFFFFFFu, ra[i], 1));
          uint32_t bits;
          m[i] = fos_pick<8>(s, u2f(a), slot_senc<S>(s, c, r, M, false), [&](int j) { return d.f(i, j); }, 1, 0,
                             bits);
          if (r < M && cok && (lane & 1) == 0) store_scale1<kNVFP4>(s, r * ld + col / 16, bits);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (row0 + i < M && cok) store_row<S>(s, d, i, [&](int) { return m[i]; }, (row0 + i) * K + col, c.key);
        return;
      }
    }
    if constexpr (S::row) {
      // Reduce-scatter the 8 row maxima over the L lanes of a row block (halving the live values
      // per shuffle stage), so each lane derives the scale of 8 / L rows (1 for L >= 8) instead
      // of all 8; then all-gather the multipliers back.
      constexpr int L = S::bc / 8;
      const int64_t ld = (K + S::bc - 1) / S::bc;
      const int lane = threadIdx.x & 31;
      uint32_t v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = ra[k];
      int rbase = 0;  // first row held after the halving stages
#pragma unroll
      for (int o = L / 2, n = 8; o >= 1; o >>= 1) {
        if (n > 1) {
          const int half = n / 2;
          const bool b = lane & o;
#pragma unroll
          for (int k = 0; k < half; ++k) {
            const uint32_t send = b ? v[k] : v[k + half], keep = b ? v[k + half] : v[k];
            v[k] = umax(keep, __shfl_xor_sync(0xFFFFFFFFu, send, o));
          }
          rbase += b ? half : 0;
          n = half;
        } else {
          v[0] = umax(v[0], __shfl_xor_sync(0xFFFFFFFFu, v[0], o));
        }
      }
      constexpr int held = L >= 8 ? 1 : 8 / L;
      constexpr int dup = L >= 8 ? L / 8 : 1;  // lanes holding the same rows (their low lane bits differ)
      // The lane holding a row's scale may lie past K in a partial block: test the block's start.
      const bool bok = col - col % S::bc < K;
      float m[8];
#pragma unroll
      for (int k = 0; k < held; ++k) {
        uint32_t bits;
        const int64_t r = row0 + rbase + k;
        m[k] = block_params<S::kind>(s, u2f(v[k]), slot_senc<S>(s, c, r, M, false), bits);
        if (r < M && bok && (lane & (dup - 1)) == 0) store_scale1<S::kind>(s, r * ld + col / S::bc, bits);
      }
      // All-gather: undo the halving stages, smallest lane bit first.
#pragma unroll
      for (int n = held; n < 8; n *= 2) {
        const int o = L * n / 8;  // the lane bit of the stage that went from 2n to n values
        const bool b = lane & o;
#pragma unroll
        for (int k = 0; k < n; ++k) {
          const float other = __shfl_xor_sync(0xFFFFFFFFu, m[k], o);
          m[k + n] = b ? m[k] : other;
          m[k] = b ? other : m[k];
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t r = row0 + i;
        if (r < M && cok) store_row<S>(s, d, i, [&](int) { return m[i]; }, r * K + col, c.key);
      }
    } else if constexpr (S::col || S::blk) {
      uint32_t am[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) am[j] = ca[j];  // 16-row group maxima (xor-16 already applied)
      if constexpr (S::tall) {
        constexpr int gw = S::br / 16;  // warps per block row
        const int w0 = w & ~(gw - 1);
#pragma unroll
        for (int g = 0; g < gw; ++g) {
          const uint4 a = red[w0 + g][2 * cv], b = red[w0 + g][2 * cv + 1];
          am[0] = umax(am[0], a.x); am[1] = umax(am[1], a.y); am[2] = umax(am[2], a.z); am[3] = umax(am[3], a.w);
          am[4] = umax(am[4], b.x); am[5] = umax(am[5], b.y); am[6] = umax(am[6], b.z); am[7] = umax(am[7], b.w);
        }
      }
      const bool first = h == 0 && (w % (S::br / 16)) == 0 && row0 < M && cok;  // writes the scales
      if constexpr (S::col && S::opt) {
        if (s.fos) {
          // 4/6 16 x 1 blocks over the half-warps (xor 16): both derive both candidates of the 8
          // columns, add each other's error sums over their 8 rows and pick the same scales.
          float mult[8];
          uint32_t bits[8];
#pragma unroll
          for (int j = 0; j < 8; ++j)
            mult[j] = fos_pick<8>(s, u2f(am[j]), slot_senc<S>(s, c, col + j, K, false),
                                  [&](int i) { return d.f(i, j); }, 16, 0, bits[j]);
          if (h == 0 && row0 < M && cok) store_scales8<kNVFP4>(s, (row0 / 16) * K + col, bits);
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (row0 + i < M && cok) store_row<S>(s, d, i, [&](int j) { return mult[j]; }, (row0 + i) * K + col, c.key);
          return;
        }
      }
      if constexpr (S::col) {
        // Half-warp h derives the scales of columns 4h..4h+3 and swaps multipliers with the other.
        float mult[8];
        uint32_t bits[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float mine = block_params<S::kind>(s, u2f(h ? am[k + 4] : am[k]),
                                                   slot_senc<S>(s, c, col + (h ? k + 4 : k), K, false), bits[k]);
          const float other = __shfl_xor_sync(0xFFFFFFFFu, mine, 16);
          mult[k] = h ? other : mine;
          mult[k + 4] = h ? mine : other;
        }
        const int64_t rb = row0 - 8 * h;  // first row of the 16-row group
        if ((w % (S::br / 16)) == 0 && rb < M && cok) {
          const int64_t idx = (rb / S::br) * K + col + 4 * h;
          if constexpr (S::kind == kFp8Scaled)
            *reinterpret_cast<uint4*>(reinterpret_cast<uint32_t*>(s.scale) + idx) = make_uint4(bits[0], bits[1], bits[2], bits[3]);
          else
            *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(s.scale) + idx) =
                bits[0] | (bits[1] << 8) | (bits[2] << 16) | (bits[3] << 24);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (row0 + i < M && cok) store_row<S>(s, d, i, [&](int j) { return mult[j]; }, (row0 + i) * K + col, c.key);
      } else {
        uint32_t a = am[0];
#pragma unroll
        for (int j = 1; j < 8; ++j) a = umax(a, am[j]);
#pragma unroll
        for (int o = 1; o < S::bc / 8; o <<= 1) a = umax(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
        uint32_t bits;
        float m;
        if constexpr (S::opt) {
          // 4/6 16 x 16 blocks: this thread's 8 x 8 quarter (row-major), then the column halves
          // (xor 1), then the row halves (xor 16)
          m = s.fos ? fos_pick<64>(s, u2f(a), c.s_enc, [&](int k) { return d.f(k / 8, k % 8); }, 1, 16, bits)
                    : block_params<S::kind>(s, u2f(a), c.s_enc, bits);
        } else {
          m = block_params<S::kind>(s, u2f(a), c.s_enc, bits);
        }
        if (first && cv % (S::bc / 8) == 0)
          store_scale1<S::kind>(s, (row0 / S::br) * ((K + S::bc - 1) / S::bc) + col / S::bc, bits);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (row0 + i < M && cok) store_row<S>(s, d, i, [&](int) { return m; }, (row0 + i) * K + col, c.key);
      }
    } else if constexpr (S::had) {
      // Columnwise NVFP4 of T x (T: 16-point random Hadamard along M). M % 16 == 0, so a 16-row
      // group is wholly inside or outside the tensor; both half-warps run the shuffles regardless.
      const int sg = s.signs >> (8 * h);
      const bool sr = s.sr;
      uint32_t codes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      uint32_t bits[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(d.f(i, j), ((sg >> i) & 1) ? -1.f : 1.f);
#pragma unroll
        for (int hh = 1; hh < 8; hh *= 2) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if ((i & hh) == 0) {
              const float a = v[i], b = v[i + hh];
              v[i] = __fadd_rn(a, b);
              v[i + hh] = __fsub_rn(a, b);
            }
          }
        }
        uint32_t a = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // stage 8: rows i (lower half-warp) and i + 8 (upper)
          const float o = __shfl_xor_sync(0xFFFFFFFFu, v[i], 16);
          v[i] = __fmul_rn(h == 0 ? __fadd_rn(v[i], o) : __fsub_rn(o, v[i]), 0.25f);
          a = umax(a, abs_bits(v[i]));
        }
        a = umax(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
        const float se = slot_senc<S>(s, c, col + j, K, false);
        float f;
        if (S::opt && s.fos) {
          f = fos_pick<8>(s, u2f(a), se, [&](int i) { return v[i]; }, 16, 0, bits[j]);
        } else {
          const uint8_t sb = nvfp4_block_scale(u2f(a), se);
          bits[j] = sb;
          f = nvfp4_factor(sb, se);
        }
        const uint32_t idx = uint32_t(row0) * uint32_t(K) + uint32_t(col) + j;  // of row i: + i * K
        if (sr) {
#pragma unroll
          for (int i = 0; i < 8; ++i) codes[i] |= fp4_code<true>(v[i], f, c.key, idx + uint32_t(i) * uint32_t(K)) << (4 * j);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) codes[i] |= fp4_code<false>(v[i], f, c.key, 0u) << (4 * j);
        }
      }
      if (row0 < M && cok) {
        if (h == 0) store_scales8<kNVFP4>(s, (row0 / 16) * K + col, bits);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(s.data) + ((row0 + i) * K + col) / 2) = codes[i];
      }
    } else if constexpr (S::axis && S::br == 1) {
      // One scale per row: the thread's 8 rows; lane cv == 0 of the first column tile stores them.
      float m[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) m[i] = fp8_axis_mult(s, row0 + i, M, col == 0);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (row0 + i < M && cok) store_row<S>(s, d, i, [&](int) { return m[i]; }, (row0 + i) * K + col, c.key);
    } else if constexpr (S::axis) {
      // One scale per column: the thread's 8 columns; the first 8 rows of the tensor store them.
      float mult[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) mult[j] = fp8_axis_mult(s, col + j, K, row0 == 0);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (row0 + i < M && cok) store_row<S>(s, d, i, [&](int j) { return mult[j]; }, (row0 + i) * K + col, c.key);
    } else {  // per-tensor FP8 or identity
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (row0 + i < M && cok) store_row<S>(s, d, i, [&](int) { return c.tmult; }, (row0 + i) * K + col, c.key);
    }
  }
}

// Slot a's per-tensor FP8 codes, then the same bytes into slot b's [K, M] layout (kFp8ScaledT,
// which the host allows only beside an identical slot a), through a 16 KB shared tile so that both
// the shared and the global stores are whole vectors. The thread's 8 x 8 code block is transposed
// in registers (4 x 4 byte blocks, __byte_perm); column j (its 8 rows) is 8 bytes of shared row
// cv * 8 + j, whose 16-byte chunk w (the warp's 16 rows) is XOR-swizzled by cv % 8; then 8 lanes
// write each 128-byte output row segment. The caller guarantees M % 16 == 0 (a 16-row chunk is
// wholly in or out of the tensor). Every thread reaches the barrier.
template <typename T>
__device__ __forceinline__ void store_both_layouts(const SlotCfg& sa, const SlotConst& ka, const SlotCfg& sb,
                                                   const Regs<T>& d, uint8_t* tsm, int64_t M, int64_t K, int64_t row0,
                                                   int64_t col, int tm, int tk, int w, int h, int cv) {
  uint32_t lo[8], hi[8];  // row i's codes of columns 0-3 / 4-7
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint2 c = fp8_codes8(d, i, [&](int) { return ka.tmult; }, sa.e5m2);
    lo[i] = c.x;
    hi[i] = c.y;
    if (row0 + i < M && col < K) *reinterpret_cast<uint2*>(reinterpret_cast<uint8_t*>(sa.data) + (row0 + i) * K + col) = c;
  }
  uint32_t cw[8][2];  // column j's codes of rows 0-3 / 4-7
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int rb = 0; rb < 2; ++rb) {
      const uint32_t* r = half ? hi + 4 * rb : lo + 4 * rb;
      const uint32_t t0 = __byte_perm(r[0], r[1], 0x5140), t1 = __byte_perm(r[2], r[3], 0x5140);
      const uint32_t t2 = __byte_perm(r[0], r[1], 0x7362), t3 = __byte_perm(r[2], r[3], 0x7362);
      cw[4 * half + 0][rb] = __byte_perm(t0, t1, 0x5410);
      cw[4 * half + 1][rb] = __byte_perm(t0, t1, 0x7632);
      cw[4 * half + 2][rb] = __byte_perm(t2, t3, 0x5410);
      cw[4 * half + 3][rb] = __byte_perm(t2, t3, 0x7632);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    *reinterpret_cast<uint2*>(tsm + (cv * 8 + j) * kTile + ((w ^ (cv & 7)) * 16) + h * 8) = make_uint2(cw[j][0], cw[j][1]);
  __syncthreads();
  const int64_t r0 = int64_t(tm) * kTile, c0 = int64_t(tk) * kTile;
#pragma unroll
  for (int p = 0; p < kTile * kTile / 16 / kThreads; ++p) {
    const int idx = p * kThreads + threadIdx.x, oc = idx >> 3, q = idx & 7;
    const int64_t orow = c0 + oc, ocol = r0 + 16 * q;
    if (orow < K && ocol < M)
      *reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(sb.data) + orow * M + ocol) =
          *reinterpret_cast<const uint4*>(tsm + oc * kTile + ((q ^ ((oc >> 3) & 7)) * 16));
  }
}

template <typename T>
constexpr int min_blocks() { return sizeof(T) == 4 ? 2 : 3; }

template <typename T, class A, class B>
__global__ void __launch_bounds__(kThreads, min_blocks<T>())
    tile_kernel(const T* __restrict__ x, int64_t M, int64_t K, int tiles_k, SlotCfg sa, SlotCfg sb) {
  constexpr bool need_row = A::row || B::row;
  constexpr bool need_col = A::colmax || B::colmax;
  constexpr bool need_red = A::tall || B::tall;
  __shared__ uint4 red[need_red ? 8 : 1][32];  // per-warp 16-row column maxima
  __shared__ __align__(16) uint8_t tsm[B::transposed ? kTile * kTile : 16];  // transposed codes

  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int cv = lane & 15, h = lane >> 4;
  const int tm = blockIdx.x / tiles_k, tk = blockIdx.x % tiles_k;
  const int64_t row0 = int64_t(tm) * kTile + w * 16 + h * 8;
  const int64_t col = int64_t(tk) * kTile + cv * 8;

  Regs<T> d;
  const bool cok = col < K;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const bool ok = cok && row0 + i < M;
    const T* p = x + (row0 + i) * K + col;
#pragma unroll
    for (int q = 0; q < Regs<T>::kV; ++q) d.v[i][q] = ok ? ld_stream(reinterpret_cast<const uint4*>(p) + q) : make_uint4(0, 0, 0, 0);
  }
  const SlotConst ka = slot_const<A>(sa), kb = slot_const<B>(sb);

  uint32_t ra[8], ca[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) ra[k] = ca[k] = 0u;
  if constexpr (need_row || need_col) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t b;
        if constexpr (sizeof(T) == 2 && std::is_same<T, __nv_bfloat16>::value) b = (d.raw(i, j) & 0x7FFFu) << 16;
        else b = abs_bits(d.f(i, j));  // fp16 subnormals / fp32: compare as fp32 patterns
        if constexpr (need_row) ra[i] = umax(ra[i], b);
        if constexpr (need_col) ca[j] = umax(ca[j], b);
      }
    }
  }
  if constexpr (need_col) {
#pragma unroll
    for (int j = 0; j < 8; ++j) ca[j] = umax(ca[j], __shfl_xor_sync(0xFFFFFFFFu, ca[j], 16));
  }
  if constexpr (need_red) {
    if (h == 0) {
      red[w][2 * cv] = make_uint4(ca[0], ca[1], ca[2], ca[3]);
      red[w][2 * cv + 1] = make_uint4(ca[4], ca[5], ca[6], ca[7]);
    }
    __syncthreads();
  }
  if constexpr (B::transposed) {
    static_assert(A::tensor && !A::transposed, "transposed FP8 codes pair with a per-tensor FP8 slot");
    store_both_layouts<T>(sa, ka, sb, d, tsm, M, K, row0, col, tm, tk, w, h, cv);
  } else {
    do_slot<A, T>(sa, ka, d, ra, ca, red, M, K, row0, col, w, h, cv);
    do_slot<B, T>(sb, kb, d, ra, ca, red, M, K, row0, col, w, h, cv);
  }
}

template <typename T, class A, class B>
void run(const at::Tensor& x, const SlotCfg& a, const SlotCfg& b) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t tiles_k = (K + kTile - 1) / kTile, tiles = ((M + kTile - 1) / kTile) * tiles_k;
  TORCH_CHECK(tiles < (int64_t(1) << 31), "dtq kernels: tensor too large");
  tile_kernel<T, A, B><<<unsigned(tiles), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(x.data_ptr()), M, K, int(tiles_k), a, b);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launches the specialised kernel for (a, b) and returns true, or returns false (no such pair).
// Needs K % 16 == 0 and 16-byte aligned input and data pointers.
template <typename T>
bool launch(const at::Tensor& x, const SlotCfg& a, const SlotCfg& b) {
#define DTQ_TRY(A_, B_)                          \
  if (A_::match(a) && B_::match(b)) {            \
    run<T, A_, B_>(x, a, b);                     \
    return true;                                 \
  }
  DTQ_FAST_PAIRS(DTQ_TRY)
#undef DTQ_TRY
  return false;
}

}  // namespace fast
}  // namespace dtq
