// The eager step of a planned FP8 per-tensor GEMM call (dtq/nn/linear_native.py) as one C++
// autograd function: the quantize launches of x, the weight and dy, the three torch._scaled_mm
// and the backward node without Python. A Python autograd.Function's backward runs on autograd's
// worker thread, which must take the GIL: at small GEMMs that, and the Python around each launch,
// is most of a step's host time (docs/benchmarks.md, "the floor under the 2x target").
//
// What a call runs is LinearPlan.forward / backward's own sequence (dtq/nn/linear_plan.py) for
// the plans linear_native.py admits: the same quantize_alloc launches with the same configs, the
// same _scaled_mm calls on the same payload tensors, the same bias add and casts, so the same bits
// (tests/kernels/test_native_linear.py compares them on a GPU). Python describes a plan once
// (register_linear) and calls it by id.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/_unsafe_view.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "entry_points.h"

namespace dtq {
namespace {

constexpr int64_t kAmaxX = 1;  // quantize_alloc's amax mode: x's tensor-wide max|x| (quantize_alloc.cpp)

// One quantize_alloc launch as dtq/kernels QuantizeLaunch prepares it, with the output positions
// of the payload fields the GEMMs read. given_a / given_b: the slot reads the producer's amax when
// the call has one (LinearPlan's x_known, w_known and g_known directions; both slots of a
// transposed-codes launch).
struct Launch {
  bool present = false;
  std::vector<int64_t> cfg_a, fields_a, cfg_b, fields_b;
  int64_t mode_a = 0, mode_b = 0, signs = -1;
  bool given_a = false, given_b = false;
  bool has_b = false;
  // every slot reads x's tensor-wide max|x| (mode kX): computed here and given to them (a
  // producer's amax, where the call has one, still goes to the slots given_a / given_b name)
  bool tensor_amax = false;
  // outputs: rowwise codes [M, K] and scale, columnwise codes [K, M] and scale (-1: none)
  int64_t data = -1, scale = -1, data_t = -1, scale_t = -1;
};

struct Plan {
  Launch x, w, g;
  bool fast_accum = false;  // fprop's (the recipe's fprop_fast_accumulation)
};

// Reads a plan from the flat list register_linear gets (see dtq/nn/linear_native.py _launch_ints).
struct Reader {
  const std::vector<int64_t>& v;
  size_t i = 0;
  int64_t next() {
    TORCH_CHECK(i < v.size(), "dtq native linear: malformed plan description");
    return v[i++];
  }
  std::vector<int64_t> list() {
    const int64_t n = next();
    TORCH_CHECK(n >= 0 && i + size_t(n) <= v.size(), "dtq native linear: malformed plan description");
    std::vector<int64_t> out(v.begin() + i, v.begin() + i + n);
    i += n;
    return out;
  }
  Launch launch() {
    Launch l;
    l.present = next() != 0;
    if (!l.present) return l;
    l.mode_a = next();
    l.given_a = next() != 0;
    l.mode_b = next();
    l.given_b = next() != 0;
    l.signs = next();
    l.data = next();
    l.scale = next();
    l.data_t = next();
    l.scale_t = next();
    l.cfg_a = list();
    l.fields_a = list();
    l.cfg_b = list();
    l.fields_b = list();
    l.has_b = !l.cfg_b.empty() && l.cfg_b[0] != 0;  // (kind 0: no slot)
    l.tensor_amax = l.mode_a == kAmaxX && (!l.has_b || l.mode_b == kAmaxX);
    return l;
  }
};

// Plans are never freed (a backward may run any registered one); identical descriptions share an
// id. Heap-allocated and leaked: no CUDA tensor or container is destroyed after CUDA at exit.
struct Registry {
  std::mutex lock;
  std::vector<const Plan*> plans;
  std::map<std::vector<int64_t>, int64_t> ids;
};
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

const Plan& plan_at(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.lock);
  TORCH_CHECK(id >= 0 && size_t(id) < r.plans.size(), "dtq native linear: no plan ", id);
  return *r.plans[id];
}

std::vector<at::Tensor> quantize(const Launch& l, const at::Tensor& x2d, const c10::optional<at::Tensor>& known) {
  c10::optional<at::Tensor> a, b;
  int64_t ma = l.mode_a, mb = l.mode_b;
  if (known.has_value()) {
    if (l.given_a) {
      a = known;
      ma = 0;
    }
    if (l.given_b) {
      b = known;
      mb = 0;
    }
  } else if (l.tensor_amax) {
    // max|x| computed here into one fp32 and given to every slot: what quantize_alloc's pass
    // computes, there into an int32[2] read through a view and a select per slot (dispatcher
    // calls: host time)
    a = at::empty({}, x2d.options().dtype(at::kFloat));
    amax_x(x2d, *a);
    ma = 0;
    if (l.has_b) {
      b = a;
      mb = 0;
    }
  }
  std::vector<at::Tensor> outs = quantize_alloc(x2d, l.cfg_a, l.fields_a, a, ma, l.cfg_b, l.fields_b, b, mb, l.signs,
                                                c10::nullopt);
  TORCH_CHECK(!outs.empty(), "dtq native linear: the fused quantize kernel launched nothing for an admitted plan");
  return outs;
}

bool same_launch(const Launch& a, const Launch& b) {
  return a.cfg_a == b.cfg_a && a.fields_a == b.fields_a && a.cfg_b == b.cfg_b && a.fields_b == b.fields_b &&
         a.mode_a == b.mode_a && a.mode_b == b.mode_b && a.signs == b.signs && a.given_a == b.given_a &&
         a.given_b == b.given_b;
}

// The last input quantization, as linear_plan._LastInput keeps it: GEMMs that read one tensor in
// a row (q, k, v; gate, up) quantize it once. A write into x (its version), another launch or
// another known amax quantize again; a backward drops it.
struct LastInput {
  std::mutex lock;
  // x's identity: while this weak reference lives, no other tensor takes x's TensorImpl address
  c10::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> x;
  const c10::TensorImpl* x_impl = nullptr;
  uint32_t version = 0;
  const Launch* launch = nullptr;
  at::Tensor known;
  std::vector<at::Tensor> outs;

