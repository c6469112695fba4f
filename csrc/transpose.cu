// Contiguous transpose of a 1-byte [M, K] matrix into [K, M]: the FP8 code layouts cuBLAS's
// scaled GEMMs want (A row-major, B column-major) from payloads stored in logical [M, K]
// orientation (dgrad's weight, wgrad's dy and x). torch's generic strided copy moves one byte per
// thread and is several times slower than this.
//
// One CTA of 256 threads per 128 x 128 tile. Phase 1: each thread loads 16 columns of 4 rows (four
// 16-byte loads, issued before use; 8 lanes cover a 128-byte row segment), transposes the four
// 4 x 4 byte blocks in registers with __byte_perm and writes 16 column words into a swizzled
// [128 cols][32 words] shared tile. Phase 2: each output row of the tile (128 bytes) is read as
// 16-byte shared vectors and written as 8 x 16-byte stores.
// Needs M % 16 == 0, K % 16 == 0 and 16-byte aligned pointers (the caller falls back otherwise).

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace dtq {
namespace {

constexpr int kTile = 128, kThreads = 256, kWords = kTile / 4;

// Word w of column c lives at tile[c * kWords + (w ^ swz(c))]: the XOR spreads the 8 column
// groups a warp writes at once over all banks and keeps each 4-word group 16-byte aligned.
__device__ __forceinline__ int swz(int c) { return (c >> 4) << 2; }

__global__ void __launch_bounds__(kThreads) transpose_u8_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out,
                                                                int64_t M, int64_t K) {
  __shared__ __align__(16) uint32_t tile[kTile * kWords];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = int64_t(blockIdx.x) * kTile, col0 = int64_t(blockIdx.y) * kTile;
  const int br = warp * 4 + (lane >> 3);  // tile rows 4br..4br+3
  const int cq = lane & 7;                // tile columns 16cq..16cq+15
  const int64_t r = row0 + 4 * br, c = col0 + 16 * cq;
  uint4 v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = make_uint4(0, 0, 0, 0);
    if (r < M && c < K)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w)
                   : "l"(in + (r + i) * K + c));
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // the 4 x 4 block of tile columns 16cq + 4j .. + 3
    const uint32_t w0 = (&v[0].x)[j], w1 = (&v[1].x)[j], w2 = (&v[2].x)[j], w3 = (&v[3].x)[j];
    const uint32_t t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w0, w1, 0x7362);
    const uint32_t t2 = __byte_perm(w2, w3, 0x5140), t3 = __byte_perm(w2, w3, 0x7362);
    const uint32_t cols[4] = {__byte_perm(t0, t2, 0x5410), __byte_perm(t0, t2, 0x7632), __byte_perm(t1, t3, 0x5410),
                              __byte_perm(t1, t3, 0x7632)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 16 * cq + 4 * j + i;
      tile[col * kWords + (br ^ swz(col))] = cols[i];
    }
  }
  __syncthreads();
  const int q = lane & 7;  // 16-byte chunk of an output row: tile rows 16q..16q+15
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int oc = pass * 32 + warp * 4 + (lane >> 3);  // tile column = output row
    const int64_t orow = col0 + oc, ocol = row0 + 16 * q;
    if (orow < K && ocol < M)
      *reinterpret_cast<uint4*>(out + orow * M + ocol) =
          *reinterpret_cast<const uint4*>(tile + oc * kWords + ((4 * q) ^ swz(oc)));
  }
}

}  // namespace

void transpose_u8(const at::Tensor& in, const at::Tensor& out) {
  TORCH_CHECK(in.is_cuda() && in.dim() == 2 && in.is_contiguous() && in.element_size() == 1,
              "dtq kernels: transpose input must be a contiguous 1-byte [M, K] CUDA tensor");
  const int64_t M = in.size(0), K = in.size(1);
  TORCH_CHECK(out.is_cuda() && out.dim() == 2 && out.is_contiguous() && out.element_size() == 1 && out.size(0) == K &&
                  out.size(1) == M,
              "dtq kernels: transpose output must be a contiguous 1-byte [K, M] CUDA tensor");
  TORCH_CHECK(M % 16 == 0 && K % 16 == 0, "dtq kernels: transpose needs M and K multiples of 16, got ", M, " x ", K);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(in.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "dtq kernels: transpose needs 16-byte aligned tensors");
  if (in.numel() == 0) return;
  TORCH_CHECK((M + kTile - 1) / kTile <= INT32_MAX && (K + kTile - 1) / kTile <= 65535,
              "dtq kernels: transpose grid too large for ", M, " x ", K);
  const c10::cuda::CUDAGuard guard(in.device());
  const dim3 grid(unsigned((M + kTile - 1) / kTile), unsigned((K + kTile - 1) / kTile));
  transpose_u8_kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint8_t*>(in.data_ptr()), reinterpret_cast<uint8_t*>(out.data_ptr()), M, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dtq
