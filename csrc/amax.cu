// Tensor-wide amax pass (FP8 per-tensor scale, NVFP4 S_enc), run before the fused quantize kernel
// only when one of the requested directions needs it. One read of the input gives max|x| and,
// when asked, max|T x| for the 16-row random Hadamard T (both as fp32 bit patterns, NaN winning,
// reduced by atomicMax into a zero-initialized int32[2]).
//
// Axis amax pass (FP8 row-wise scaling): max|x| of every row ([M]) and/or every column ([K]) from
// one read, for the fused kernel's kFp8Row slots, whose scales span more than one tile.
//
// Delayed scaling's history step (the reference is dtq/nn/slot.py, history_step): the scale's amax
// from an amax history and the history's shift, one launch instead of about ten small torch ops
// per quantized tensor and step; with x given, x's own max|x| (the history's new entry) first.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "common.cuh"

namespace dtq {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxHistory = 8192;  // fp32 entries: 32 KiB of dynamic shared memory (of 48 KiB)

__device__ __forceinline__ void block_max_atomic(uint32_t v, uint32_t* out) {
  __shared__ uint32_t part[kThreads / 32];
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? part[threadIdx.x] : 0u;
    v = __reduce_max_sync(0xFFFFFFFFu, v);
    if (threadIdx.x == 0 && v) atomicMax(out, v);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_flat_kernel(const T* __restrict__ x, int64_t n, uint32_t* out, int vec) {
  constexpr int kEpv = 16 / sizeof(T);
  uint32_t m = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (vec) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int64_t nv = n / kEpv;
    for (; i + 3 * stride < nv; i += 4 * stride) {  // four independent 16-byte loads in flight
      uint4 r[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) r[u] = __ldg(xv + i + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const T* e = reinterpret_cast<const T*>(&r[u]);
#pragma unroll
        for (int j = 0; j < kEpv; ++j) m = umax(m, abs_bits(to_f32(e[j])));
      }
    }
    for (; i < nv; i += stride) {
      uint4 r = __ldg(xv + i);
      const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
      for (int j = 0; j < kEpv; ++j) m = umax(m, abs_bits(to_f32(e[j])));
    }
  } else {
    for (; i < n; i += stride) m = umax(m, abs_bits(to_f32(x[i])));
  }
  block_max_atomic(m, out);
}

// The one-rank FSDP2 gather's cast (dtq.parallel.fsdp): y = x cast to y's dtype, and max|y| (the
// amax a per-tensor quantization of y takes, as amax_flat_kernel computes it on y) from the same
// pass, so that a GEMM quantizing the gathered weight need not read it again for its scale.
template <typename D>
__global__ void __launch_bounds__(kThreads) cast_amax_kernel(const float* __restrict__ x, D* __restrict__ y, int64_t n,
                                                             uint32_t* out, int vec) {
  uint32_t m = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (vec) {  // 4 fp32 in (16 bytes), 4 elements out
    const float4* xv = reinterpret_cast<const float4*>(x);
    Pack<D, 4>* yv = reinterpret_cast<Pack<D, 4>*>(y);
    const int64_t nv = n / 4;
    for (; i + 3 * stride < nv; i += 4 * stride) {  // four independent 16-byte loads in flight
      float4 r[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) r[u] = __ldg(xv + i + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        Pack<D, 4> o;
        from_f32(&o.v[0], r[u].x);
        from_f32(&o.v[1], r[u].y);
        from_f32(&o.v[2], r[u].z);
        from_f32(&o.v[3], r[u].w);
#pragma unroll
        for (int j = 0; j < 4; ++j) m = umax(m, abs_bits(to_f32(o.v[j])));
        yv[i + u * stride] = o;
      }
    }
    for (; i < nv; i += stride) {
      const float4 r = __ldg(xv + i);
      Pack<D, 4> o;
      from_f32(&o.v[0], r.x);
      from_f32(&o.v[1], r.y);
      from_f32(&o.v[2], r.z);
      from_f32(&o.v[3], r.w);
#pragma unroll
      for (int j = 0; j < 4; ++j) m = umax(m, abs_bits(to_f32(o.v[j])));
      yv[i] = o;
    }
  } else {
    for (; i < n; i += stride) {
      D o;
      from_f32(&o, x[i]);
      m = umax(m, abs_bits(to_f32(o)));
      y[i] = o;
    }
  }
  block_max_atomic(m, out);
}

// One thread: a 16-row group x W consecutive columns (W = one 16-byte vector, or 1).
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) amax_hadamard_kernel(const T* __restrict__ x, int64_t M, int64_t K,
                                                                 int signs, int want_x, uint32_t* out) {
  uint32_t mx = 0, mh = 0;
  const int64_t chunks = (K + W - 1) / W, items = (M / 16) * chunks;
  for (int64_t it = int64_t(blockIdx.x) * kThreads + threadIdx.x; it < items; it += int64_t(gridDim.x) * kThreads) {
    const int64_t g = it / chunks, c0 = (it % chunks) * W;
    T raw[16][W];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const T* p = x + (g * 16 + i) * K + c0;
      if constexpr (W * sizeof(T) == 16) *reinterpret_cast<uint4*>(raw[i]) = __ldg(reinterpret_cast<const uint4*>(p));
      else raw[i][0] = p[0];
    }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        v[i] = to_f32(raw[i][j]);
        mx = umax(mx, abs_bits(v[i]));
      }
      hadamard16(v, signs);
