// Fused quantization: one read of a [M, K] input produces up to two direction payloads ("slots"),
// each of any format (FP8 per-tensor / block, MXFP8, NVFP4, identity), both written in the
// logical [M, K] orientation.
//
// One CTA of 256 threads owns a 128 x 128 input tile, staged in shared memory in the input dtype
// (16-byte cp.async copies, XOR-swizzled so the two access patterns below are bank-conflict free):
//   1. column pass: thread = 2 columns x 32 rows; max|x| per 16-row group and column, and the
//      whole NVFP4 random-Hadamard columnwise direction (the 16-row transform lives in registers);
//   2. block pass: the amax, scale and multiplier of every block taller than one row (columnwise
//      blocks, 16x16, 128x128), multipliers kept in shared memory, scales written out;
//   3. cast pass: thread = 16 consecutive columns x 4 rows; row-block amaxes (1x16 in-thread,
//      1x32 / 1x128 by warp shuffles), then both slots' codes from the same registers, stored as
//      16-byte (FP8) / 8-byte (FP4) vectors.
// Tensor-wide amaxes (FP8 per-tensor, NVFP4 S_enc) and FP8 row-wise's per-row / per-column amax
// vectors come from device pointers (amax.cu or the caller), so no host synchronization happens.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cmath>
#include <cstdlib>

#include "common.cuh"

namespace dtq {
namespace fast {
// Specialised kernels for the slot pairs dtq's formats produce (quantize_tile.cuh, instantiated
// in quantize_fast_*.cu); false: no kernel for this pair, the generic one below runs.
template <typename T>
bool launch(const at::Tensor& x, const SlotCfg& a, const SlotCfg& b);
}  // namespace fast

void transpose_u8(const at::Tensor& in, const at::Tensor& out);  // transpose.cu

namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kGroups = kTile / 16;  // 16-row groups per tile

// Columnwise NVFP4 slots done wholly in the column pass (hadamard_nvfp4's registers): the random
// Hadamard, row-scaled S_enc per column, four-over-six (which needs every value of a block).
__host__ __device__ inline bool column_in_registers(const SlotCfg& s) {
  return s.kind == kNVFP4 && s.br == 16 && s.bc == 1 && (s.hadamard || s.row_scaled || s.fos);
}

__host__ __device__ inline int blocks_per_tile(const SlotCfg& s) {
  if (s.br <= 1 || s.kind == kFp8Row) return 0;  // row blocks, per-tensor and per-axis scales need no table
  if (column_in_registers(s)) return 0;
  return (kTile / s.br) * (kTile / s.bc);
}

template <typename T>
struct Tile {
  static constexpr int kEpv = 16 / sizeof(T);            // elements per 16-byte vector
  static constexpr int kVpr = kTile / kEpv;              // vectors per row
  static constexpr int kChunkVecs = 16 / kEpv;           // vectors in a 16-column chunk
  static constexpr int kBytes = kTile * kTile * sizeof(T);
  // Byte offset of element (r, c): 16-byte vectors permuted within aligned groups of 8.
  static __device__ __forceinline__ int vec_off(int r, int j) {
    return r * (kVpr * 16) + ((j ^ ((j >> 3) & (kChunkVecs - 1))) * 16);
  }
  static __device__ __forceinline__ int elem_off(int r, int c) {
    return vec_off(r, c / kEpv) + (c % kEpv) * int(sizeof(T));
  }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// Scale and multiplier of one block from its amax.
__device__ __forceinline__ float block_params(const SlotCfg& s, float bam, float s_enc, uint32_t& scale_bits) {
  if (s.kind == kFp8Scaled) {
    float sc = scale_from_amax(bam, s.fmax, s.pow2);
    scale_bits = f2u(__frcp_rn(sc));
    return sc;
  }
  if (s.kind == kMXFP8) {
    uint32_t b = e8m0_biased(bam, s.fmax, s.e5m2, s.floor_mode);
    scale_bits = b;
    return e8m0_inv(b);
  }
  uint8_t sb = nvfp4_block_scale(bam, s_enc);  // kNVFP4
  scale_bits = sb;
  return nvfp4_factor(sb, s_enc);
}

__device__ __forceinline__ void store_scale(const SlotCfg& s, int64_t idx, uint32_t bits) {
  if (s.kind == kFp8Scaled || s.kind == kFp8Row)
    reinterpret_cast<uint32_t*>(s.scale)[idx] = bits;
  else
    reinterpret_cast<uint8_t*>(s.scale)[idx] = uint8_t(bits);
}

__device__ __forceinline__ uint32_t fp4_code(const SlotCfg& s, float v, float mult, uint32_t key, int64_t idx) {
  if (mult == 0.f) return 0;  // s_b == 0: the whole block is code 0
  float y = __fmul_rn(v, mult);
  return s.sr ? e2m1_sr(y, rand_at(key, uint64_t(idx))) : e2m1_rne(y);
}

// 16 consecutive elements of one row, as the raw 16-byte vectors read from shared memory.
template <typename T>
struct Chunk {
  static constexpr int kVecs = int(sizeof(T));  // 16 elements * sizeof(T) / 16 bytes
  uint4 v[kVecs];
  __device__ __forceinline__ uint32_t word(int w) const {
    const uint4& q = v[w / 4];
    const int i = w % 4;
    return i == 0 ? q.x : (i == 1 ? q.y : (i == 2 ? q.z : q.w));
  }
  // Raw bit pattern of element j (j a compile-time constant after unrolling).
  __device__ __forceinline__ uint32_t bits(int j) const {
    if constexpr (sizeof(T) == 4) return word(j);
    else return (word(j / 2) >> (16 * (j % 2))) & 0xFFFFu;
  }
  __device__ __forceinline__ float f32(int j) const {
    if constexpr (sizeof(T) == 4) return u2f(bits(j));
    else if constexpr (std::is_same<T, __nv_bfloat16>::value) return u2f(bits(j) << 16);
    else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits(j))));
  }
};

