// SwiGLU forward and backward in one pass each, bit for bit the fp32 formulas of
// dtq/nn/functional.py (swiglu_reference / swiglu_backward_reference):
//   e = exp(-a),  silu = a / (1 + e),  s = 1 / (1 + e)
//   h  = silu * b
//   da = (dh * b) * (s * (1 + a * (1 - s))),   db = dh * silu
// every operation rounded once in fp32 (the explicit _rn intrinsics; expf as torch's CUDA exp),
// results rounded to the input dtype. Eager PyTorch spends five kernels on this (silu, mul; mul
// backward twice, silu backward, the cat of the two halves' gradients) and saves silu(a) besides
// the GEMM output; here the forward reads [T, 2F] once and writes h, the backward reads dh and
// [T, 2F] once and writes the gradient of the whole [T, 2F] input.
//
// With an amax buffer, each also writes max|output| (over the stored, rounded values; NaN wins) as
// the fp32 bit pattern the amax kernel (amax.cu) would produce, so that the GEMM quantizing the
// output next needs no amax pass of its own: one max per thread, a block reduction, one atomicMax
// per block.
//
// Gate/up layout: gate and up alternate in blocks of B columns (B = F: the two halves), so output
// column j reads gate column (j / B) * 2B + j % B and the up column B after it. Each thread moves
// 16 bytes of every tensor when B is a multiple of that many elements and the pointers are
// 16-byte aligned; otherwise one element per thread.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.cuh"

namespace dtq {
namespace {

constexpr int kThreads = 256;

struct Geometry {
  int64_t rows, F, B;  // h is [rows, F]; x is [rows, 2F]; gate/up blocks of B columns
  // Pack p of V output columns: its row r, first column j, and the offset of its gate elements.
  template <int V>
  __device__ __forceinline__ void locate(int64_t p, int64_t& r, int64_t& j, int64_t& gate) const {
    r = p / (F / V);
    j = (p % (F / V)) * V;
    gate = r * 2 * F + (j / B) * 2 * B + j % B;
  }
};

__device__ __forceinline__ float silu_of(float a, float* s) {
  const float d = __fadd_rn(1.0f, expf(-a));
  *s = __fdiv_rn(1.0f, d);
  return __fdiv_rn(a, d);
}

// max over the block's per-thread maxima (bit patterns of |v|), then one atomicMax. Every thread
// of the block calls it (it synchronizes).
__device__ __forceinline__ void commit_amax(uint32_t m, int* out) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  __shared__ uint32_t warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t b = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) b = umax(b, warp_max[w]);
    atomicMax(out, int(b));  // |v| bit patterns are below 2^31: signed order is unsigned order
  }
}

// One pack of V consecutive output columns (V divides B, so the pack never straddles a block).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(const T* __restrict__ x, T* __restrict__ h, Geometry g,
                                                              int* amax) {
  uint32_t m = 0;
  const int64_t packs = g.rows * (g.F / V);
  for (int64_t p = int64_t(blockIdx.x) * kThreads + threadIdx.x; p < packs; p += int64_t(gridDim.x) * kThreads) {
    int64_t r, j, gi;
    g.locate<V>(p, r, j, gi);
    const Pack<T, V> a = *reinterpret_cast<const Pack<T, V>*>(x + gi);
    const Pack<T, V> b = *reinterpret_cast<const Pack<T, V>*>(x + gi + g.B);
    Pack<T, V> out;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float s;
      const float silu = silu_of(to_f32(a.v[i]), &s);
      from_f32(&out.v[i], __fmul_rn(silu, to_f32(b.v[i])));
      m = umax(m, abs_bits(to_f32(out.v[i])));
    }
    *reinterpret_cast<Pack<T, V>*>(h + r * g.F + j) = out;
  }
  if (amax) commit_amax(m, amax);
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_kernel(const T* __restrict__ dh, const T* __restrict__ x,
                                                              T* __restrict__ dx, Geometry g, int* amax) {
  uint32_t m = 0;
  const int64_t packs = g.rows * (g.F / V);
  for (int64_t p = int64_t(blockIdx.x) * kThreads + threadIdx.x; p < packs; p += int64_t(gridDim.x) * kThreads) {
    int64_t r, j, gi;
    g.locate<V>(p, r, j, gi);
    const Pack<T, V> a = *reinterpret_cast<const Pack<T, V>*>(x + gi);
    const Pack<T, V> b = *reinterpret_cast<const Pack<T, V>*>(x + gi + g.B);
    const Pack<T, V> d = *reinterpret_cast<const Pack<T, V>*>(dh + r * g.F + j);
    Pack<T, V> da, db;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float av = to_f32(a.v[i]), bv = to_f32(b.v[i]), dv = to_f32(d.v[i]);
      float s;
      const float silu = silu_of(av, &s);
      const float ds = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(av, __fsub_rn(1.0f, s))));
      from_f32(&da.v[i], __fmul_rn(__fmul_rn(dv, bv), ds));
      from_f32(&db.v[i], __fmul_rn(dv, silu));
      m = umax(m, umax(abs_bits(to_f32(da.v[i])), abs_bits(to_f32(db.v[i]))));
    }
    *reinterpret_cast<Pack<T, V>*>(dx + gi) = da;
    *reinterpret_cast<Pack<T, V>*>(dx + gi + g.B) = db;
  }
  if (amax) commit_amax(m, amax);
}