#pragma unroll
      for (int i = 0; i < 16; ++i) mh = umax(mh, abs_bits(v[i]));
    }
  }
  if (want_x) block_max_atomic(mx, out);
  __syncthreads();
  block_max_atomic(mh, out + 1);
}

// One CTA per 128 x 128 tile; thread (warp w, lane l) reads 8 columns (8 (l % 16)) of 8 rows
// (16 w + 8 (l / 16) + i), like the fused kernel. Row maxima: over the 16 lanes of a half-warp,
// then one atomicMax per row and tile; column maxima: over the 8 rows, the two half-warps and the
// 8 warps (shared memory), then one atomicMax per column and tile. vec: K % 8 == 0 and x 16-byte
// aligned (8-element vector loads), else element loads.
template <typename T>
__global__ void __launch_bounds__(kThreads) axis_amax_kernel(const T* __restrict__ x, int64_t M, int64_t K, int tiles_k,
                                                             uint32_t* rows, uint32_t* cols, int vec) {
  __shared__ uint32_t part[8][128];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, cv = lane & 15, h = lane >> 4;
  const int64_t row0 = int64_t(blockIdx.x / tiles_k) * 128 + w * 16 + h * 8;
  const int64_t col = int64_t(blockIdx.x % tiles_k) * 128 + cv * 8;
  uint32_t ra[8], ca[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) ra[k] = ca[k] = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t r = row0 + i;
    if (r >= M || col >= K) continue;
    const T* p = x + r * K + col;
    uint32_t b[8];
    if (vec) {
      alignas(16) T e[8];
#pragma unroll
      for (int q = 0; q < int(sizeof(T)) / 2; ++q)
        reinterpret_cast<uint4*>(e)[q] = __ldg(reinterpret_cast<const uint4*>(p) + q);
#pragma unroll
      for (int j = 0; j < 8; ++j) b[j] = abs_bits(to_f32(e[j]));
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) b[j] = col + j < K ? abs_bits(to_f32(p[j])) : 0u;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      ra[i] = umax(ra[i], b[j]);
      ca[j] = umax(ca[j], b[j]);
    }
  }
  if (rows) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int o = 1; o < 16; o <<= 1) ra[i] = umax(ra[i], __shfl_xor_sync(0xFFFFFFFFu, ra[i], o));
      if (cv == 0 && row0 + i < M && ra[i]) atomicMax(rows + row0 + i, ra[i]);
    }
  }
  if (cols) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      ca[j] = umax(ca[j], __shfl_xor_sync(0xFFFFFFFFu, ca[j], 16));
      if (h == 0) part[w][cv * 8 + j] = ca[j];
    }
    __syncthreads();
    if (threadIdx.x < 128) {
      uint32_t m = 0;
#pragma unroll
      for (int g = 0; g < 8; ++g) m = umax(m, part[g][threadIdx.x]);
      const int64_t c = int64_t(blockIdx.x % tiles_k) * 128 + threadIdx.x;
      if (c < K && m) atomicMax(cols + c, m);
    }
  }
}