// Identity output bits of one fp32 value in dtype `od` (canonical NaN, RNE).
__device__ __forceinline__ uint32_t identity_bits(float v, int od) {
  if (od == kF32) return is_nan(v) ? kCanonicalNaN : f2u(v);
  if (od == kBF16) return is_nan(v) ? 0x7FC0u : uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
  return is_nan(v) ? 0x7E00u : uint32_t(__half_as_ushort(__float2half_rn(v)));
}

template <typename T>
__device__ __forceinline__ void write_identity(const SlotCfg& s, const Chunk<T>& ch, int64_t off, bool vec, int nvalid) {
  const int osz = s.out_dtype == kF32 ? 4 : 2;
  const bool same = osz == int(sizeof(T)) && (s.out_dtype == kF32 || (s.out_dtype == kBF16) == std::is_same<T, __nv_bfloat16>::value);
  auto e = [&](int j) -> uint32_t { return same ? ch.bits(j) : identity_bits(ch.f32(j), s.out_dtype); };
  if (osz == 4) {
    uint32_t* dst = reinterpret_cast<uint32_t*>(s.data) + off;
    if (vec) {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        reinterpret_cast<uint4*>(dst)[q] = make_uint4(e(4 * q), e(4 * q + 1), e(4 * q + 2), e(4 * q + 3));
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (j < nvalid) dst[j] = e(j);
    }
  } else {
    uint16_t* dst = reinterpret_cast<uint16_t*>(s.data) + off;
    if (vec) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = e(8 * q + 2 * i) | (e(8 * q + 2 * i + 1) << 16);
        reinterpret_cast<uint4*>(dst)[q] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (j < nvalid) dst[j] = uint16_t(e(j));
    }
  }
}

// One slot's output for 16 consecutive elements of a row; mult(j) is element j's multiplier.
template <typename T, typename MultFn>
__device__ __forceinline__ void write_slot_row(const SlotCfg& s, const Chunk<T>& ch, MultFn mult, int64_t K,
                                               int64_t row, int64_t col0, bool vec, uint32_t key) {
  const int nvalid = K - col0 < 16 ? int(K - col0) : 16;
  if (s.kind == kFp8Scaled || s.kind == kMXFP8 || s.kind == kFp8Row) {
    uint8_t* dst = reinterpret_cast<uint8_t*>(s.data) + row * K + col0;
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j / 4] |= uint32_t(cast_fp8(__fmul_rn(ch.f32(j), mult(j)), s.e5m2)) << (8 * (j % 4));
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (j < nvalid) dst[j] = uint8_t(w[j / 4] >> (8 * (j % 4)));
    }
  } else if (s.kind == kNVFP4) {
    uint32_t w[2] = {0, 0};
    const int64_t base = row * K + col0;
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j / 8] |= fp4_code(s, ch.f32(j), mult(j), key, base + j) << (4 * (j % 8));
    uint8_t* dst = reinterpret_cast<uint8_t*>(s.data) + base / 2;
    if (vec) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (2 * j < nvalid) dst[j] = uint8_t(w[j / 4] >> (8 * (j % 4)));
    }
  } else if (s.kind == kIdentity) {
    write_identity<T>(s, ch, row * K + col0, vec, nvalid);
  }
}

