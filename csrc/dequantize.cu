// Dequantize one direction payload to [M, K] fp32 or bf16 (the emulated GEMMs' operands),
// reproducing the codecs' dequantize (and dequantize_factored) bit for bit: code value times block
// scale in fp32, NVFP4 then divided by S_enc, the random Hadamard inverted with the same
// butterflies; a bf16 output is the RNE rounding of that fp32 value (exact where the format's
// exact_dtype says so). Sixteen elements of a row per thread where K % 16 == 0 and the blocks
// allow it (a kernel per format and block orientation), else eight (8-byte FP8 / 4-byte FP4 code
// loads, 16- or 32-byte stores); unaligned or K % 8 != 0 tensors take a one-element-per-thread loop.
// Hadamard columns take one thread per 16-row group and column.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <type_traits>

#include "common.cuh"

namespace dtq {
namespace {

constexpr int kThreads = 256;

struct DeqCfg {
  int kind, br, bc, e5m2, hadamard, signs, factored;
  int row_scaled;  // NVFP4: one amax per row (br == 1) / column (bc == 1) in `tensor`
  float gmax;      // NVFP4: e4m3_max * 6
  const uint8_t* data;
  const void* scale;
  const float* tensor;  // fp32 scale_inv (FP8 per-tensor) or amax (NVFP4; row-scaled: [M] / [K])
  int64_t M, K;
};

// NVFP4 S_enc of element (r, c): the tensor's (s_enc), or its row's / column's.
__device__ __forceinline__ float deq_senc(const DeqCfg& d, float s_enc, int64_t r, int64_t c) {
  return d.row_scaled ? nvfp4_senc(d.tensor[d.br == 1 ? r : c], d.gmax) : s_enc;
}

__device__ __forceinline__ float fp8_value(uint8_t c, bool e5m2) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(c, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

__device__ __forceinline__ float block_scale(const DeqCfg& d, int64_t r, int64_t c) {
  if (d.kind == kFp8Scaled && d.br == 0) return *d.tensor;
  const int64_t idx = (r / d.br) * ((d.K + d.bc - 1) / d.bc) + c / d.bc;
  if (d.kind == kFp8Scaled) return reinterpret_cast<const float*>(d.scale)[idx];
  const uint8_t b = reinterpret_cast<const uint8_t*>(d.scale)[idx];
  if (d.kind == kMXFP8) return b == 0xFF ? u2f(kCanonicalNaN) : exp2i(int(b) - 127);
  return e4m3_value(b);  // kNVFP4
}

__device__ __forceinline__ float element(const DeqCfg& d, float s_enc, int64_t r, int64_t c) {
  const int64_t i = r * d.K + c;
  float q;
  if (d.kind == kNVFP4) {
    const uint32_t code = (d.data[i >> 1] >> ((i & 1) * 4)) & 0xF;
    q = e2m1_magnitude(code & 7);
    if (code & 8) q = -q;
  } else {
    q = fp8_value(d.data[i], d.e5m2);
  }
  float v = __fmul_rn(q, block_scale(d, r, c));
  if (d.kind == kNVFP4 && !d.factored) v = __fdiv_rn(v, deq_senc(d, s_enc, r, c));
  return v;
}


template <typename OutT>
__global__ void __launch_bounds__(kThreads) dequant_kernel(DeqCfg d, OutT* __restrict__ out) {
  const float s_enc = d.kind == kNVFP4 ? nvfp4_senc(*d.tensor, d.gmax) : 1.f;
  const int64_t n = d.M * d.K;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    from_f32(out + i, element(d, s_enc, i / d.K, i % d.K));
}

__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[8]) {
  uint4 packed;
  uint32_t* w = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    __nv_bfloat162 two = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    w[j] = *reinterpret_cast<uint32_t*>(&two);
  }
  *reinterpret_cast<uint4*>(p) = packed;
}

// Eight consecutive elements of one row per thread. Blocks along K are 16 or more wide and the
// eight start on a multiple of 8, so they share one scale; blocks along M (bc == 1) give each
// column its own.
template <typename OutT>
__global__ void __launch_bounds__(kThreads) dequant_vec8_kernel(DeqCfg d, OutT* __restrict__ out) {
  const float s_enc = d.kind == kNVFP4 ? nvfp4_senc(*d.tensor, d.gmax) : 1.f;
  const int64_t kv = d.K / 8, n = d.M * kv;
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < n; v += int64_t(gridDim.x) * kThreads) {
    const int64_t r = v / kv, c0 = (v - r * kv) * 8, i0 = r * d.K + c0;
    float q[8];
    if (d.kind == kNVFP4) {
      const uint32_t packed = *reinterpret_cast<const uint32_t*>(d.data + (i0 >> 1));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t code = (packed >> (4 * j)) & 0xF;
        const float m = e2m1_magnitude(code & 7);
        q[j] = (code & 8) ? -m : m;
      }
    } else {
      const uint2 codes = *reinterpret_cast<const uint2*>(d.data + i0);
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&codes);
#pragma unroll
      for (int j = 0; j < 8; ++j) q[j] = fp8_value(b[j], d.e5m2);
    }
    float vals[8];
    if (d.bc == 1) {
#pragma unroll
      for (int j = 0; j < 8; ++j) vals[j] = __fmul_rn(q[j], block_scale(d, r, c0 + j));
    } else {
      const float s = block_scale(d, r, c0);
#pragma unroll
      for (int j = 0; j < 8; ++j) vals[j] = __fmul_rn(q[j], s);
    }
    if (d.kind == kNVFP4 && !d.factored) {
#pragma unroll
      for (int j = 0; j < 8; ++j) vals[j] = __fdiv_rn(vals[j], deq_senc(d, s_enc, r, c0 + j));
    }
    store8(out + i0, vals);
  }
}