// One CTA. past = hist[skip] (most_recent) or max(hist[skip:]) (0 when empty, NaN when any entry is,
// as torch.amax); amax = (past > 0 ? past : cur) * factor; then the history moves one place towards
// its end and takes cur at [0]. The old entries are staged in shared memory, so no shifted value is
// read after it was written.
__global__ void __launch_bounds__(kThreads) history_kernel(float* hist, int n, int skip, const float* cur,
                                                            float* out, int most_recent, float factor) {
  extern __shared__ float old[];
  __shared__ uint32_t part[kThreads / 32];
  uint32_t m = 0u;
  int nan = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float v = hist[i];
    old[i] = v;
    if (i >= skip) {
      if (is_nan(v)) nan = 1;
      else if (v > 0.f) m = umax(m, f2u(v));  // positive floats order as their bits
    }
  }
  nan = __syncthreads_or(nan);
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
  __syncthreads();
  const float c = *cur;
  if (threadIdx.x == 0) {
    float past;
    if (most_recent) {
      past = skip < n ? old[skip] : 0.f;
    } else {
      uint32_t b = 0u;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) b = umax(b, part[w]);
      past = nan ? u2f(kCanonicalNaN) : u2f(b);
    }
    *out = __fmul_rn(past > 0.f ? past : c, factor);
  }
  for (int i = threadIdx.x; i < n; i += kThreads) hist[i] = i == 0 ? c : old[i - 1];
}