// NVFP4 scale byte and multiplier of one block whose 16 values v(0..15) this thread holds: from
// its amax, or with four-over-six from both candidates' errors (two sequential halves, then added).
template <typename VFn>
__device__ __forceinline__ float nvfp4_block16(const SlotCfg& s, float bamax, float s_enc, VFn v, uint8_t& sb) {
  if (!s.fos) {
    sb = nvfp4_block_scale(bamax, s_enc);
    return nvfp4_factor(sb, s_enc);
  }
  const Fp4Candidates c = nvfp4_candidates(bamax, s_enc);
  float lo6, lo4, hi6, hi4;
  nvfp4_errors<8>(v, s_enc, c, s.fos, lo6, lo4);
  nvfp4_errors<8>([&](int k) { return v(k + 8); }, s_enc, c, s.fos, hi6, hi4);
  const bool four = __fadd_rn(lo4, hi4) < __fadd_rn(lo6, hi6);  // ties and NaN keep 6
  sb = four ? c.sb4 : c.sb6;
  return four ? c.m4 : c.m6;
}

// Columnwise NVFP4 for one 16-row group of 2 adjacent columns, all in registers (w0, w1 are
// transformed in place): the 16-point random Hadamard, row-scaled S_enc, four-over-six.
__device__ __forceinline__ void column_nvfp4(const SlotCfg& s, float (&w0)[16], float (&w1)[16], int64_t M,
                                             int64_t K, int64_t r0, int64_t col, float s_enc, uint32_t key) {
  if (s.hadamard) {
    hadamard16(w0, s.signs);
    hadamard16(w1, s.signs);
  }
  uint32_t a0 = 0, a1 = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) { a0 = umax(a0, abs_bits(w0[i])); a1 = umax(a1, abs_bits(w1[i])); }
  const float se0 = s.row_scaled ? nvfp4_vector_senc(s, col, K, r0 == 0) : s_enc;
  const float se1 = s.row_scaled ? nvfp4_vector_senc(s, col + 1, K, r0 == 0) : s_enc;
  uint8_t sb0, sb1;
  const float f0 = nvfp4_block16(s, u2f(a0), se0, [&](int i) { return w0[i]; }, sb0);
  const float f1 = nvfp4_block16(s, u2f(a1), se1, [&](int i) { return w1[i]; }, sb1);
  if (r0 >= M || col >= K) return;  // M % 16 == 0 and K % 16 == 0: groups are whole
  uint8_t* sc = reinterpret_cast<uint8_t*>(s.scale) + (r0 / 16) * K + col;
  sc[0] = sb0;
  sc[1] = sb1;
  uint8_t* d = reinterpret_cast<uint8_t*>(s.data) + r0 * (K / 2) + col / 2;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t idx = (r0 + i) * K + col;
    const uint32_t lo = fp4_code(s, w0[i], f0, key, idx), hi = fp4_code(s, w1[i], f1, key, idx + 1);
    d[int64_t(i) * (K / 2)] = uint8_t(lo | (hi << 4));
  }
}

