// Bit-level device helpers shared by the dtq kernels. Each function reproduces one step of
// dtq/_bits.py or a codec in dtq/formats/ exactly: fp32 arithmetic through the explicit
// round-to-nearest intrinsics (no contraction into FMAs even if -fmad were on), NaN-propagating
// maxima on the bit patterns of |x|, and saturating RNE casts.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace dtq {

constexpr float kFltMax = 3.4028234663852886e+38f;
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;  // torch's float('nan')

// Payload kinds one direction slot of the fused kernel can produce (mirrors dtq/kernels.py).
// kFp8Row: FP8 with one scale per whole row (br, bc = 1, 0) or whole column (0, 1), derived from
// the amax vector amax_in ([M] / [K]) that the axis-amax pass (amax.cu) or the caller wrote.
// kFp8ScaledT: per-tensor FP8 codes written transposed ([K, M], the layout cuBLAS's FP8 GEMMs take
// for dgrad and wgrad), only as slot b beside the same per-tensor kFp8Scaled slot a: one output
// (the codes; the scale is slot a's).
enum SlotKind : int { kNone = 0, kFp8Scaled = 1, kMXFP8 = 2, kNVFP4 = 3, kIdentity = 4, kFp8Row = 5, kFp8ScaledT = 6 };
// Element dtypes of inputs and identity outputs.
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// One direction's configuration, passed by value to the kernels.
struct SlotCfg {
  int kind;        // SlotKind
  int br, bc;      // block rows / cols sharing a scale; 0, 0: one scale for the tensor (kFp8Row: above)
  int e5m2;        // FP8 element type: 0 e4m3fn, 1 e5m2
  int pow2;        // kFp8Scaled, kFp8Row: round scales down to a power of two
  int floor_mode;  // kMXFP8: OCP floor derivation instead of RCEIL
  int sr;          // kNVFP4: stochastic rounding
  int stream;      // kNVFP4: random-bits stream
  int hadamard;    // kNVFP4: 16-point random Hadamard along M (columnwise)
  int signs;       // Hadamard sign mask, bit j set: sign j is -1
  int out_dtype;   // kIdentity: DType of the output
  int row_scaled;  // kNVFP4: S_enc per row (br == 1) / column (br == 16, bc == 1) from the amax vector amax_in
  int fos;         // kNVFP4 four-over-six block scales: 0 off, 1 sum of |error|, 2 sum of error^2
  float fmax;      // FP8 max of the element type (kFp8Scaled, kMXFP8)
  float gmax;      // kNVFP4: e4m3_max * 6, the numerator of S_enc
  void* data;      // codes (or identity values)
  void* scale;     // block scales: fp32 scale_inv (also kFp8Row's [M] / [K]) / uint8 E8M0 / e4m3 bytes
  float* tensor_out;         // per-tensor output: fp32 scale_inv (kFp8Scaled with br == 0) or amax (kNVFP4;
                             // row_scaled: one per row / column)
  const float* amax_in;      // tensor-wide amax (kFp8Scaled per-tensor, kNVFP4); kFp8Row, row-scaled
                             // kNVFP4: one per row / column
  const int64_t* seed;       // kNVFP4 with sr
};