// An E8M0 scale byte's value, branch-free: exp2i(b - 127) (2**-127, the one subnormal, at 0), NaN at 0xFF.
__device__ __forceinline__ float e8m0_value(uint32_t b) {
  return u2f(b == 0xFFu ? kCanonicalNaN : (b ? b << 23 : 0x00400000u));
}

// Sixteen consecutive elements of one row per thread, the format and the block orientation fixed
// at compile time (no per-element branches or divisions): 16-byte FP8 / 8-byte FP4 code loads,
// 32- or 64-byte stores. Row blocks (COLS false: bc a multiple of 16, or one scale per tensor)
// give the sixteen one scale; column blocks (bc == 1) give each column its own, read as one
// 16-byte vector of byte scales (MXFP8, NVFP4) or four of fp32 ones (FP8).
template <int KIND>
__device__ __forceinline__ float scale_value(const DeqCfg& d, int64_t idx) {
  if constexpr (KIND == kFp8Scaled) return reinterpret_cast<const float*>(d.scale)[idx];
  const uint8_t b = reinterpret_cast<const uint8_t*>(d.scale)[idx];
  if constexpr (KIND == kMXFP8) return e8m0_value(b);
  return e4m3_value(b);
}

// Four E4M3 bytes (the first in the low byte) as floats, two per conversion instruction: exactly
// e4m3_value's numbers. Its NaN bytes (0x7F, 0xFF) become some NaN here, not kCanonicalNaN; every
// caller multiplies the value first, and a product with a NaN operand is the canonical NaN.
__device__ __forceinline__ void e4m3x4_values(uint32_t w, float* out) {
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w >> (16 * p)), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    out[2 * p] = f.x;
    out[2 * p + 1] = f.y;
  }
}

// The values of eight E2M1 codes (4 bits each, the first in the low bits): each magnitude's E4M3
// byte looked up four at a time (byte_perm over the table 0, 0.5, 1, 1.5, 2, 3, 4, 6), the code's
// sign bit moved to its byte's sign bit, then converted; exactly e2m1_magnitude with the sign
// applied (code 8 is -0).
__device__ __forceinline__ void e2m1x8_values(uint32_t w, float (&q)[8]) {
  constexpr uint32_t kLo = 0x3C383000u, kHi = 0x4C484440u;  // E4M3 bytes of magnitudes 0-3, 4-7
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const uint32_t codes = (w >> (16 * p)) & 0xFFFFu;  // four codes
    const uint32_t mag = __byte_perm(kLo, kHi, codes & 0x7777u);
    // each code's nibble into the low half of its own byte, then bit 3 -> bit 7
    const uint32_t spread = (codes & 0xFu) | ((codes & 0xF0u) << 4) | ((codes & 0xF00u) << 8) | ((codes & 0xF000u) << 12);
    e4m3x4_values(mag | ((spread & 0x08080808u) << 4), &q[4 * p]);
  }
}