template <typename T>
__device__ __forceinline__ void stage_tile(unsigned char* tile, const T* __restrict__ x, int64_t M, int64_t K,
                                           int64_t m0, int64_t k0, bool vec_ok) {
  using TL = Tile<T>;
  const int t = threadIdx.x;
  const int rows_valid = M - m0 < kTile ? int(M - m0) : kTile;
  const int cols_valid = K - k0 < kTile ? int(K - k0) : kTile;
  if (vec_ok) {  // asynchronous 16-byte copies; zero-filled outside the tensor
#pragma unroll 4
    for (int i = t; i < kTile * TL::kVpr; i += kThreads) {
      const int r = i / TL::kVpr, j = i % TL::kVpr;
      const bool valid = r < rows_valid && j * TL::kEpv < cols_valid;
      const T* src = valid ? x + (m0 + r) * K + k0 + j * TL::kEpv : x;
      cp_async16(tile + TL::vec_off(r, j), src, valid);
    }
  } else {
    using U = typename std::conditional<sizeof(T) == 4, uint32_t, uint16_t>::type;  // raw bits
    const U* xu = reinterpret_cast<const U*>(x);
    for (int e = t; e < kTile * kTile; e += kThreads) {
      const int r = e / kTile, c = e % kTile;
      const U v = (r < rows_valid && c < cols_valid) ? xu[(m0 + r) * K + k0 + c] : U(0);
      *reinterpret_cast<U*>(tile + TL::elem_off(r, c)) = v;
    }
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Stages of the tile pipeline: enough 16-bit tiles in flight per SM to cover HBM latency.
template <typename T> __host__ __device__ constexpr int stages() { return sizeof(T) == 4 ? 2 : 3; }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Persistent CTAs walk the tiles; tile i + 1 is copied into the other buffer while tile i is
// processed, so the input stream never waits on the arithmetic.
template <typename T>
__global__ void __launch_bounds__(kThreads) fused_quantize_kernel(const T* __restrict__ x, int64_t M, int64_t K,
                                                                  SlotCfg sa, SlotCfg sb, int vec_ok) {
  using TL = Tile<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int S = stages<T>();
  uint32_t* colamax = reinterpret_cast<uint32_t*>(smem + S * TL::kBytes);  // [kGroups][kTile]
  uint32_t* tab_a = colamax + kGroups * kTile;                             // block amax, then multipliers
  uint32_t* tab_b = tab_a + blocks_per_tile(sa);

  const int t = threadIdx.x;
  const int64_t tiles_k = (K + kTile - 1) / kTile;
  const int64_t tiles = ((M + kTile - 1) / kTile) * tiles_k;

  // Slot si (0: sa, 1: sb); loops over si are unrolled, so this resolves at compile time.
  auto slot = [&](int si) -> const SlotCfg& { return si ? sb : sa; };
  uint32_t* tabs[2] = {tab_a, tab_b};
  float s_enc[2] = {1.f, 1.f}, tensor_mult[2] = {1.f, 1.f};
  uint32_t key[2] = {0u, 0u};
#pragma unroll
  for (int si = 0; si < 2; ++si) {
    const SlotCfg& s = slot(si);
    if (s.kind == kNVFP4) {
      if (!s.row_scaled) {  // row-scaled slots read S_enc per row / column (nvfp4_vector_senc)
        float am = *s.amax_in;
        s_enc[si] = nvfp4_senc(am, s.gmax);
        if (blockIdx.x == 0 && t == 0) *s.tensor_out = is_nan(am) ? u2f(kCanonicalNaN) : am;
      }
      if (s.sr) key[si] = rng_key(s.seed, s.stream);
    } else if (s.kind == kFp8Scaled && s.br == 0) {
      tensor_mult[si] = scale_from_amax(*s.amax_in, s.fmax, s.pow2);
      if (blockIdx.x == 0 && t == 0) *s.tensor_out = __frcp_rn(tensor_mult[si]);
    }
  }

  if (vec_ok) {  // prologue: the first S - 1 tiles of this CTA in flight
#pragma unroll
    for (int p = 0; p < S - 1; ++p) {
      const int64_t tx = int64_t(blockIdx.x) + int64_t(p) * gridDim.x;
      if (tx < tiles) stage_tile<T>(smem + p * TL::kBytes, x, M, K, (tx / tiles_k) * kTile, (tx % tiles_k) * kTile, true);
      cp_async_commit();
    }
  }
  int it = 0;
  for (int64_t tix = blockIdx.x; tix < tiles; tix += gridDim.x, ++it) {
  unsigned char* tile = smem + (it % S) * TL::kBytes;
  const int64_t m0 = (tix / tiles_k) * kTile;
  const int64_t k0 = (tix % tiles_k) * kTile;
  const int rows_valid = M - m0 < kTile ? int(M - m0) : kTile;
  if (vec_ok) {
    const int64_t nx = tix + int64_t(S - 1) * gridDim.x;
    if (nx < tiles)
      stage_tile<T>(smem + ((it + S - 1) % S) * TL::kBytes, x, M, K, (nx / tiles_k) * kTile, (nx % tiles_k) * kTile, true);
    cp_async_commit();
    cp_async_wait<S - 1>();
  } else {
    stage_tile<T>(tile, x, M, K, m0, k0, false);
  }
#pragma unroll
  for (int si = 0; si < 2; ++si) {
    const SlotCfg& s = slot(si);
    if (blocks_per_tile(s) && s.bc == kTile && t < kTile / s.br) tabs[si][t] = 0u;  // atomicMax targets
  }
  __syncthreads();

  // ---- 1. column pass
  const bool need_cols = sa.br > 1 || sb.br > 1;
  if (need_cols) {
    const int cp = t % 64, rq = t / 64;
#pragma unroll 1
    for (int g = 0; g < 2; ++g) {
      float c0[16], c1[16];
      uint32_t a0 = 0, a1 = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const T* p = reinterpret_cast<const T*>(tile + TL::elem_off(rq * 32 + g * 16 + i, 2 * cp));
        c0[i] = to_f32(p[0]);
        c1[i] = to_f32(p[1]);
        a0 = umax(a0, abs_bits(c0[i]));
        a1 = umax(a1, abs_bits(c1[i]));
      }
      colamax[(rq * 2 + g) * kTile + 2 * cp] = a0;
      colamax[(rq * 2 + g) * kTile + 2 * cp + 1] = a1;
#pragma unroll
      for (int si = 0; si < 2; ++si) {
        if (column_in_registers(slot(si)))
          column_nvfp4(slot(si), c0, c1, M, K, m0 + rq * 32 + g * 16, k0 + 2 * cp, s_enc[si], key[si]);
      }
    }
  }
  __syncthreads();

  // ---- 2. block pass (blocks taller than one row)
  bool any_tab = false;
#pragma unroll
  for (int si = 0; si < 2; ++si) {
    const SlotCfg& s = slot(si);
    if (!blocks_per_tile(s)) continue;
    any_tab = true;
    const int nbc = kTile / s.bc, gpb = s.br / 16;
    const int items = (kTile / s.br) * kTile;
    for (int idx = t; idx < items; idx += kThreads) {  // warp-uniform trip count (items % 128 == 0)
      const int gb = idx / kTile, c = idx % kTile;
      uint32_t am = 0;
      for (int g = gb * gpb; g < (gb + 1) * gpb; ++g) am = umax(am, colamax[g * kTile + c]);
      const int w = s.bc < 32 ? s.bc : 32;
      for (int o = 1; o < w; o <<= 1) am = umax(am, __shfl_xor_sync(0xFFFFFFFFu, am, o));
      if (s.bc <= 32) {
        if (c % s.bc == 0) tabs[si][gb * nbc + c / s.bc] = am;
      } else if ((c & 31) == 0) {
        atomicMax(&tabs[si][gb], am);
      }
    }
  }
  if (any_tab) __syncthreads();
#pragma unroll
  for (int si = 0; si < 2; ++si) {
    const SlotCfg& s = slot(si);
    const int nb = blocks_per_tile(s);
    if (!nb) continue;
    const int nbc = kTile / s.bc;
    const int64_t ld = (K + s.bc - 1) / s.bc, nrows = (M + s.br - 1) / s.br;
    for (int b = t; b < nb; b += kThreads) {
      uint32_t bits;
      float mult = block_params(s, u2f(tabs[si][b]), s_enc[si], bits);
      const int64_t gr = m0 / s.br + b / nbc, gc = k0 / s.bc + b % nbc;
      if (gr < nrows && gc < ld) store_scale(s, gr * ld + gc, bits);
      tabs[si][b] = f2u(mult);
    }
  }
  if (any_tab) __syncthreads();

  // ---- 3. cast pass
  const int cc = t & 7, rg = t >> 3;
  const unsigned gmask = 0xFFu << (t & 24);  // the 8 lanes sharing a row
  const int64_t col0 = k0 + cc * 16;
  const bool vec = vec_ok && col0 + 16 <= K;
  // Multipliers of blocks taller than one row: per column for (br x 1) blocks (at most one slot,
  // the columnwise one), one per thread for 2-D blocks and per-tensor scales.
  float colm[16], scal[2];
#pragma unroll
  for (int j = 0; j < 16; ++j) colm[j] = 1.f;
#pragma unroll
  for (int si = 0; si < 2; ++si) {
    const SlotCfg& s = slot(si);
    scal[si] = tensor_mult[si];
    if (s.kind == kFp8Row && s.bc == 1) {  // one scale per column (the only columnwise slot)
#pragma unroll
      for (int j = 0; j < 16; ++j) colm[j] = fp8_axis_mult(s, col0 + j, K, m0 == 0 && rg == 0);
      continue;
    }
    if (!blocks_per_tile(s)) continue;
    const int gb = (rg * 4) / s.br;
    if (s.bc == 1) {
#pragma unroll
      for (int j = 0; j < 16; ++j) colm[j] = u2f(tabs[si][gb * kTile + cc * 16 + j]);
    } else {
      scal[si] = u2f(tabs[si][gb * (kTile / s.bc) + (cc * 16) / s.bc]);
    }
  }
#pragma unroll 1
  for (int i = 0; i < 4; ++i) {
    const int r = rg * 4 + i;
    if (r >= rows_valid) break;  // uniform within each 8-lane row group
    Chunk<T> ch;
#pragma unroll
    for (int q = 0; q < TL::kChunkVecs; ++q)
      ch.v[q] = *reinterpret_cast<const uint4*>(tile + TL::vec_off(r, cc * TL::kChunkVecs + q));
    uint32_t am16 = 0;
#pragma unroll
    for (int j = 0; j < 16; ++j) am16 = umax(am16, abs_bits(ch.f32(j)));
    const int64_t row = m0 + r;
#pragma unroll
    for (int si = 0; si < 2; ++si) {
      const SlotCfg& s = slot(si);
      if (s.kind == kNone || column_in_registers(s)) continue;
      if (s.kind == kFp8Row && s.br == 1) {  // one scale per row
        const float m = fp8_axis_mult(s, row, M, col0 == 0);
        if (col0 < K) write_slot_row<T>(s, ch, [&](int) { return m; }, K, row, col0, vec, key[si]);
      } else if (s.br == 1) {  // row blocks of 16 / 32 / 128 along K
        uint32_t am = am16;
        for (int o = 1; o < s.bc / 16; o <<= 1) am = umax(am, __shfl_xor_sync(gmask, am, o));
        uint32_t bits;
        float m;
        if (s.kind == kNVFP4 && (s.row_scaled || s.fos)) {  // 1 x 16: the thread holds the whole block
          const float se = s.row_scaled ? nvfp4_vector_senc(s, row, M, col0 == 0) : s_enc[si];
          uint8_t sb;
          m = nvfp4_block16(s, u2f(am), se, [&](int j) { return ch.f32(j); }, sb);
          bits = sb;
        } else {
          m = block_params(s, u2f(am), s_enc[si], bits);
        }
        if (cc % (s.bc / 16) == 0 && col0 < K) store_scale(s, row * ((K + s.bc - 1) / s.bc) + col0 / s.bc, bits);
        if (col0 < K) write_slot_row<T>(s, ch, [&](int) { return m; }, K, row, col0, vec, key[si]);
      } else if (s.bc == 1) {
        if (col0 < K) write_slot_row<T>(s, ch, [&](int j) { return colm[j]; }, K, row, col0, vec, key[si]);
      } else {
        const float m = scal[si];
        if (col0 < K) write_slot_row<T>(s, ch, [&](int) { return m; }, K, row, col0, vec, key[si]);
      }
    }
  }
  __syncthreads();  // the buffer and tables are reused by the next tile
  }
}

// Value of an e4m3fn code on the host (the NVFP4 e4m3_max setting; finite codes only).
float e4m3_host(int64_t code) {
  const int e = int(code >> 3) & 15, m = int(code) & 7;
  return e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
}

SlotCfg make_cfg(const std::vector<int64_t>& c, const std::vector<at::Tensor>& outs,
                 const c10::optional<at::Tensor>& amax, const c10::optional<at::Tensor>& seed, int64_t M, int64_t K) {
  SlotCfg s{};
  TORCH_CHECK(c.size() == 14, "dtq kernels: slot config needs 14 ints");
  s.kind = int(c[0]); s.br = int(c[1]); s.bc = int(c[2]); s.e5m2 = int(c[3]); s.pow2 = int(c[4]);
  s.floor_mode = int(c[5]); s.sr = int(c[6]); s.stream = int(c[7]); s.hadamard = int(c[8]);
  s.signs = int(c[9]); s.out_dtype = int(c[10]); s.row_scaled = int(c[11]); s.fos = int(c[12]);
  s.fmax = s.e5m2 ? 57344.f : 448.f;
  if (s.kind == kNVFP4) {
    TORCH_CHECK(c[13] >= 0x38 && c[13] <= 0x7E, "dtq kernels: NVFP4 e4m3_max must be an E4M3 code of [1, 448], got ",
                c[13]);
    TORCH_CHECK(s.fos >= 0 && s.fos <= 2, "dtq kernels: NVFP4 four-over-six mode must be 0, 1 or 2");
    TORCH_CHECK(!s.row_scaled || (s.br == 1 && s.bc == 16) || (s.br == 16 && s.bc == 1),
                "dtq kernels: row-scaled NVFP4 has 1 x 16 or 16 x 1 blocks");
    s.gmax = e4m3_host(c[13]) * 6.f;  // exact: 4 significant bits times 6
  }
  if (s.kind == kNone) return s;
  TORCH_CHECK(s.kind != kFp8ScaledT || (s.br == 0 && s.bc == 0), "dtq kernels: transposed FP8 codes are per-tensor");
  const size_t need = s.kind == kNVFP4 ? 3 : ((s.kind == kIdentity || s.kind == kFp8ScaledT) ? 1 : 2);
  TORCH_CHECK(outs.size() == need, "dtq kernels: slot kind ", s.kind, " takes ", need, " output tensors");
  for (auto& o : outs) TORCH_CHECK(o.is_cuda() && o.is_contiguous(), "dtq kernels: outputs must be contiguous CUDA");
  s.data = outs[0].data_ptr();
  if (s.kind == kFp8Scaled && s.br == 0) s.tensor_out = outs[1].data_ptr<float>();
  else if (need >= 2) s.scale = outs[1].data_ptr();
  if (s.kind == kNVFP4) s.tensor_out = outs[2].data_ptr<float>();
  if (s.kind == kNVFP4 && s.row_scaled) {
    const int64_t n = s.br == 1 ? M : K;
    TORCH_CHECK(amax.has_value() && amax->scalar_type() == at::kFloat && amax->is_cuda() && amax->is_contiguous() &&
                    amax->numel() == n && outs[2].numel() == n,
                "dtq kernels: a row-scaled NVFP4 slot needs a contiguous fp32 CUDA amax (and amax output) of ", n,
                " values");
    s.amax_in = amax->data_ptr<float>();
  } else if (s.kind == kNVFP4 || (s.kind == kFp8Scaled && s.br == 0) || s.kind == kFp8ScaledT) {
    TORCH_CHECK(amax.has_value() && amax->scalar_type() == at::kFloat && amax->is_cuda(),
                "dtq kernels: this slot needs an fp32 CUDA amax");
    s.amax_in = amax->data_ptr<float>();
  }
  if (s.kind == kFp8Row) {
    TORCH_CHECK((s.br == 1 && s.bc == 0) || (s.br == 0 && s.bc == 1), "dtq kernels: FP8 row-wise slots are (1, 0) or (0, 1)");
    const int64_t n = s.br == 1 ? M : K;
    TORCH_CHECK(amax.has_value() && amax->scalar_type() == at::kFloat && amax->is_cuda() && amax->is_contiguous() &&
                    amax->numel() == n,
                "dtq kernels: an FP8 row-wise slot needs a contiguous fp32 CUDA amax of ", n, " values");
    s.amax_in = amax->data_ptr<float>();
  }
  if (s.kind == kNVFP4 && s.sr) {
    TORCH_CHECK(seed.has_value() && seed->scalar_type() == at::kLong && seed->is_cuda(),
                "dtq kernels: stochastic rounding needs an int64 CUDA seed");
    s.seed = seed->data_ptr<int64_t>();
  }
  return s;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// DTQ_GENERIC_QUANTIZE=1 forces the generic kernel (tests and benchmarks compare the two).
bool fast_enabled() {
  const char* e = std::getenv("DTQ_GENERIC_QUANTIZE");
  return !(e && e[0] && e[0] != '0');
}

// The specialised kernel of (a, b) for x's dtype, launched: true; false where it has none.
bool launch_fast(const at::Tensor& x, const SlotCfg& a, const SlotCfg& b) {
  switch (x.scalar_type()) {
    case at::kFloat: return fast::launch<float>(x, a, b);
    case at::kBFloat16: return fast::launch<__nv_bfloat16>(x, a, b);
    case at::kHalf: return fast::launch<__half>(x, a, b);
    default: return false;
  }
}

template <typename T>
void launch(const at::Tensor& x, const SlotCfg& a, const SlotCfg& b, int vec_ok) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t tiles = ((M + kTile - 1) / kTile) * ((K + kTile - 1) / kTile);
  TORCH_CHECK(tiles < (int64_t(1) << 31), "dtq kernels: tensor too large");
  const size_t smem = stages<T>() * Tile<T>::kBytes + sizeof(uint32_t) * (kGroups * kTile + blocks_per_tile(a) + blocks_per_tile(b));
  auto kern = fused_quantize_kernel<T>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kThreads, smem));
  const int64_t grid = std::min<int64_t>(tiles, int64_t(sm_count()) * std::max(per_sm, 1));
  kern<<<unsigned(grid), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(x.data_ptr()), M, K, a, b, vec_ok);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// Whether a device is sm_90 or later (dtq/kernels available()'s capability test), asked per op