__device__ __forceinline__ uint32_t f2u(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float u2f(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ uint32_t abs_bits(float f) { return f2u(f) & 0x7FFFFFFFu; }
// max over |x| bit patterns: NaN (bits above +inf) wins, like torch's amax.
__device__ __forceinline__ uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }
__device__ __forceinline__ bool is_nan(float f) { return abs_bits(f) > 0x7F800000u; }
__device__ __forceinline__ bool is_finite(float f) { return abs_bits(f) < 0x7F800000u; }

template <typename T> struct InType;
template <> struct InType<float> {
  static __device__ __forceinline__ float to_f32(float v) { return v; }
};
template <> struct InType<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <> struct InType<__half> {
  static __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
};
template <typename T> __device__ __forceinline__ float to_f32(T v) { return InType<T>::to_f32(v); }
// The RNE cast of an fp32 value into an element (torch's own float -> bf16 / fp16 conversion).
__device__ __forceinline__ void from_f32(float* p, float v) { *p = v; }
__device__ __forceinline__ void from_f32(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void from_f32(__half* p, float v) { *p = __float2half_rn(v); }

// V elements moved as one aligned vector (16 bytes for the elementwise kernels).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// floor(log2(v)) for positive finite v, subnormals included (torch.frexp exponent - 1).
__device__ __forceinline__ int floor_log2(float v) {
  uint32_t b = f2u(v);
  int e = int(b >> 23);
  if (e) return e - 127;
  return (31 - __clz(int(b))) - 149;
}
// ceil(log2(v)) for positive finite v: floor, plus one unless v is a power of two.
__device__ __forceinline__ int ceil_log2(float v) {
  uint32_t b = f2u(v);
  int e = int(b >> 23);
  uint32_t m = b & 0x7FFFFFu;
  if (e) return (e - 127) + (m != 0);
  return floor_log2(v) + ((m & (m - 1)) != 0);
}
// 2**e as fp32 for -149 <= e <= 127 (exact, subnormal below -126).
__device__ __forceinline__ float exp2i(int e) {
  return e >= -126 ? u2f(uint32_t(e + 127) << 23) : u2f(1u << (e + 149));
}

// _bits.per_tensor_scale: fmax / amax, 1 when amax is 0 or non-finite, capped at FLT_MAX,
// optionally rounded down to a power of two.
__device__ __forceinline__ float scale_from_amax(float amax, float fmax, bool pow2) {
  float s = (is_finite(amax) && amax > 0.f) ? __fdiv_rn(fmax, amax) : 1.f;
  if (!(s <= kFltMax)) s = kFltMax;  // +inf -> FLT_MAX (s is never NaN here)
  if (pow2) s = exp2i(floor_log2(s));
  return s;
}

// kFp8Row: the multiplier of row / column idx (of n) from the slot's amax vector (1 past the end),
// and, when `store`, its fp32 scale_inv into scale[idx].
__device__ __forceinline__ float fp8_axis_mult(const SlotCfg& s, int64_t idx, int64_t n, bool store) {
  const float m = scale_from_amax(idx < n ? __ldg(s.amax_in + idx) : 0.f, s.fmax, s.pow2);
  if (store && idx < n) reinterpret_cast<float*>(s.scale)[idx] = __frcp_rn(m);
  return m;
}

// _bits.cast_fp8 of an fp32 value: saturate, RNE, NaN -> 0x7F.
__device__ __forceinline__ uint8_t cast_fp8(float v, bool e5m2) {
  if (is_nan(v)) return 0x7F;
  return e5m2 ? uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2))
              : uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Exact value of an e4m3fn code (NaN for 0x7F/0xFF).
__device__ __forceinline__ float e4m3_value(uint8_t c) {
  uint32_t s = uint32_t(c & 0x80) << 24;
  uint32_t e = (c >> 3) & 0xF, m = c & 7;
  if (e == 15 && m == 7) return u2f(kCanonicalNaN);
  if (e == 0) return u2f(s | f2u(__fmul_rn(float(m), 0.001953125f)));  // m * 2**-9
  return u2f(s | ((e + 120) << 23) | (m << 20));
}

// ------------------------------------------------------------------------------------------
// MXFP8: biased E8M0 exponent of a block amax (mxfp8.e8m0_exponent) and its multiplier 2**-e.
__device__ __forceinline__ uint32_t e8m0_biased(float amax, float fmax, bool e5m2, bool floor_mode) {
  if (!is_finite(amax)) return 0xFF;
  if (amax == 0.f) return 0;
  int e;
  if (!floor_mode) {
    float d = __fdiv_rn(amax, fmax);
    e = d > 0.f ? ceil_log2(d) : -127;
  } else {
    e = floor_log2(amax) - (e5m2 ? 15 : 8);
  }
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return uint32_t(e + 127);
}
__device__ __forceinline__ float e8m0_inv(uint32_t biased) {
  return biased == 0xFF ? u2f(kCanonicalNaN) : exp2i(127 - int(biased));
}

// ------------------------------------------------------------------------------------------
// NVFP4
// S_enc = gmax / amax (gmax = e4m3_max * 6; 2688 by default).
__device__ __forceinline__ float nvfp4_senc(float amax, float gmax) { return scale_from_amax(amax, gmax, false); }

// Block scale byte: e4m3((block_amax / div) * S_enc), div 6 (or 4: four-over-six's other candidate).
__device__ __forceinline__ uint8_t nvfp4_block_scale(float bamax, float s_enc, float div = 6.f) {
  return cast_fp8(__fmul_rn(__fdiv_rn(bamax, div), s_enc), false);
}

// Row-scaled NVFP4: S_enc of row / column idx of n from the slot's amax vector (1 past the end),
// and, when `store`, that amax (NaN canonical) into the payload's amax vector.
__device__ __forceinline__ float nvfp4_vector_senc(const SlotCfg& s, int64_t idx, int64_t n, bool store) {
  const float am = idx < n ? __ldg(s.amax_in + idx) : 0.f;
  if (store && idx < n) s.tensor_out[idx] = is_nan(am) ? u2f(kCanonicalNaN) : am;
  return nvfp4_senc(am, s.gmax);
}
// Multiplier S_enc / s_b; 0 marks an all-zero-code block (s_b == 0).
__device__ __forceinline__ float nvfp4_factor(uint8_t sb, float s_enc) {
  float sbf = e4m3_value(sb);
  return sbf == 0.f ? 0.f : __fdiv_rn(s_enc, sbf);
}

// _bits.e2m1_encode: RNE, saturating, NaN -> +6. Below 1 the grid is 0.5-spaced (rint(2v));
// from 1 up it is a float with one mantissa bit, rounded on the fp32 bits (ties to even).
__device__ __forceinline__ uint32_t e2m1_rne(float x) {
  const uint32_t b = abs_bits(x);
  if (b > 0x7F800000u) return 7;
  uint32_t m;
  if (b < 0x3F800000u) {
    m = __float2uint_rn(__fmul_rn(u2f(b), 2.f));
  } else {
    m = ((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252u;
    m = m > 7u ? 7u : m;
  }
  return m | ((f2u(x) >> 28) & 8);
}

// Magnitude of E2M1 code i in 0..7 (0, .5, 1, 1.5, 2, 3, 4, 6), without a run-time-indexed array.
__device__ __forceinline__ float e2m1_magnitude(uint32_t i) {
  return i <= 4 ? __fmul_rn(float(i), 0.5f) : (i == 5 ? 3.f : (i == 6 ? 4.f : 6.f));
}

// Four-over-six: the block's two candidate scales (divisors 6 and 4), their values and multipliers.
struct Fp4Candidates {
  uint8_t sb6, sb4;
  float v6, v4, m6, m4;
};
__device__ __forceinline__ Fp4Candidates nvfp4_candidates(float bamax, float s_enc) {
  Fp4Candidates c;
  c.sb6 = nvfp4_block_scale(bamax, s_enc);
  c.sb4 = nvfp4_block_scale(bamax, s_enc, 4.f);
  c.v6 = e4m3_value(c.sb6);
  c.v4 = e4m3_value(c.sb4);
  c.m6 = nvfp4_factor(c.sb6, s_enc);
  c.m4 = nvfp4_factor(c.sb4, s_enc);
  return c;
}
// One element's error under a candidate (multiplier m, scale value v) with RNE codes, in the
// S_enc-scaled space: e = e2m1_value * v - x * S_enc (xs); |e| (mode 1) or e * e (mode 2).
__device__ __forceinline__ float nvfp4_error(float x, float xs, float m, float v, int mode) {
  const uint32_t c = m == 0.f ? 0u : e2m1_rne(__fmul_rn(x, m));
  float q = e2m1_magnitude(c & 7);
  if (c & 8) q = -q;
  const float e = __fsub_rn(__fmul_rn(q, v), xs);
  return mode == 2 ? __fmul_rn(e, e) : fabsf(e);
}
// Sequential sums (in order, the first term as the start) of both candidates' errors over n
// elements x(0..n-1) of a block.
template <int N, typename XFn>
__device__ __forceinline__ void nvfp4_errors(XFn x, float s_enc, const Fp4Candidates& c, int mode, float& e6,
                                             float& e4) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float v = x(k), xs = __fmul_rn(v, s_enc);
    const float a = nvfp4_error(v, xs, c.m6, c.v6, mode), b = nvfp4_error(v, xs, c.m4, c.v4, mode);
    e6 = k == 0 ? a : __fadd_rn(e6, a);
    e4 = k == 0 ? b : __fadd_rn(e4, b);
  }
}

// _bits.e2m1_encode_stochastic with 32 random bits r.
__device__ __forceinline__ uint32_t e2m1_sr(float x, uint32_t r) {
  if (is_nan(x)) return 7;
  float v = fabsf(x);
  if (v > 6.f) v = 6.f;
  uint32_t lo = (v >= 0.5f) + (v >= 1.f) + (v >= 1.5f) + (v >= 2.f) + (v >= 3.f) + (v >= 4.f) + (v >= 6.f);
  uint32_t hi = lo + 1 > 7 ? 7 : lo + 1;
  float glo = e2m1_magnitude(lo), ghi = e2m1_magnitude(hi);
  float frac = ghi > glo ? __fdiv_rn(__fsub_rn(v, glo), __fsub_rn(ghi, glo)) : 0.f;
  float u = __fmul_rn(float(r >> 8), 5.9604644775390625e-08f);  // * 2**-24
  uint32_t m = u < frac ? hi : lo;
  return m | ((f2u(x) >> 28) & 8);
}

// ------------------------------------------------------------------------------------------
// Counter-based random bits (_bits.hash32 / random_bits).
__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}
__device__ __forceinline__ uint32_t rng_key(const int64_t* seed, int stream) {
  uint32_t s = uint32_t(uint64_t(*seed) & 0xFFFFFFFFull);
  return hash32(s ^ (uint32_t(stream) * 0x9E3779B9u));
}
__device__ __forceinline__ uint32_t rand_at(uint32_t key, uint64_t idx) {
  return hash32(uint32_t(idx & 0xFFFFFFFFull) ^ key);
}

// The unnormalized 16-point Walsh-Hadamard transform of v, in place: four butterfly stages of
// a + b, a - b (h = 1, 2, 4, 8), the operation order of _bits.hadamard_rows.
__device__ __forceinline__ void walsh16(float (&v)[16]) {
#pragma unroll
  for (int h = 1; h < 16; h *= 2) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if ((i & h) == 0) {
        float a = v[i], b = v[i + h];
        v[i] = __fadd_rn(a, b);
        v[i + h] = __fsub_rn(a, b);
      }
    }
  }
}

// The random Hadamard T = H16 / 4 . diag(signs) of v (in place): signs, walsh16, * 0.25.
__device__ __forceinline__ void hadamard16(float (&v)[16], int signs) {
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(v[i], ((signs >> i) & 1) ? -1.f : 1.f);
  walsh16(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(v[i], 0.25f);
}

// Multiprocessor count of the current device (grid sizing of grid-stride kernels).
inline int sm_count() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n > 0 ? n : 132;
}

}  // namespace dtq