template <int KIND>
__device__ __forceinline__ void column_scales16(const DeqCfg& d, int64_t idx, float (&s)[16]) {
  if constexpr (KIND == kNVFP4) {
    const uint4 raw = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(d.scale) + idx);
    e4m3x4_values(raw.x, &s[0]);
    e4m3x4_values(raw.y, &s[4]);
    e4m3x4_values(raw.z, &s[8]);
    e4m3x4_values(raw.w, &s[12]);
  } else if constexpr (KIND == kFp8Scaled) {
    const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(d.scale) + idx);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 f = p[q];
      s[4 * q] = f.x; s[4 * q + 1] = f.y; s[4 * q + 2] = f.z; s[4 * q + 3] = f.w;
    }
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(d.scale) + idx);
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if constexpr (KIND == kMXFP8) s[j] = e8m0_value(b[j]);
      else s[j] = e4m3_value(b[j]);
    }
  }
}

// I: the index type, 32-bit where M * K fits (the index divisions are then 32-bit: 64-bit ones
// cost more than the decode of the sixteen elements they place).
template <int KIND, bool COLS, typename OutT, typename I>
__global__ void __launch_bounds__(kThreads) dequant_vec16_kernel(DeqCfg d, OutT* __restrict__ out) {
  const float s_enc = KIND == kNVFP4 ? nvfp4_senc(*d.tensor, d.gmax) : 1.f;
  const bool per_tensor = KIND == kFp8Scaled && d.br == 0;
  const float t_scale = per_tensor ? *d.tensor : 0.f;
  const I K = I(d.K), kv = K / 16, n = I(d.M) * kv, br = I(per_tensor ? 1 : d.br), bc = I(d.bc);
  for (I v = I(blockIdx.x) * kThreads + threadIdx.x; v < n; v += I(gridDim.x) * kThreads) {
    const I r = v / kv, c0 = (v - r * kv) * 16, i0 = r * K + c0;
    float q[16];
    if constexpr (KIND == kNVFP4) {
      const uint2 packed = *reinterpret_cast<const uint2*>(d.data + (i0 >> 1));
      e2m1x8_values(packed.x, *reinterpret_cast<float(*)[8]>(&q[0]));
      e2m1x8_values(packed.y, *reinterpret_cast<float(*)[8]>(&q[8]));
    } else {  // fp8_value's conversions, two codes per instruction
      const uint4 codes = *reinterpret_cast<const uint4*>(d.data + i0);
      const uint16_t* pairs = reinterpret_cast<const uint16_t*>(&codes);
      const __nv_fp8_interpretation_t kind = d.e5m2 ? __NV_E5M2 : __NV_E4M3;
#pragma unroll
      for (int p = 0; p < 8; ++p) {
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[p], kind)));
        q[2 * p] = f.x;
        q[2 * p + 1] = f.y;
      }
    }
    float vals[16];
    if constexpr (COLS) {
      float s[16];
      column_scales16<KIND>(d, (r / br) * K + c0, s);
#pragma unroll
      for (int j = 0; j < 16; ++j) vals[j] = __fmul_rn(q[j], s[j]);
    } else {
      const float s = per_tensor ? t_scale : scale_value<KIND>(d, (r / br) * ((K + bc - 1) / bc) + c0 / bc);
#pragma unroll
      for (int j = 0; j < 16; ++j) vals[j] = __fmul_rn(q[j], s);
    }
    if (KIND == kNVFP4 && !d.factored) {
#pragma unroll
      for (int j = 0; j < 16; ++j) vals[j] = __fdiv_rn(vals[j], deq_senc(d, s_enc, r, c0 + j));
    }
    store8(out + i0, *reinterpret_cast<const float(*)[8]>(&vals[0]));
    store8(out + i0 + 8, *reinterpret_cast<const float(*)[8]>(&vals[8]));
  }
}

