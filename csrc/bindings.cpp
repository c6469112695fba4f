// pybind11 entry points of the dtq CUDA extension (built by dtq/kernels.py).
#include <torch/extension.h>

namespace dtq {
bool quantize_fused(const at::Tensor& x, const std::vector<int64_t>& cfg_a, const std::vector<at::Tensor>& outs_a,
                    const c10::optional<at::Tensor>& amax_a, const std::vector<int64_t>& cfg_b,
                    const std::vector<at::Tensor>& outs_b, const c10::optional<at::Tensor>& amax_b,
                    const c10::optional<at::Tensor>& seed);
void amax(const at::Tensor& x, const at::Tensor& out, bool want_x, int64_t signs);
void axis_amax(const at::Tensor& x, const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cols);
void dequantize(const at::Tensor& data, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& tensor,
                const std::vector<int64_t>& cfg, const at::Tensor& out);
void transpose_u8(const at::Tensor& in, const at::Tensor& out);
void swiglu_forward(const at::Tensor& x, const at::Tensor& h, int64_t block, const c10::optional<at::Tensor>& amax);
void swiglu_backward(const at::Tensor& dh, const at::Tensor& x, const at::Tensor& dx, int64_t block,
                     const c10::optional<at::Tensor>& amax);
void scale_cast(const at::Tensor& src, const c10::optional<at::Tensor>& fa, const c10::optional<at::Tensor>& fb,
                const at::Tensor& dst);
std::vector<at::Tensor> quantize_alloc(const at::Tensor& x, const std::vector<int64_t>& cfg_a,
                                       const std::vector<int64_t>& fields_a, const c10::optional<at::Tensor>& amax_a,
                                       int64_t mode_a, const std::vector<int64_t>& cfg_b,
                                       const std::vector<int64_t>& fields_b, const c10::optional<at::Tensor>& amax_b,
                                       int64_t mode_b, int64_t signs, const c10::optional<at::Tensor>& seed);
at::Tensor transposed_u8(const at::Tensor& in);
}  // namespace dtq

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_fused", &dtq::quantize_fused,
        "Up to two direction payloads of a [M, K] tensor from one read (slot configs: see csrc/common.cuh); false: "
        "nothing launched, run the reference");
  m.def("amax", &dtq::amax, "Tensor-wide max|x| and/or max|T x| (16-row Hadamard) into int32[2] bit patterns");
  m.def("axis_amax", &dtq::axis_amax, "max|x| of every row and/or every column into int32 bit patterns");
  m.def("dequantize", &dtq::dequantize, "One direction payload back to [M, K] values");
  m.def("transpose_u8", &dtq::transpose_u8, "Contiguous [K, M] copy of a 1-byte [M, K] matrix");
  m.def("swiglu_forward", &dtq::swiglu_forward, "silu(gate) * up of a [T, 2F] gate/up tensor into [T, F] (and max|h| bits)");
  m.def("swiglu_backward", &dtq::swiglu_backward, "Gradient of the [T, 2F] gate/up tensor from dh and the input (and its max|.| bits)");
  m.def("quantize_alloc", &dtq::quantize_alloc,
        "amax pass, payload allocation and fused quantize of up to two directions in one call");
  m.def("transposed_u8", &dtq::transposed_u8, "Contiguous [K, M] copy of a 1-byte [M, K] matrix, allocated");
  m.def("scale_cast", &dtq::scale_cast, "((out * fa) * fb).to(dtype) of an fp32 GEMM output in one pass");
}
