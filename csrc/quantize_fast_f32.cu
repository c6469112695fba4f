// Specialised fused-quantize kernels (quantize_tile.cuh) for float inputs; one file per input dtype
// so that the extension build compiles them in parallel.
#include "quantize_tile.cuh"

namespace dtq {
namespace fast {
template bool launch<float>(const at::Tensor& x, const SlotCfg& a, const SlotCfg& b);
}  // namespace fast
}  // namespace dtq
