// Host entry points of the dtq CUDA extension, defined in the .cu / .cpp files of csrc/ and bound
// to Python by bindings.cpp (quantize_alloc.cpp calls some of them too).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace dtq {
bool quantize_fused(const at::Tensor& x, const std::vector<int64_t>& cfg_a, const std::vector<at::Tensor>& outs_a,
                    const c10::optional<at::Tensor>& amax_a, const std::vector<int64_t>& cfg_b,
                    const std::vector<at::Tensor>& outs_b, const c10::optional<at::Tensor>& amax_b,
                    const c10::optional<at::Tensor>& seed);
void amax(const at::Tensor& x, const at::Tensor& out, bool want_x, int64_t signs);
void amax_x(const at::Tensor& x, const at::Tensor& out);
void cast_amax(const at::Tensor& x, const at::Tensor& y, const at::Tensor& out);
std::vector<at::Tensor> delayed_amax(const c10::optional<at::Tensor>& x, const c10::optional<at::Tensor>& cur,
                                     const at::Tensor& hist, int64_t skip, bool most_recent, double factor);
void axis_amax(const at::Tensor& x, const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cols);
void dequantize(const at::Tensor& data, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& tensor,
                const std::vector<int64_t>& cfg, const at::Tensor& out);
void transpose_u8(const at::Tensor& in, const at::Tensor& out);
void swiglu_forward(const at::Tensor& x, const at::Tensor& h, int64_t block, const c10::optional<at::Tensor>& amax);
void swiglu_backward(const at::Tensor& dh, const at::Tensor& x, const at::Tensor& dx, int64_t block,
                     const c10::optional<at::Tensor>& amax);
void inverse_scale(const at::Tensor& amax, const at::Tensor& out, double fmax);
void scale_cast(const at::Tensor& src, const c10::optional<at::Tensor>& fa, const c10::optional<at::Tensor>& fb,
                const at::Tensor& dst);
std::vector<at::Tensor> quantize_alloc(const at::Tensor& x, const std::vector<int64_t>& cfg_a,
                                       const std::vector<int64_t>& fields_a, const c10::optional<at::Tensor>& amax_a,
                                       int64_t mode_a, const std::vector<int64_t>& cfg_b,
                                       const std::vector<int64_t>& fields_b, const c10::optional<at::Tensor>& amax_b,
                                       int64_t mode_b, int64_t signs, const c10::optional<at::Tensor>& seed);
at::Tensor transposed_u8(const at::Tensor& in);
bool chunk_cat(const std::vector<at::Tensor>& tensors, const at::Tensor& out, int64_t chunks);
bool sm90_or_later(int device);
int64_t register_linear(const std::vector<int64_t>& description);
at::Tensor native_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_data,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& x_amax, int64_t id);
std::vector<at::Tensor> native_quantize(const at::Tensor& t, const c10::optional<at::Tensor>& known, int64_t id,
                                        int64_t which);
}  // namespace dtq
