// Host-side entry that runs one whole quantization in a single call from Python: the amax pass a
// direction needs (tensor-wide max|x| or max|T x|, or FP8 row-wise's per-row / per-column amaxes),
// the payload allocations, and the fused quantize kernel. The Python side (dtq/kernels.py
// QuantizeLaunch) describes the outputs once per (quantizer, shape); each call then costs one
// pybind crossing instead of several torch.empty calls and kernel wrappers (host time is the
// bottleneck of small GEMMs).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "entry_points.h"

namespace dtq {
namespace {

// Mirrors dtq/kernels.py _FIELD_DTYPES.
at::ScalarType field_dtype(int64_t code) {
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kBFloat16;
    case 2: return at::kHalf;
    case 3: return at::kByte;
    case 4: return at::kFloat8_e4m3fn;
    case 5: return at::kFloat8_e5m2;
    case 6: return at::kInt;
    default: TORCH_CHECK(false, "dtq kernels: unknown payload field dtype code ", code);
  }
}

// fields: for each output tensor, ndim, the dims, then the dtype code.
std::vector<at::Tensor> allocate(const std::vector<int64_t>& fields, const at::TensorOptions& base) {
  std::vector<at::Tensor> out;
  size_t i = 0;
  while (i < fields.size()) {
    const int64_t ndim = fields[i++];
    TORCH_CHECK(ndim >= 0 && i + size_t(ndim) < fields.size(), "dtq kernels: malformed payload field list");
    std::vector<int64_t> shape(fields.begin() + i, fields.begin() + i + ndim);
    i += ndim;
    out.push_back(at::empty(shape, base.dtype(field_dtype(fields[i++]))));
  }
  return out;
}

// Amax modes of one direction (mirrors dtq/kernels.py): the given tensor (or none needed), the
// tensor-wide max|x|, max|T x| under the 16-row Hadamard, or one amax per row / per column.
enum AmaxMode : int64_t { kGiven = 0, kX = 1, kHadamard = 2, kRows = 3, kCols = 4 };

}  // namespace

// Returns the output tensors of slot a, then those of slot b, in their field order; none where
// quantize_fused launched nothing (the generic kernel lacks an option: the caller runs the reference).
std::vector<at::Tensor> quantize_alloc(const at::Tensor& x, const std::vector<int64_t>& cfg_a,
                                       const std::vector<int64_t>& fields_a, const c10::optional<at::Tensor>& amax_a,
                                       int64_t mode_a, const std::vector<int64_t>& cfg_b,
                                       const std::vector<int64_t>& fields_b, const c10::optional<at::Tensor>& amax_b,
                                       int64_t mode_b, int64_t signs, const c10::optional<at::Tensor>& seed) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "dtq kernels: x must be a contiguous 2-D CUDA tensor");
  const auto base = x.options();
  c10::optional<at::Tensor> am[2] = {amax_a, amax_b};
  const int64_t modes[2] = {mode_a, mode_b};
  const bool want_x = mode_a == kX || mode_b == kX, want_h = mode_a == kHadamard || mode_b == kHadamard;
  if (want_x || want_h) {
    at::Tensor buf = at::empty({2}, base.dtype(at::kInt));
    amax(x, buf, want_x, want_h ? signs : -1);
    at::Tensor f = buf.view(at::kFloat);
    for (int s = 0; s < 2; ++s) {
      if (modes[s] == kX) am[s] = f.select(0, 0);
      if (modes[s] == kHadamard) am[s] = f.select(0, 1);
    }
  }
  const bool rows = mode_a == kRows || mode_b == kRows, cols = mode_a == kCols || mode_b == kCols;
  if (rows || cols) {
    c10::optional<at::Tensor> r, c;
    if (rows) r = at::empty({x.size(0)}, base.dtype(at::kInt));
    if (cols) c = at::empty({x.size(1)}, base.dtype(at::kInt));
    axis_amax(x, r, c);
    for (int s = 0; s < 2; ++s) {
      if (modes[s] == kRows) am[s] = r->view(at::kFloat);
      if (modes[s] == kCols) am[s] = c->view(at::kFloat);
    }
  }
  std::vector<at::Tensor> outs_a = allocate(fields_a, base), outs_b = allocate(fields_b, base);
  if (!quantize_fused(x, cfg_a, outs_a, am[0], cfg_b, outs_b, am[1], seed)) return {};
  outs_a.insert(outs_a.end(), outs_b.begin(), outs_b.end());
  return outs_a;
}

// Contiguous [K, M] copy of a 1-byte [M, K] CUDA matrix (csrc/transpose.cu), allocated here.
void transpose_u8(const at::Tensor& in, const at::Tensor& out);

at::Tensor transposed_u8(const at::Tensor& in) {
  at::Tensor out = at::empty({in.size(1), in.size(0)}, in.options());
  transpose_u8(in.view(at::kByte), out.view(at::kByte));
  return out;
}

}  // namespace dtq
