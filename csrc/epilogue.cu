// Epilogue of the emulated GEMMs (dtq/gemm.py): ``((out * fa) * fb).to(dtype)`` in one pass, the
// per-tensor factors of the two operands (0-dim fp32 CUDA tensors, either absent) applied to the
// fp32 GEMM output in that order, each product rounded once, then the RNE cast (torch's own on
// CUDA). Eager torch needs three passes over the fp32 output for this (two multiplies, a cast),
// which cost an NVFP4 layer more than its dequantization. Four elements per thread (16-byte loads)
// when the pointers allow, else one. An fp32 result may overwrite the input in place.
// Also the factor itself for formats that scale by ``fmax / amax`` (NVFP4's S_enc): its inverse
// from the stored amaxes in one launch instead of torch's seven small ones per operand.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common.cuh"

namespace dtq {
namespace {

constexpr int kThreads = 256;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) scale_cast_kernel(const float* src, T* dst,  // may be one buffer (fp32)
                                                              const float* __restrict__ fa,
                                                              const float* __restrict__ fb, int64_t n) {
  const float a = fa ? *fa : 1.0f, b = fb ? *fb : 1.0f;
  const int64_t packs = n / V;
  for (int64_t p = int64_t(blockIdx.x) * kThreads + threadIdx.x; p < packs; p += int64_t(gridDim.x) * kThreads) {
    const Pack<float, V> in = *reinterpret_cast<const Pack<float, V>*>(src + p * V);
    Pack<T, V> out;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float v = in.v[i];
      if (fa) v = __fmul_rn(v, a);
      if (fb) v = __fmul_rn(v, b);
      from_f32(&out.v[i], v);
    }
    *reinterpret_cast<Pack<T, V>*>(dst + p * V) = out;
  }
}

const float* factor_ptr(const c10::optional<at::Tensor>& f, const at::Tensor& src, const char* name) {
  if (!f.has_value()) return nullptr;
  TORCH_CHECK(f->is_cuda() && f->device() == src.device() && f->scalar_type() == at::kFloat && f->numel() == 1,
              "dtq scale_cast: factor ", name, " must be a one-element fp32 tensor on ", src.device(), ", got ",
              f->scalar_type(), " with ", f->numel(), " elements on ", f->device());
  return f->data_ptr<float>();
}

// 1 / scale_from_amax(amax): dtq._bits.per_tensor_scale then torch.reciprocal, each step one
// correctly rounded fp32 operation as torch's CUDA kernels compute it.
__global__ void inverse_scale_kernel(const float* __restrict__ amax, float* __restrict__ out, int64_t n, float fmax) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    out[i] = __fdiv_rn(1.f, scale_from_amax(amax[i], fmax, false));
}

}  // namespace

void inverse_scale(const at::Tensor& amax, const at::Tensor& out, double fmax) {
  TORCH_CHECK(amax.is_cuda() && amax.is_contiguous() && amax.scalar_type() == at::kFloat,
              "dtq inverse_scale: the amaxes must be a contiguous fp32 CUDA tensor, got ", amax.scalar_type(),
              amax.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                  out.numel() == amax.numel() && out.device() == amax.device(),
              "dtq inverse_scale: the result must be a contiguous fp32 tensor of ", amax.numel(), " elements on ",
              amax.device());
  const int64_t n = amax.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(amax.device());
  const int blocks = int(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(1) << 16));
  inverse_scale_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      amax.data_ptr<float>(), out.data_ptr<float>(), n, float(fmax));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scale_cast(const at::Tensor& src, const c10::optional<at::Tensor>& fa, const c10::optional<at::Tensor>& fb,
                const at::Tensor& dst) {
  TORCH_CHECK(src.is_cuda() && src.is_contiguous() && src.scalar_type() == at::kFloat,
              "dtq scale_cast: the GEMM output must be a contiguous fp32 CUDA tensor, got ", src.scalar_type(),
              src.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(dst.is_cuda() && dst.is_contiguous() && dst.numel() == src.numel() && dst.device() == src.device(),
              "dtq scale_cast: the result must be a contiguous CUDA tensor of ", src.numel(), " elements on ",
              src.device());
  const float* a = factor_ptr(fa, src, "a");
  const float* b = factor_ptr(fb, src, "b");
  const int64_t n = src.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const float* s = src.data_ptr<float>();
    T* d = reinterpret_cast<T*>(dst.data_ptr());
    const bool vec = n % 4 == 0 && reinterpret_cast<uintptr_t>(s) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(d) % (4 * sizeof(T)) == 0;
    const int64_t packs = vec ? n / 4 : n;
    const int blocks = int(std::min<int64_t>((packs + kThreads - 1) / kThreads, int64_t(1) << 20));
    if (vec)
      scale_cast_kernel<T, 4><<<blocks, kThreads, 0, stream>>>(s, d, a, b, n);
    else
      scale_cast_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(s, d, a, b, n);
  };
  switch (dst.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(__nv_bfloat16{}); break;
    case at::kHalf: run(__half{}); break;
    default: TORCH_CHECK(false, "dtq scale_cast: result dtype ", dst.scalar_type(), " is not float32, bfloat16 or float16");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dtq