Geometry check(const at::Tensor& x, const at::Tensor& h, int64_t block, const char* what) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "dtq swiglu ", what,
              ": the gate/up input must be a contiguous [T, 2F] CUDA tensor, got sizes ", x.sizes());
  TORCH_CHECK(x.size(1) % 2 == 0, "dtq swiglu ", what, ": the gate/up input has an odd last dim ", x.size(1));
  const int64_t F = x.size(1) / 2;
  TORCH_CHECK(h.is_cuda() && h.dim() == 2 && h.is_contiguous() && h.size(0) == x.size(0) && h.size(1) == F &&
                  h.scalar_type() == x.scalar_type() && h.device() == x.device(),
              "dtq swiglu ", what, ": the [T, F] tensor must be contiguous, on x's device and of x's dtype, [",
              x.size(0), ", ", F, "]; got ", h.sizes());
  TORCH_CHECK(block >= 1 && F % block == 0, "dtq swiglu ", what, ": the gate/up block ", block,
              " must divide F = ", F);
  return Geometry{x.size(0), F, block};
}

template <typename T, typename Launch>
void dispatch_vec(const Geometry& g, std::initializer_list<const void*> ptrs, Launch&& launch) {
  constexpr int V = 16 / sizeof(T);
  bool vec = g.B % V == 0;
  for (const void* p : ptrs) vec = vec && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  const int64_t packs = g.rows * (g.F / (vec ? V : 1));
  if (packs == 0) return;
  // One pack per thread (a grid of one resident wave, striding, measured 15-27% slower on an
  // H100); the loop only runs past 2^31 - 1 CTAs. With an amax, one atomic per CTA: at 1 GiB of
  // input about 125k, spread over the kernel, well below the L2's rate for one address.
  const int blocks = int(std::min<int64_t>((packs + kThreads - 1) / kThreads, INT32_MAX));
  if (vec)
    launch(std::integral_constant<int, V>{}, blocks);
  else
    launch(std::integral_constant<int, 1>{}, blocks);
}

template <typename Fn>
void by_dtype(const at::Tensor& x, const char* what, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(__nv_bfloat16{}); break;
    case at::kHalf: fn(__half{}); break;
    default: TORCH_CHECK(false, "dtq swiglu ", what, ": dtype ", x.scalar_type(), " is not one of float32, bfloat16, float16");
  }
}

// The int32[1] amax buffer (zeroed here, on the stream), or nullptr.
int* amax_buffer(const c10::optional<at::Tensor>& amax, const at::Tensor& x, const char* what,
                 cudaStream_t stream) {
  if (!amax.has_value()) return nullptr;
  TORCH_CHECK(amax->is_cuda() && amax->device() == x.device() && amax->scalar_type() == at::kInt &&
                  amax->numel() == 1 && amax->is_contiguous(),
              "dtq swiglu ", what, ": the amax buffer must be one int32 on ", x.device());
  C10_CUDA_CHECK(cudaMemsetAsync(amax->data_ptr(), 0, sizeof(int), stream));
  return amax->data_ptr<int>();
}

}  // namespace

void swiglu_forward(const at::Tensor& x, const at::Tensor& h, int64_t block, const c10::optional<at::Tensor>& amax) {
  const Geometry g = check(x, h, block, "forward");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  int* am = amax_buffer(amax, x, "forward", stream);
  by_dtype(x, "forward", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    T* hp = reinterpret_cast<T*>(h.data_ptr());
    dispatch_vec<T>(g, {xp, hp}, [&](auto v, int blocks) {
      swiglu_fwd_kernel<T, decltype(v)::value><<<blocks, kThreads, 0, stream>>>(xp, hp, g, am);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_backward(const at::Tensor& dh, const at::Tensor& x, const at::Tensor& dx, int64_t block,
                     const c10::optional<at::Tensor>& amax) {
  const Geometry g = check(x, dh, block, "backward");
  TORCH_CHECK(dx.is_cuda() && dx.is_contiguous() && dx.sizes() == x.sizes() && dx.scalar_type() == x.scalar_type() &&
                  dx.device() == x.device(),
              "dtq swiglu backward: the gradient output must be a contiguous tensor shaped and typed like x ",
              x.sizes(), ", got ", dx.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  int* am = amax_buffer(amax, x, "backward", stream);
  by_dtype(x, "backward", [&](auto zero) {
    using T = decltype(zero);
    const T* dhp = reinterpret_cast<const T*>(dh.data_ptr());
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    T* dxp = reinterpret_cast<T*>(dx.data_ptr());
    dispatch_vec<T>(g, {dhp, xp, dxp}, [&](auto v, int blocks) {
      swiglu_bwd_kernel<T, decltype(v)::value><<<blocks, kThreads, 0, stream>>>(dhp, xp, dxp, g, am);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dtq