// Inverse transform T^T = diag(signs) . H16 / 4 of _bits.hadamard_rows(inverse=True): walsh, * 0.25, * signs.
template <typename OutT>
__global__ void __launch_bounds__(kThreads) dequant_hadamard_kernel(DeqCfg d, OutT* __restrict__ out) {
  const float s_enc = nvfp4_senc(*d.tensor, d.gmax);
  const int64_t items = (d.M / 16) * d.K;
  for (int64_t it = int64_t(blockIdx.x) * kThreads + threadIdx.x; it < items; it += int64_t(gridDim.x) * kThreads) {
    const int64_t g = it / d.K, c = it % d.K;
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = element(d, s_enc, g * 16 + i, c);
    walsh16(v);
#pragma unroll
    for (int i = 0; i < 16; ++i)
      from_f32(out + (g * 16 + i) * d.K + c, __fmul_rn(__fmul_rn(v[i], 0.25f), ((d.signs >> i) & 1) ? -1.f : 1.f));
  }
}

// The sixteen-wide kernel's conditions: K % 16 == 0; 16 elements share a scale (row blocks a
// multiple of 16 wide, or one per tensor) or each column has its own (bc == 1, 16-byte aligned
// scales); aligned codes and output.
bool vec16_ok(const DeqCfg& d, const at::Tensor& out) {
  const bool per_tensor = d.kind == kFp8Scaled && d.br == 0;
  const bool cols = !per_tensor && d.bc == 1;
  const bool rows = per_tensor || (d.bc >= 16 && d.bc % 16 == 0);
  return d.K % 16 == 0 && (rows || (cols && reinterpret_cast<uintptr_t>(d.scale) % 16 == 0)) &&
         reinterpret_cast<uintptr_t>(d.data) % (d.kind == kNVFP4 ? 8 : 16) == 0 &&
         reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
}

}  // namespace

