// pybind11 entry points of the dtq CUDA extension (built by dtq/kernels.py).
#include <torch/extension.h>

#include "entry_points.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_fused", &dtq::quantize_fused,
        "Up to two direction payloads of a [M, K] tensor from one read (slot configs: see csrc/common.cuh); false: "
        "nothing launched, run the reference");
  m.def("amax", &dtq::amax, "Tensor-wide max|x| and/or max|T x| (16-row Hadamard) into int32[2] bit patterns");
  m.def("cast_amax", &dtq::cast_amax, "y = x cast to y's dtype and max|y| as one fp32, from one read of x");
  m.def("axis_amax", &dtq::axis_amax, "max|x| of every row and/or every column into int32 bit patterns");
  m.def("delayed_amax", &dtq::delayed_amax,
        "Delayed scaling's amax from an fp32 history, which then shifts and takes max|x| (or cur) as its newest entry");
  m.def("dequantize", &dtq::dequantize, "One direction payload back to [M, K] values");
  m.def("transpose_u8", &dtq::transpose_u8, "Contiguous [K, M] copy of a 1-byte [M, K] matrix");
  m.def("swiglu_forward", &dtq::swiglu_forward, "silu(gate) * up of a [T, 2F] gate/up tensor into [T, F] (and max|h| bits)");
  m.def("swiglu_backward", &dtq::swiglu_backward, "Gradient of the [T, 2F] gate/up tensor from dh and the input (and its max|.| bits)");
  m.def("quantize_alloc", &dtq::quantize_alloc,
        "amax pass, payload allocation and fused quantize of up to two directions in one call");
  m.def("transposed_u8", &dtq::transposed_u8, "Contiguous [K, M] copy of a 1-byte [M, K] matrix, allocated");
  m.def("chunk_cat", &dtq::chunk_cat,
        "torch._chunk_cat(tensors, 0, chunks, out) in one launch per 64 tensors (exact copies); false: not taken");
  m.def("scale_cast", &dtq::scale_cast, "((out * fa) * fb).to(dtype) of an fp32 GEMM output in one pass");
  m.def("inverse_scale", &dtq::inverse_scale, "1 / min(fmax / amax, FLT_MAX) per amax (1 where amax is not finite and > 0)");
  m.def("register_linear", &dtq::register_linear,
        "Id of a planned FP8 per-tensor GEMM call described as dtq/nn/linear_native.py writes it");
  m.def("native_linear", &dtq::native_linear,
        "y of a registered planned call, its forward and backward one C++ autograd function (linear.cpp)");
  m.def("native_quantize", &dtq::native_quantize,
        "x, the weight or dy quantized by one launch of a registered planned call (the compiled path's ops)");
}
