// CUDA kernels of dtq's torch.library ops (defined in Python, dtq/kernels and dtq/nn/functional
// through dtq/_library.py, with a Python kernel for every device), registered when this library
// loads: for CUDA tensors the dispatcher then picks these. A compiled step calls some ops about a
// hundred times; through a Python kernel each call costs tens of microseconds of host time on the
// GPU machines, through this one the dispatcher's C++ call alone. Where dtq's kernel does not
// apply (DTQ_DISABLE_KERNELS, a GPU older than sm_90, another dtype) an op runs what its Python
// kernel runs: torch's copy for transposed_codes, the Python kernel itself for SwiGLU (redispatched
// to the CPU key, which its CompositeExplicitAutograd registration fills).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

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

// The device is sm_90 or later (the library is built for sm_90; a host may hold older GPUs too).
bool capable(const at::Device& device) { return sm90_or_later(device.index() < 0 ? 0 : device.index()); }

// dtq's kernels run on these tensors: sm_90+, not disabled, an input dtype the kernels take, all
// on one device in one dtype (dtq/nn/functional _use_kernel).
bool kernel_applies(const std::vector<const at::Tensor*>& ts) {
  const at::Tensor& x = *ts[0];
  const auto dt = x.scalar_type();
  if (!(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf)) return false;
  for (const at::Tensor* t : ts) {
    if (t->device() != x.device() || t->scalar_type() != dt) return false;
  }
  return !kernels_disabled() && capable(x.device());
}

// dtq::transposed_codes (dtq/kernels transposed): a fresh contiguous [K, M] copy of 2-D codes;
// 1-byte codes with both dims multiples of 16 and 16-byte aligned take the tiled kernel.
at::Tensor transposed_codes(const at::Tensor& x) {
  const at::Tensor c = x.contiguous();
  if (c.dim() == 2 && c.element_size() == 1 && c.size(0) % 16 == 0 && c.size(1) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 && !kernels_disabled() && capable(c.device())) {
    return transposed_u8(c);
  }
  at::Tensor out = c.t().contiguous();
  // a [1, K] or [K, 1] tensor transposes to a view of itself; an op's output must be fresh
  return out.is_alias_of(x) ? out.clone() : out;
}

// The op's Python kernel (where dtq's kernel does not apply): its CompositeExplicitAutograd
// registration fills the CPU key, and it takes tensors of any device. (Each caller keeps its own
// handle: one static per signature would mix up two ops of one signature.)
template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
const c10::DispatchKeySet kPythonKernel(c10::DispatchKey::CPU);

std::vector<int64_t> with_last(const at::Tensor& t, int64_t last) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() = last;
  return shape;
}

// max|.| as the kernels write it (an int32 holding fp32 bits) into a fresh 0-dim fp32 tensor
at::Tensor amax_out(const at::Tensor& like) { return at::empty({}, like.options().dtype(at::kFloat)); }
at::Tensor int_view(const at::Tensor& amax) { return amax.view(at::kInt).view({1}); }

// dtq::swiglu_fw / swiglu_amax_fw (dtq/nn/functional _swiglu_impl / _swiglu_amax_impl): h of
// x [..., 2F] as [..., F], and max|h|
std::vector<at::Tensor> swiglu_h(const at::Tensor& x, int64_t block, bool want_amax) {
  const at::Tensor x2 = x.contiguous().view({-1, x.size(-1)});
  at::Tensor h = at::empty(with_last(x, x.size(-1) / 2), x.options());
  at::Tensor amax = want_amax ? amax_out(x) : at::Tensor();
  swiglu_forward(x2, h.view({x2.size(0), x2.size(1) / 2}), block,
                 want_amax ? c10::optional<at::Tensor>(int_view(amax)) : c10::nullopt);
  return want_amax ? std::vector<at::Tensor>{h, amax} : std::vector<at::Tensor>{h};
}

at::Tensor swiglu_fw(const at::Tensor& x, int64_t block) {
  if (!kernel_applies({&x})) {
    static const auto op = typed_op<at::Tensor(const at::Tensor&, int64_t)>("dtq::swiglu_fw");
    return op.redispatch(kPythonKernel, x, block);
  }
  return swiglu_h(x, block, false)[0];
}

std::vector<at::Tensor> swiglu_amax_fw(const at::Tensor& x, int64_t block) {
  if (!kernel_applies({&x})) {
    static const auto op = typed_op<std::vector<at::Tensor>(const at::Tensor&, int64_t)>("dtq::swiglu_amax_fw");
    return op.redispatch(kPythonKernel, x, block);
  }
  return swiglu_h(x, block, true);
}

// dtq::swiglu_backward / swiglu_backward_amax: dx [..., 2F] from dh [..., F], and max|dx|
std::vector<at::Tensor> swiglu_dx(const at::Tensor& dh, const at::Tensor& x, int64_t block, bool want_amax) {
  const at::Tensor x2 = x.contiguous().view({-1, x.size(-1)});
  const at::Tensor dh2 = dh.contiguous().view({-1, dh.size(-1)});
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor amax = want_amax ? amax_out(x) : at::Tensor();
  swiglu_backward(dh2, x2, dx.view(x2.sizes()), block,
                  want_amax ? c10::optional<at::Tensor>(int_view(amax)) : c10::nullopt);
  return want_amax ? std::vector<at::Tensor>{dx, amax} : std::vector<at::Tensor>{dx};
}

at::Tensor swiglu_backward_op(const at::Tensor& dh, const at::Tensor& x, int64_t block) {
  if (!kernel_applies({&x, &dh})) {
    static const auto op = typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("dtq::swiglu_backward");
    return op.redispatch(kPythonKernel, dh, x, block);
  }
  return swiglu_dx(dh, x, block, false)[0];
}

std::vector<at::Tensor> swiglu_backward_amax_op(const at::Tensor& dh, const at::Tensor& x, int64_t block) {
  if (!kernel_applies({&x, &dh})) {
    static const auto op =
        typed_op<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t)>("dtq::swiglu_backward_amax");
    return op.redispatch(kPythonKernel, dh, x, block);
  }
  return swiglu_dx(dh, x, block, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(dtq, CUDA, m) {
  m.impl("transposed_codes", &transposed_codes);
  m.impl("swiglu_fw", &swiglu_fw);
  m.impl("swiglu_amax_fw", &swiglu_amax_fw);
  m.impl("swiglu_backward", &swiglu_backward_op);
  m.impl("swiglu_backward_amax", &swiglu_backward_amax_op);
}

}  // namespace dtq
