// A PEFT DoRA layer on a plain nn.Linear base in one C++ call and one autograd node (native/bridge.py `layer`).
//
// The C++ compose (compose.cpp) still pays, per layer call, the base layer's module call and its autograd nodes, the
// LoRA A matmul's nodes, and an add of the two input gradients: host time the step's backward spends on the engine's
// device thread. Here the base matmul, the LoRA A matmul and the fused compose kernel run without autograd recording,
// and one node does the whole backward:
//   gdy, dm: the compose-backward kernel; dB = s gdy^T a; da = s gdy B; dA = da^T x; dx = gdy W + da A
// (dx in one buffer: addmm on gdy W). Same values as the split path's ops (the same GEMMs on the same operands), except
// dx, whose two products are added inside the second GEMM instead of by autograd. The forward's casts of float32
// adapters to the matmul dtype serve the backward where they are small next to what the node saves (`keep_casts`).
//
// It takes a call only where nothing could tell: the base's weight and bias frozen, x and the weight in the matmul
// dtype (nothing to cast or to keep cast), and the plans of both kernels filed; peft/layers.py checks the rest (no
// hooks on the base, a plain nn.Linear, no dropout). Everything else returns None (the split path runs) before any
// work.

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/extension.h>

#include "compose.h"

#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace flashdora_native;

struct LayerBackward : public ComposeBackward {
  SavedVariable x_;             // (saved only where lora_A trains: dA alone reads it)
  at::Tensor weight_, lora_A_;  // (parameters: held, not saved; their versions checked where dx reads them)
  SavedVariable a_cast_;        // lora_A as the forward cast it to the matmul dtype (`keep_casts`), or none
  uint32_t w_version_ = 0, a_version_ = 0;
  std::vector<int64_t> x_sizes_;
  c10::ScalarType cd_ = at::kBFloat16;  // the matmul dtype: x's, the weight's, a's

  std::string name() const override { return "FlashDoraLayerBackward"; }

  void check_versions() const {
    TORCH_CHECK(weight_._version() == w_version_,
                "flashdora: the base layer's weight was modified by an inplace operation between the forward and the "
                "backward (version " + std::to_string(w_version_) + " -> " + std::to_string(weight_._version()) +
                    "); the backward needs the values the forward used");
    TORCH_CHECK(lora_A_._version() == a_version_,
                "flashdora: lora_A was modified by an inplace operation between the forward and the backward (version " +
                    std::to_string(a_version_) + " -> " + std::to_string(lora_A_._version()) +
                    "); the backward needs the values the forward used");
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(4);  // x, lora_A, lora_B, magnitude
    if (!grads[0].defined()) return out;
    auto [a, inner, b_cast] = unpack_saved();
    if (should_compute_output(0)) check_versions();  // (dx reads both again; nothing else reads either)
    auto [dy, gdy, d_lx, dm] = kernel(grads[0], inner);
    const int64_t n = dy.size(-1), t = dy.numel() / n, r = a.size(-1);
    if (should_compute_output(3)) out[3] = dm;
    at::Tensor gdy2 = gdy.view({t, n});
    if (should_compute_output(2)) {  // s gdy^T a: [d_out, r] (autograd casts it to lora_B's dtype)
      at::Tensor a2 = a.view({t, r});
      out[2] = alpha_ == 1.0 ? at::mm(gdy2.t(), a2) : at::addmm(zero_, gdy2.t(), a2, 0, alpha_);
    }
    if (should_compute_output(0) || should_compute_output(1)) {
      at::Tensor da = d_a(gdy2, cd_, b_cast);  // s gdy B: [T, r]
      if (should_compute_output(1)) {  // da^T x: [r, d_in] (autograd casts it to lora_A's dtype)
        at::Tensor x = x_.unpack(getptr());
        out[1] = at::mm(da.t(), x.view({t, x.size(-1)}));
      }
      if (should_compute_output(0)) {  // gdy W + da A: [T, d_in]
        at::Tensor dx = at::mm(gdy2, weight_);
        dx.addmm_(da, in_dtype(lora_A_, a_cast_.unpack(getptr()), cd_));
        out[0] = dx.view(x_sizes_);
      }
    }
    return out;
  }

  void release_variables() override {
    ComposeBackward::release_variables();
    x_.reset_data();
    a_cast_.reset_data();
  }
};

// The same node with the compose-backward kernel's math in ATen (tests/ops/test_native_layer.py, on the CPU).
struct EagerLayerBackward : public LayerBackward {
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& grad,
                                                                    const at::Tensor& inner) override {
    return eager_kernel(grad, inner);
  }
};

// A LayerBackward of type T for y = layer(x), with its edges (x, lora_A, lora_B, magnitude) and saved state. `a_cast`,
// `b`: lora_A as the forward cast it (undefined where it did not) and lora_B as the kernel read it (kept where
// `keep_casts` says so).
template <typename T>
void hang(const at::Tensor& y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
          const at::Tensor& lora_B, const at::Tensor& magnitude, const at::Tensor& a, const at::Tensor& inner,
          const at::Tensor& scales, double scaling, const Plan* plan, const at::Tensor& a_cast, const at::Tensor& b) {
  auto node = make_node<T>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, lora_A, lora_B, magnitude));
  fill_node(*node, a, lora_B, inner, scales, scaling, false, b);
  if (a_cast.defined() && x.requires_grad() && keep_casts(a)) node->a_cast_ = SavedVariable(a_cast, false);
  if (lora_A.requires_grad()) node->x_ = SavedVariable(x, false);  // (read by dA alone)
  node->x_sizes_ = x.sizes().vec();
  node->weight_ = weight;
  node->w_version_ = weight._version();
  node->lora_A_ = lora_A;
  node->a_version_ = lora_A._version();
  node->cd_ = a.scalar_type();
  if (plan != nullptr) node->plan_ = *plan;
  torch::autograd::set_history(y, node);
}

