// CUDA kernels of dtq's torch.library ops (defined in Python, dtq/kernels through dtq/_library.py,
// with a Python kernel for every device), registered when this library loads: for CUDA tensors
// the dispatcher then picks these. A compiled step calls some ops about a hundred times; through
// a Python kernel each call costs tens of microseconds of host time on the GPU machines, through
// this one the dispatcher's C++ call alone. No compute-capability check: the library is built for
// sm_90 and loaded once a device is sm_90 or later, so a host that also has older GPUs would reach
// the sm_90 kernel from a graph compiled for one of those (not supported).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "entry_points.h"

namespace dtq {
namespace {

// DTQ_DISABLE_KERNELS as dtq/kernels disabled() reads it: anything but "", "0", "false", "no"
// (stripped, any case) turns the kernels off.
bool kernels_disabled() {
  const char* v = std::getenv("DTQ_DISABLE_KERNELS");
  if (v == nullptr) return false;
  std::string s(v);
  const auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  s.erase(s.begin(), std::find_if_not(s.begin(), s.end(), space));
  s.erase(std::find_if_not(s.rbegin(), s.rend(), space).base(), s.end());
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return !(s.empty() || s == "0" || s == "false" || s == "no");
}

// dtq::transposed_codes (dtq/kernels transposed): a fresh contiguous [K, M] copy of 2-D codes;
// 1-byte codes with both dims multiples of 16 and 16-byte aligned take the tiled kernel.
at::Tensor transposed_codes(const at::Tensor& x) {
  const at::Tensor c = x.contiguous();
  if (c.dim() == 2 && c.element_size() == 1 && c.size(0) % 16 == 0 && c.size(1) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 && !kernels_disabled()) {
    return transposed_u8(c);
  }
  at::Tensor out = c.t().contiguous();
  // a [1, K] or [K, 1] tensor transposes to a view of itself; an op's output must be fresh
  return out.is_alias_of(x) ? out.clone() : out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dtq, CUDA, m) { m.impl("transposed_codes", &transposed_codes); }

}  // namespace dtq