// cfg: kind, br, bc, e5m2, hadamard, signs, factored, row_scaled, e4m3_max code (see SlotKind / SlotCfg in
// common.cuh)[, widest vector width].
void dequantize(const at::Tensor& data, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& tensor,
                const std::vector<int64_t>& cfg, const at::Tensor& out) {
  TORCH_CHECK(cfg.size() == 9 || cfg.size() == 10, "dtq kernels: dequantize config needs 9 ints (a 10th: widest "
              "vector width allowed, 16 or 8, for benchmarks)");
  const int64_t max_width = cfg.size() == 10 ? cfg[9] : 16;
  TORCH_CHECK(max_width == 16 || max_width == 8, "dtq kernels: dequantize vector width must be 16 or 8, got ",
              max_width);
  TORCH_CHECK(out.is_cuda() && out.dim() == 2 && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dtq kernels: dequantize out must be a contiguous fp32 or bf16 [M, K] CUDA tensor");
  TORCH_CHECK(data.is_cuda() && data.is_contiguous() && data.element_size() == 1, "dtq kernels: codes must be 1-byte");
  DeqCfg d{};
  d.kind = int(cfg[0]); d.br = int(cfg[1]); d.bc = int(cfg[2]); d.e5m2 = int(cfg[3]);
  d.hadamard = int(cfg[4]); d.signs = int(cfg[5]); d.factored = int(cfg[6]); d.row_scaled = int(cfg[7]);
  if (d.kind == kNVFP4) {
    TORCH_CHECK(cfg[8] >= 0x38 && cfg[8] <= 0x7E, "dtq kernels: NVFP4 e4m3_max must be an E4M3 code of [1, 448]");
    const int e = int(cfg[8] >> 3) & 15, m = int(cfg[8]) & 7;
    d.gmax = std::ldexp(float(8 + m), e - 10) * 6.f;  // the normal E4M3 value times 6, exact
  }
  d.M = out.size(0); d.K = out.size(1);
  d.data = reinterpret_cast<const uint8_t*>(data.data_ptr());
  if (scale.has_value()) {
    TORCH_CHECK(scale->is_cuda() && scale->is_contiguous(), "dtq kernels: scales must be contiguous CUDA");
    d.scale = scale->data_ptr();
  }
  if (tensor.has_value()) {
    TORCH_CHECK(tensor->is_cuda() && tensor->scalar_type() == at::kFloat, "dtq kernels: per-tensor value is fp32 CUDA");
    TORCH_CHECK(!d.row_scaled || (d.kind == kNVFP4 && tensor->is_contiguous() &&
                                  tensor->numel() == (d.br == 1 ? d.M : d.K) && (d.br == 1 || d.bc == 1)),
                "dtq kernels: row-scaled NVFP4 needs one contiguous amax per row (rowwise) or column (columnwise)");
    d.tensor = tensor->data_ptr<float>();
  }
  TORCH_CHECK(d.kind == kFp8Scaled || d.kind == kMXFP8 || d.kind == kNVFP4, "dtq kernels: no dequantize kernel for kind ", d.kind);
  TORCH_CHECK(!(d.kind == kNVFP4 || (d.kind == kFp8Scaled && d.br == 0)) || d.tensor, "dtq kernels: missing per-tensor value");
  TORCH_CHECK(d.kind == kFp8Scaled && d.br == 0 ? true : d.scale != nullptr, "dtq kernels: missing block scales");
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const int sms = sm_count();
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  if (d.hadamard) {
    TORCH_CHECK(d.kind == kNVFP4 && d.M % 16 == 0, "dtq kernels: Hadamard dequantize is NVFP4 with M % 16 == 0");
    const int64_t items = (d.M / 16) * d.K;
    const int64_t grid = std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t(sms) * 16);
    if (bf16)
      dequant_hadamard_kernel<<<unsigned(grid), kThreads, 0, stream>>>(d, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()));
    else
      dequant_hadamard_kernel<<<unsigned(grid), kThreads, 0, stream>>>(d, out.data_ptr<float>());
  } else if (max_width >= 16 && vec16_ok(d, out)) {
    const int64_t items = d.M * (d.K / 16);
    const unsigned grid = unsigned(std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t(sms) * 16));
    // 32-bit indices: every element index, and the grid-stride loop's last step past n, fit
    const bool small = d.M * d.K + int64_t(grid) * kThreads * 16 < (int64_t(1) << 32);
    auto launch = [&](auto kind, auto cols) {
      constexpr int KIND = decltype(kind)::value;
      constexpr bool COLS = decltype(cols)::value;
      auto go = [&](auto* o) {
        using OutT = std::remove_pointer_t<decltype(o)>;
        if (small)
          dequant_vec16_kernel<KIND, COLS, OutT, uint32_t><<<grid, kThreads, 0, stream>>>(d, o);
        else
          dequant_vec16_kernel<KIND, COLS, OutT, int64_t><<<grid, kThreads, 0, stream>>>(d, o);
      };
      if (bf16) go(reinterpret_cast<__nv_bfloat16*>(out.data_ptr()));
      else go(out.data_ptr<float>());
    };
    auto by_cols = [&](auto kind) {
      if (d.bc == 1) launch(kind, std::true_type{});
      else launch(kind, std::false_type{});
    };
    if (d.kind == kFp8Scaled) by_cols(std::integral_constant<int, kFp8Scaled>{});
    else if (d.kind == kMXFP8) by_cols(std::integral_constant<int, kMXFP8>{});
    else by_cols(std::integral_constant<int, kNVFP4>{});
  } else if (d.K % 8 == 0 && reinterpret_cast<uintptr_t>(d.data) % 8 == 0 &&
             reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0) {
    const int64_t items = d.M * (d.K / 8);
    const int64_t grid = std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t(sms) * 16);
    if (bf16)
      dequant_vec8_kernel<<<unsigned(grid), kThreads, 0, stream>>>(d, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()));
    else
      dequant_vec8_kernel<<<unsigned(grid), kThreads, 0, stream>>>(d, out.data_ptr<float>());
  } else {
    const int64_t grid = std::min<int64_t>((out.numel() + kThreads - 1) / kThreads, int64_t(sms) * 32);
    if (bf16)
      dequant_kernel<<<unsigned(grid), kThreads, 0, stream>>>(d, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()));
    else
      dequant_kernel<<<unsigned(grid), kThreads, 0, stream>>>(d, out.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dtq