int grid_for(int64_t work) {
  const int sms = sm_count();
  int64_t g = (work + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(sms) * 8;
  return int(g < 1 ? 1 : (g > cap ? cap : g));
}

template <typename T>
void launch(const at::Tensor& x, uint32_t* out, bool want_x, int64_t signs) {
  const int64_t M = x.size(0), K = x.size(1);
  const T* p = reinterpret_cast<const T*>(x.data_ptr());
  auto stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kEpv = 16 / sizeof(T);
  const bool aligned = (reinterpret_cast<uintptr_t>(p) & 15) == 0;
  if (signs < 0) {
    const int64_t n = x.numel();
    const int vec = aligned && n % kEpv == 0;
    amax_flat_kernel<T><<<grid_for(vec ? n / kEpv / 4 : n), kThreads, 0, stream>>>(p, n, out, vec);
  } else {
    TORCH_CHECK(M % 16 == 0, "dtq kernels: the Hadamard amax needs M % 16 == 0");
    if (aligned && K % kEpv == 0)
      amax_hadamard_kernel<T, kEpv><<<grid_for((M / 16) * (K / kEpv)), kThreads, 0, stream>>>(p, M, K, int(signs), want_x, out);
    else
      amax_hadamard_kernel<T, 1><<<grid_for((M / 16) * K), kThreads, 0, stream>>>(p, M, K, int(signs), want_x, out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// rows: int32[M] or None, cols: int32[K] or None, zeroed here, then max|x| of each row / column as
// fp32 bit patterns (NaN patterns above +inf win; not canonicalized: only scales derive from them).
void axis_amax(const at::Tensor& x, const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cols) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "dtq kernels: x must be a contiguous 2-D CUDA tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();  // x's device's stream: after the guard
  uint32_t* ptr[2] = {nullptr, nullptr};
  const c10::optional<at::Tensor>* outs[2] = {&rows, &cols};
  for (int i = 0; i < 2; ++i) {
    if (!outs[i]->has_value()) continue;
    const at::Tensor& o = outs[i]->value();
    TORCH_CHECK(o.is_cuda() && o.scalar_type() == at::kInt && o.is_contiguous() && o.numel() == (i ? K : M),
                "dtq kernels: axis amax outputs are contiguous int32 [M] (rows) and [K] (columns)");
    ptr[i] = reinterpret_cast<uint32_t*>(o.data_ptr());
    C10_CUDA_CHECK(cudaMemsetAsync(ptr[i], 0, o.numel() * sizeof(uint32_t), stream));
  }
  if (x.numel() == 0 || (!ptr[0] && !ptr[1])) return;
  const int64_t tiles_k = (K + 127) / 128, tiles = ((M + 127) / 128) * tiles_k;
  TORCH_CHECK(tiles < (int64_t(1) << 31), "dtq kernels: tensor too large");
  const int vec = K % 8 == 0 && (reinterpret_cast<uintptr_t>(x.data_ptr()) & 15) == 0;
  auto go = [&](auto* p) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    axis_amax_kernel<T><<<unsigned(tiles), kThreads, 0, stream>>>(p, M, K, int(tiles_k), ptr[0], ptr[1], vec);
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(reinterpret_cast<const float*>(x.data_ptr())); break;
    case at::kBFloat16: go(reinterpret_cast<const __nv_bfloat16*>(x.data_ptr())); break;
    case at::kHalf: go(reinterpret_cast<const __half*>(x.data_ptr())); break;
    default: TORCH_CHECK(false, "dtq kernels: unsupported input dtype ", x.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out: int32[2] on x's device, zeroed here (an async memset on the stream: cheaper on the host than
// a torch.zeros launch); [0] gets max|x| (when want_x), [1] max|T x| (when signs >= 0).
void amax(const at::Tensor& x, const at::Tensor& out, bool want_x, int64_t signs) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "dtq kernels: x must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kInt && out.numel() == 2 && out.is_contiguous(),
              "dtq kernels: amax out is a contiguous int32[2]");
  const c10::cuda::CUDAGuard guard(x.device());
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr());
  C10_CUDA_CHECK(cudaMemsetAsync(o, 0, 2 * sizeof(uint32_t), c10::cuda::getCurrentCUDAStream()));
  if (x.numel() == 0) return;
  switch (x.scalar_type()) {
    case at::kFloat: launch<float>(x, o, want_x, signs); break;
    case at::kBFloat16: launch<__nv_bfloat16>(x, o, want_x, signs); break;
    case at::kHalf: launch<__half>(x, o, want_x, signs); break;
    default: TORCH_CHECK(false, "dtq kernels: unsupported input dtype ", x.scalar_type());
  }
}

// max|x| into one fp32 CUDA value (its bit pattern, as amax writes out[0]), zeroed here: the
// tensor-wide amax of one per-tensor quantization without amax's int32[2] and its views (host time
// of csrc/linear.cpp's calls).
void amax_x(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "dtq kernels: x must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.numel() == 1, "dtq kernels: amax_x out is one fp32");
  const c10::cuda::CUDAGuard guard(x.device());
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr());
  C10_CUDA_CHECK(cudaMemsetAsync(o, 0, sizeof(uint32_t), c10::cuda::getCurrentCUDAStream()));
  if (x.numel() == 0) return;
  switch (x.scalar_type()) {
    case at::kFloat: launch<float>(x, o, true, -1); break;
    case at::kBFloat16: launch<__nv_bfloat16>(x, o, true, -1); break;
    case at::kHalf: launch<__half>(x, o, true, -1); break;
    default: TORCH_CHECK(false, "dtq kernels: unsupported input dtype ", x.scalar_type());
  }
}

// y = x cast to y's dtype (bf16 or fp16; x contiguous fp32 of y's size) and max|y| into one fp32
// CUDA value (its bit pattern, zeroed here), from one read of x.
void cast_amax(const at::Tensor& x, const at::Tensor& y, const at::Tensor& out) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "dtq kernels: cast_amax reads a contiguous fp32 CUDA tensor");
  TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.numel() == x.numel() && y.device() == x.device() &&
                  (y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kHalf),
              "dtq kernels: cast_amax writes a contiguous bf16 or fp16 tensor of x's size on x's device");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.numel() == 1,
              "dtq kernels: cast_amax out is one fp32");
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr());
  C10_CUDA_CHECK(cudaMemsetAsync(o, 0, sizeof(uint32_t), stream));
  const int64_t n = x.numel();
  if (n == 0) return;
  const float* p = reinterpret_cast<const float*>(x.data_ptr());
  const int vec = n % 4 == 0 && (reinterpret_cast<uintptr_t>(p) & 15) == 0 &&
                  (reinterpret_cast<uintptr_t>(y.data_ptr()) & (4 * y.element_size() - 1)) == 0;
  const int grid = grid_for(vec ? n / 16 : n);
  if (y.scalar_type() == at::kBFloat16)
    cast_amax_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        p, reinterpret_cast<__nv_bfloat16*>(y.data_ptr()), n, o, vec);
  else
    cast_amax_kernel<__half><<<grid, kThreads, 0, stream>>>(p, reinterpret_cast<__half*>(y.data_ptr()), n, o, vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// hist: the fp32 history (at most kMaxHistory entries), updated in place. x (a contiguous 2-D CUDA
// tensor): its max|x| is the new entry; else cur (fp32, one element) is. Returns {amax, new entry}.
std::vector<at::Tensor> delayed_amax(const c10::optional<at::Tensor>& x, const c10::optional<at::Tensor>& cur,
                                     const at::Tensor& hist, int64_t skip, bool most_recent, double factor) {
  TORCH_CHECK(hist.is_cuda() && hist.scalar_type() == at::kFloat && hist.dim() == 1 && hist.is_contiguous() &&
                  hist.numel() <= kMaxHistory,
              "dtq kernels: an amax history is a contiguous fp32 CUDA vector of at most ", kMaxHistory, " entries");
  TORCH_CHECK(x.has_value() != cur.has_value(), "dtq kernels: delayed_amax takes x or cur");
  const c10::cuda::CUDAGuard guard(hist.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor buf = at::empty({2}, hist.options());  // [0]: max|x| (from x), [1]: the amax
  const float* c;
  if (x.has_value()) {
    TORCH_CHECK(x->is_cuda() && x->dim() == 2 && x->is_contiguous() && x->device() == hist.device(),
                "dtq kernels: x must be a contiguous 2-D CUDA tensor on the history's device");
    uint32_t* o = reinterpret_cast<uint32_t*>(buf.data_ptr());
    C10_CUDA_CHECK(cudaMemsetAsync(o, 0, sizeof(uint32_t), stream));
    if (x->numel() > 0) {
      switch (x->scalar_type()) {
        case at::kFloat: launch<float>(*x, o, true, -1); break;
        case at::kBFloat16: launch<__nv_bfloat16>(*x, o, true, -1); break;
        case at::kHalf: launch<__half>(*x, o, true, -1); break;
        default: TORCH_CHECK(false, "dtq kernels: unsupported input dtype ", x->scalar_type());
      }
    }
    c = buf.data_ptr<float>();
  } else {
    TORCH_CHECK(cur->is_cuda() && cur->scalar_type() == at::kFloat && cur->numel() == 1 &&
                    cur->device() == hist.device(),
                "dtq kernels: cur is one fp32 element on the history's device");
    c = cur->data_ptr<float>();
  }
  const int n = int(hist.numel());
  const int k = int(skip < 0 ? 0 : (skip > n ? n : skip));
  history_kernel<<<1, kThreads, size_t(n) * sizeof(float), stream>>>(
      hist.data_ptr<float>(), n, k, c, buf.data_ptr<float>() + 1, most_recent ? 1 : 0, float(factor));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {buf.select(0, 1), x.has_value() ? buf.select(0, 0) : cur->reshape({})};
}

}  // namespace dtq