  void clear() {
    std::lock_guard<std::mutex> g(lock);
    x.reset();
    x_impl = nullptr;
    launch = nullptr;
    known = at::Tensor();
    outs.clear();
  }
};
LastInput& last_input() {
  static LastInput* l = new LastInput();
  return *l;
}

std::vector<at::Tensor> input_payloads(const Launch& l, const at::Tensor& x, const at::Tensor& x2d,
                                       const c10::optional<at::Tensor>& known) {
  if (x.is_inference()) return quantize(l, x2d.contiguous(), known);  // (no version counter)
  LastInput& last = last_input();
  const c10::TensorImpl* known_impl = known.has_value() ? known->unsafeGetTensorImpl() : nullptr;
  const uint32_t version = x._version();
  {
    std::lock_guard<std::mutex> g(last.lock);
    if (last.x_impl == x.unsafeGetTensorImpl() && last.x.has_value() && !last.x->expired() &&
        last.version == version &&
        (last.launch == &l || (last.launch != nullptr && same_launch(*last.launch, l))) &&
        (last.known.defined() ? last.known.unsafeGetTensorImpl() : nullptr) == known_impl) {
      return last.outs;
    }
  }
  std::vector<at::Tensor> outs = quantize(l, x2d.contiguous(), known);
  std::lock_guard<std::mutex> g(last.lock);
  last.x.emplace(x.getIntrusivePtr());
  last.x_impl = x.unsafeGetTensorImpl();
  last.version = version;
  last.launch = &l;
  last.known = known.has_value() ? *known : at::Tensor();
  last.outs = outs;
  return outs;
}

// The weight's launch outputs (LinearPlan.quantize_weight's payloads); known: max|w| where its
// gather computed it (LinearPlan.w_known's directions).
std::vector<at::Tensor> weight_payloads(const Plan& p, const at::Tensor& w_data,
                                        const c10::optional<at::Tensor>& known = c10::nullopt) {
  const at::Tensor w2 = (w_data.dim() == 2 ? w_data : w_data.reshape({-1, w_data.size(-1)})).contiguous();
  return quantize(p.w, w2, known);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct NativeLinear : public torch::autograd::Function<NativeLinear> {
  // weight: the parameter (autograd's edge); w_data: its plain data, which the kernels read
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& w_data, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& x_amax, int64_t id) {
    const Plan& p = plan_at(id);
    const int64_t k = x.size(-1), n = w_data.size(0);
    const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, k});
    const std::vector<at::Tensor> px = input_payloads(p.x, x, x2, x_amax);
    const std::vector<at::Tensor> pw = weight_payloads(p, w_data);
    const bool has_bias = bias.has_value() && bias->defined();
    const at::ScalarType x_dtype = x.scalar_type();
    at::Tensor y = at::_scaled_mm(px[p.x.data].contiguous(), pw[p.w.data].contiguous().t(), px[p.x.scale],
                                  pw[p.w.scale], c10::nullopt, c10::nullopt, has_bias ? at::kFloat : x_dtype,
                                  p.fast_accum);
    if (has_bias) y = y.add(bias->to(at::kFloat));
    if (y.scalar_type() != x_dtype) y = y.to(x_dtype);
    if (x.dim() != 2 || y.is_view() || !y.is_contiguous()) {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      shape.back() = n;
      y = at::_unsafe_view(y.contiguous(), shape);
    }
    // what LinearPlan.forward saves, in its order: x's [K, M] codes and scale, the weight's
    variable_list saved;
    if (p.x.data_t >= 0) saved.insert(saved.end(), {px[p.x.data_t], px[p.x.scale_t]});
    if (p.w.data_t >= 0) saved.insert(saved.end(), {pw[p.w.data_t], pw[p.w.scale_t]});
    ctx->save_for_backward(saved);
    ctx->saved_data["id"] = id;
    ctx->saved_data["bgrad"] = has_bias && bias->requires_grad();
    ctx->saved_data["w_dtype"] = w_data.scalar_type();
    if (x.dim() != 2) ctx->saved_data["x_shape"] = x.sizes();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    last_input().clear();  // the forward is over: hold no input payloads through backward
    const Plan& p = plan_at(ctx->saved_data["id"].toInt());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& dy = grads[0];
    const at::Tensor dy2 = dy.dim() == 2 ? dy : dy.reshape({-1, dy.size(-1)});
    at::Tensor dx, dw, db;
    if (p.g.present) {
      const std::vector<at::Tensor> pg = quantize(p.g, dy2.contiguous(), c10::nullopt);
      const size_t wi = p.x.data_t >= 0 ? 2 : 0;  // the weight's saved tensors follow x's
      if (p.w.data_t >= 0) {  // dgrad: dy [M, N] rowwise x the weight's codes [N, K], read as [K, N]
        dx = at::_scaled_mm(pg[p.g.data].contiguous(), saved[wi].t(), pg[p.g.scale], saved[wi + 1], c10::nullopt,
                            c10::nullopt, dy.scalar_type(), false);
      }
      if (p.x.data_t >= 0) {  // wgrad: dy's [N, M] codes x x's [K, M] codes, read as [M, K]
        dw = at::_scaled_mm(pg[p.g.data_t], saved[0].t(), pg[p.g.scale_t], saved[1], c10::nullopt, c10::nullopt,
                            ctx->saved_data["w_dtype"].toScalarType(), false);
      }
    }
    if (ctx->saved_data["bgrad"].toBool()) db = dy2.contiguous().sum(0);
    if (dx.defined() && ctx->saved_data.count("x_shape")) dx = dx.reshape(ctx->saved_data["x_shape"].toIntVector());
    if (at::GradMode::is_enabled() && dy.requires_grad()) {
      // a backward that builds a graph (create_graph=True): as Python's once_differentiable, the
      // gradients then raise when differentiated, instead of passing as constants
      variable_list outs;
      for (const at::Tensor& t : {dx, dw, db}) {
        at::Tensor v = t.defined() ? t.detach() : t;
        if (v.defined()) v.set_requires_grad(true);
        outs.push_back(v);
      }
      auto error = std::make_shared<torch::autograd::DelayedError>(
          "trying to differentiate twice a function that was marked with @once_differentiable", 3);
      outs = (*error)(std::move(outs));
      dx = outs[0], dw = outs[1], db = outs[2];
    }
    return {dx, dw, at::Tensor(), db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t register_linear(const std::vector<int64_t>& description) {
  Reader r{description};
  auto plan = std::make_unique<Plan>();
  plan->fast_accum = r.next() != 0;
  plan->x = r.launch();
  plan->w = r.launch();
  plan->g = r.launch();
  TORCH_CHECK(r.i == description.size() && plan->x.present && plan->w.present,
              "dtq native linear: malformed plan description");
  Registry& reg = registry();
  std::lock_guard<std::mutex> g(reg.lock);
  auto it = reg.ids.find(description);
  if (it != reg.ids.end()) return it->second;
  const int64_t id = int64_t(reg.plans.size());
  reg.plans.push_back(plan.release());
  reg.ids.emplace(description, id);
  return id;
}

at::Tensor native_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_data,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& x_amax, int64_t id) {
  return NativeLinear::apply(x, weight, w_data, bias, x_amax, id);
}

// The compiled path's quantize ops (dtq::quantize_input, planned_weight, quantize_grad) run one
// launch of a registered plan (which: 0 x, 1 the weight, 2 dy) as its forward / backward runs it:
// the same launch, the same producer's amax (known: none for the weight), the same outputs. No
// last-input cache: a graph quantizes an input once by itself (linear_native.payloads orders the
// outputs as the op returns them).
std::vector<at::Tensor> native_quantize(const at::Tensor& t, const c10::optional<at::Tensor>& known, int64_t id,
                                        int64_t which) {
  const Plan& p = plan_at(id);
  TORCH_CHECK(which >= 0 && which <= 2, "dtq native linear: no launch ", which);
  if (which == 1) return weight_payloads(p, t, known);
  const Launch& l = which == 0 ? p.x : p.g;
  TORCH_CHECK(l.present, "dtq native linear: plan ", id, " has no launch ", which);
  return quantize(l, (t.dim() == 2 ? t : t.reshape({-1, t.size(-1)})).contiguous(), known);
}

}  // namespace dtq