// native/bridge.py `layer`: y = the DoRA layer on base `weight` (and `bias`) for x, or None where this call is not
// one it takes (the split path runs), or False where it has no plan for it yet (bridge's `prime` files them, then
// calls again). The checks come before any work: a call it declines has launched nothing.
py::object layer_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& lora_A, const at::Tensor& lora_B, const at::Tensor& magnitude,
                         const at::Tensor& scales, double scaling) {
  if (!x.is_cuda() || x.dim() < 1 || !x.is_contiguous() || x.numel() == 0 || weight.dim() != 2 ||
      weight.device() != x.device() || weight.requires_grad() || lora_A.dim() != 2 || lora_B.dim() != 2) {
    return py::none();
  }
  const int64_t k = x.size(-1), t = x.numel() / k, n = weight.size(0), r = lora_A.size(0);
  if (weight.size(1) != k || lora_A.size(1) != k || lora_B.size(0) != n || lora_B.size(1) != r) return py::none();
  const bool grad = at::GradMode::is_enabled();
  const bool train = grad && magnitude.requires_grad();
  if (grad && !train) return py::none();
  const auto device_type = x.device().type();
  const bool autocast = at::autocast::is_autocast_enabled(device_type);
  const c10::ScalarType cd = autocast ? at::autocast::get_autocast_dtype(device_type) : lora_A.scalar_type();
  if (cd == at::kDouble || x.scalar_type() != cd || weight.scalar_type() != cd || lora_B.scalar_type() == at::kDouble) {
    return py::none();
  }
  if (scales.stride(-1) != 1 || lora_B.stride(1) != 1 || !aligned(scales)) return py::none();
  at::Tensor bias_c;
  if (bias) {
    if (bias->requires_grad() || bias->device() != x.device() || (!autocast && bias->scalar_type() != cd)) {
      return py::none();
    }
    bias_c = bias->contiguous();
    if (!aligned(bias_c)) return py::none();
  }
  const bool cast_b = cast_b_first(lora_B, t, cd);
  if (!cast_b && !aligned(lora_B)) return py::none();
  const Plan *fwd = nullptr, *bwd = nullptr;
  switch (compose_plans(x.get_device(), t, n, cd, r, cd, lora_B, cast_b, scales, bias, train, std::nullopt, &fwd,
                        &bwd)) {
    case Found::given_up: return py::none();
    case Found::missing: return py::bool_(false);
    case Found::plan: break;
  }

  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  at::Tensor inner = train ? at::empty_like(y) : y;
  at::Tensor a, a_cast, b;
  {
    at::AutoGradMode no_grad(false);  // (recorded by the node below, not op by op)
    const at::Tensor x2 = x.view({t, k});
    // The base layer's F.linear as it runs on this 2-D view (autocast casts a float32 bias as it would there), and
    // a = x A^T with A cast here (under autocast without grad, autocast would cache a copy with no history).
    at::Tensor result = bias ? at::addmm(bias_c, x2, weight.t()) : at::mm(x2, weight.t());
    if (lora_A.scalar_type() != cd) a_cast = lora_A.to(cd);
    a = at::mm(x2, a_cast.defined() ? a_cast.t() : lora_A.t());
    b = cast_b ? lora_B.to(cd) : lora_B;
    launch_forward(*fwd, result, a, b, nullptr, bias ? &bias_c : nullptr, scales, y, inner, scaling);
  }
  if (train) hang<LayerBackward>(y, x, weight, lora_A, lora_B, magnitude, a, inner, scales, scaling, bwd, a_cast, b);
  return py::cast(y);
}

// The node with ATen math for the compose kernel, on y computed by the caller (the CPU tests of its wiring).
// `a_cast`, `b`: the forward's casts of lora_A and lora_B, as layer_forward hands them to the node.
void attach_layer_eager(const at::Tensor& y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
                        const at::Tensor& lora_B, const at::Tensor& magnitude, const at::Tensor& a,
                        const at::Tensor& inner, const at::Tensor& scales, double scaling,
                        const std::optional<at::Tensor>& a_cast, const std::optional<at::Tensor>& b) {
  hang<EagerLayerBackward>(y, x, weight, lora_A, lora_B, magnitude, a, inner, scales, scaling, nullptr,
                           a_cast ? *a_cast : at::Tensor(), b ? *b : lora_B);
}

}  // namespace

namespace flashdora_native {

void add_layer(pybind11::module_& m) {
  m.def("layer_forward", &layer_forward,
        "the whole DoRA layer on a plain base in one call: y, None (not taken) or False (no plan yet)", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("lora_A"), py::arg("lora_B"), py::arg("magnitude"),
        py::arg("scales"), py::arg("scaling"));
  m.def("attach_layer_eager", &attach_layer_eager, "the layer's node with ATen math for the kernel (CPU tests)",
        py::arg("y"), py::arg("x"), py::arg("weight"), py::arg("lora_A"), py::arg("lora_B"), py::arg("magnitude"),
        py::arg("a"), py::arg("inner"), py::arg("scales"), py::arg("scaling"), py::arg("a_cast") = py::none(),
        py::arg("b") = py::none());
}

}  // namespace flashdora_native