// call by csrc/ops.cpp: the answer is kept per device index.
bool sm90_or_later(int device) {
  static std::atomic<int8_t> known[64] = {};  // 0 unknown, 1 yes, 2 no
  const int8_t k = device >= 0 && device < 64 ? known[device].load(std::memory_order_relaxed) : 0;
  if (k != 0) return k == 1;
  int major = 0;
  const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
  if (device >= 0 && device < 64) known[device].store(ok ? 1 : 2, std::memory_order_relaxed);
  return ok;
}

// Returns false, launching nothing, where only the generic kernel applies and it lacks an option
// (four-over-six 16 x 16 NVFP4 blocks): the caller runs the reference.
bool quantize_fused(const at::Tensor& x, const std::vector<int64_t>& cfg_a, const std::vector<at::Tensor>& outs_a,
                    const c10::optional<at::Tensor>& amax_a, const std::vector<int64_t>& cfg_b,
                    const std::vector<at::Tensor>& outs_b, const c10::optional<at::Tensor>& amax_b,
                    const c10::optional<at::Tensor>& seed) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "dtq kernels: x must be a contiguous 2-D CUDA tensor");
  if (x.numel() == 0) return true;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), K = x.size(1);
  SlotCfg a = make_cfg(cfg_a, outs_a, amax_a, seed, M, K), b = make_cfg(cfg_b, outs_b, amax_b, seed, M, K);
  TORCH_CHECK(a.kind != kFp8ScaledT, "dtq kernels: transposed FP8 codes go in the second slot");
  if (b.kind == kFp8ScaledT) {
    TORCH_CHECK(a.kind == kFp8Scaled && a.br == 0 && a.e5m2 == b.e5m2 && a.pow2 == b.pow2 && a.amax_in == b.amax_in,
                "dtq kernels: transposed FP8 codes pair with the same per-tensor FP8 slot (dtype, pow2, amax)");
    TORCH_CHECK(outs_b[0].size(0) == K && outs_b[0].size(1) == M, "dtq kernels: transposed FP8 codes are [K, M]");
    // The specialised kernel writes both layouts from one read; elsewhere slot a's codes are
    // quantized alone and then transposed (the same bytes).
    if (K % 16 == 0 && M % 16 == 0 && aligned16(x.data_ptr()) && aligned16(a.data) && aligned16(b.data) &&
        fast_enabled() && launch_fast(x, a, b))
      return true;
    const bool ok = quantize_fused(x, cfg_a, outs_a, amax_a, std::vector<int64_t>(cfg_b.size(), 0), {}, c10::nullopt, seed);
    TORCH_CHECK(ok, "dtq kernels: per-tensor FP8 quantize launched nothing");
    const at::Tensor codes = outs_a[0].view(at::kByte), out = outs_b[0].view(at::kByte);
    if (M % 16 == 0 && K % 16 == 0 && aligned16(codes.data_ptr()) && aligned16(out.data_ptr())) transpose_u8(codes, out);
    else out.copy_(codes.t());
    return true;
  }
  bool vec_ok = K % 16 == 0 && aligned16(x.data_ptr());
  for (const SlotCfg* s : {&a, &b}) {
    if (s->kind != kNone) vec_ok = vec_ok && aligned16(s->data);
    TORCH_CHECK(!s->hadamard || (s->kind == kNVFP4 && s->br == 16 && s->bc == 1),
                "dtq kernels: the Hadamard transform is for columnwise NVFP4");
  }
  // The cast pass keeps one set of per-column multipliers (colm): column blocks or FP8 row-wise columns.
  auto per_column = [](const SlotCfg& s) { return (s.br > 1 && s.bc == 1) || (s.kind == kFp8Row && s.bc == 1); };
  TORCH_CHECK(!(per_column(a) && per_column(b)), "dtq kernels: at most one slot may be columnwise");
  if (vec_ok && fast_enabled() && launch_fast(x, a, b)) return true;
  for (const SlotCfg* s : {&a, &b})
    if (s->kind == kNVFP4 && s->fos && s->br == 16 && s->bc == 16) return false;
  switch (x.scalar_type()) {
    case at::kFloat: launch<float>(x, a, b, vec_ok); break;
    case at::kBFloat16: launch<__nv_bfloat16>(x, a, b, vec_ok); break;
    case at::kHalf: launch<__half>(x, a, b, vec_ok); break;
    default: TORCH_CHECK(false, "dtq kernels: unsupported input dtype ", x.scalar_type());
  }
  return true;
}

}  // namespace dtq
