// FSDP2's gradient packing (``torch._chunk_cat(grads, dim=0, num_chunks=W, out)``) in one launch per
// 64 gradients: each gradient's rows split into W chunks of ceil(rows / W) rows (the last ones
// zero-padded), chunk r of every gradient side by side in row r of out [W, sum of chunk sizes].
// torch's CUDA kernel for it builds one host-side entry per 2 KiB of output and copies them to
// the device on every call (about 0.5 ms of host time for a 1.07 B decoder block); over one rank
// FSDP2's packing is one copy kernel per gradient at about 1.9 TB/s (a BF16 -> FP32 cast). Here
// the gradients are kernel arguments (pointer, size, chunk, offset, first block), each thread
// moves 16-byte loads, and a block finds its gradient by a binary search over the first blocks.
//
// Exact copies only (and no empty tensor, which torch's refuses): the same dtype (raw bits) or bf16 / fp16 widened to fp32 (exact, as torch's
// cast). Every element a thread writes is out[r, off + e] = g.flat[r * chunk + e], or 0 past
// g's end: the padded source index is simply the position p = r * chunk + e in the gradient's
// [W * chunk] range.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace dtq {
namespace {

constexpr int kThreads = 256, kUnroll = 4, kMaxEntries = 64;

struct PackEntry {
  const void* src;
  int64_t numel;        // the gradient's elements
  int64_t chunk;        // elements of one chunk: ceil(rows / W) * (numel / rows)
  int64_t off;          // its column offset in each row of out
  int64_t first_block;  // its first block in the launch's grid
  int64_t vec;          // 1: 16-byte vectors (sizes and pointers aligned), else one element per thread
};

struct PackArgs {
  PackEntry e[kMaxEntries];
  int n;
};

template <typename Tin, typename Tout>
__device__ __forceinline__ Tout widen(Tin v) {
  if constexpr (std::is_same_v<Tin, Tout>) {
    return v;
  } else if constexpr (std::is_same_v<Tin, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kThreads) chunk_cat_kernel(const __grid_constant__ PackArgs args, Tout* __restrict__ out,
                                                             int64_t row, int64_t chunks) {
  int lo = 0, hi = args.n - 1;  // the last entry whose first block is <= this block
  const int64_t b = blockIdx.x;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (args.e[mid].first_block <= b) lo = mid; else hi = mid - 1;
  }
  const PackEntry& g = args.e[lo];
  const Tin* src = static_cast<const Tin*>(g.src);
  const int64_t span = chunks * g.chunk, local = b - g.first_block;
  if (g.vec) {
    constexpr int V = 16 / sizeof(Tin);
    struct alignas(16) In { Tin v[V]; };
    struct alignas(16) Out { Tout v[V]; };
    In v[kUnroll];
    int64_t p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // (loads first, then stores: four 16-byte loads in flight)
      p[u] = ((local * kUnroll + u) * kThreads + threadIdx.x) * V;
      if (p[u] < g.numel) {
        v[u] = *reinterpret_cast<const In*>(src + p[u]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) v[u].v[i] = Tin{};
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (p[u] >= span) break;
      const int64_t r = p[u] / g.chunk;
      Out o;
#pragma unroll
      for (int i = 0; i < V; ++i) o.v[i] = widen<Tin, Tout>(v[u].v[i]);
      *reinterpret_cast<Out*>(out + r * row + g.off + (p[u] - r * g.chunk)) = o;
    }
  } else {
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = (local * kUnroll + u) * kThreads + threadIdx.x;
      if (p >= span) break;
      const int64_t r = p / g.chunk;
      out[r * row + g.off + (p - r * g.chunk)] = p < g.numel ? widen<Tin, Tout>(src[p]) : Tout{};
    }
  }
}

template <typename Tin, typename Tout>
void launch(const std::vector<PackEntry>& entries, const at::Tensor& out, int64_t row, int64_t chunks) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  Tout* o = reinterpret_cast<Tout*>(out.data_ptr());
  for (size_t start = 0; start < entries.size(); start += kMaxEntries) {
    PackArgs args{};
    args.n = int(std::min<size_t>(kMaxEntries, entries.size() - start));
    int64_t blocks = 0;
    for (int i = 0; i < args.n; ++i) {
      PackEntry e = entries[start + i];
      const int64_t per_block = int64_t(kThreads) * kUnroll * (e.vec ? 16 / int64_t(sizeof(Tin)) : 1);
      e.first_block = blocks;
      blocks += (chunks * e.chunk + per_block - 1) / per_block;
      args.e[i] = e;
    }
    if (blocks == 0) continue;
    TORCH_CHECK(blocks <= INT32_MAX, "dtq kernels: chunk_cat grid too large (", blocks, " blocks)");
    chunk_cat_kernel<Tin, Tout><<<unsigned(blocks), kThreads, 0, stream>>>(args, o, row, chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

// False (nothing written) where this kernel does not take the call: then the caller runs torch's.
bool chunk_cat(const std::vector<at::Tensor>& tensors, const at::Tensor& out, int64_t chunks) {
  if (tensors.empty() || chunks < 1 || !out.is_cuda() || !out.is_contiguous()) return false;
  const auto in_t = tensors[0].scalar_type(), out_t = out.scalar_type();
  const bool same = in_t == out_t && (in_t == at::kFloat || in_t == at::kBFloat16 || in_t == at::kHalf);
  const bool widen = out_t == at::kFloat && (in_t == at::kBFloat16 || in_t == at::kHalf);
  if (!same && !widen) return false;
  const int64_t in_size = tensors[0].element_size(), V = 16 / in_size;
  std::vector<PackEntry> entries;
  entries.reserve(tensors.size());
  int64_t row = 0;
  for (const auto& t : tensors) {
    if (t.scalar_type() != in_t || t.device() != out.device() || !t.is_contiguous() || t.dim() == 0 || t.numel() == 0)
      return false;  // (torch's refuses empty tensors: its error, not ours)
    const int64_t rows = t.size(0), numel = t.numel();
    const int64_t per_row = numel / rows;
    const int64_t chunk = (rows + chunks - 1) / chunks * per_row;
    const bool vec = aligned16(t.data_ptr()) && numel % V == 0 && chunk % V == 0 && row % V == 0;
    entries.push_back(PackEntry{t.data_ptr(), numel, chunk, row, 0, vec ? 1 : 0});
    row += chunk;
  }
  if (out.numel() != chunks * row) return false;
  if (!aligned16(out.data_ptr()) || (chunks > 1 && row % V != 0))
    for (auto& e : entries) e.vec = 0;
  const c10::cuda::CUDAGuard guard(out.device());
  if (same && in_t == at::kFloat)
    launch<float, float>(entries, out, row, chunks);
  else if (same && in_t == at::kBFloat16)
    launch<__nv_bfloat16, __nv_bfloat16>(entries, out, row, chunks);
  else if (same)
    launch<__half, __half>(entries, out, row, chunks);
  else if (in_t == at::kBFloat16)
    launch<__nv_bfloat16, float>(entries, out, row, chunks);
  else
    launch<__half, float>(entries, out, row, chunks);
  return true;
}

}  // namespace dtq
