// The DoRA compose on the Triton path, forward and backward, in C++ (flashdora.native.bridge calls it).
//
// A layer of ordinary size is bound by the host: its Python costs more than its kernels. `forward` runs the
// LoRA A matmul (ATen, recorded by autograd as F.linear is), launches the fused forward kernel that the Python path
// compiled and tuned, and in training hangs the backward node on the output; it takes a call only when it holds the
// plan of every kernel it launches (filed from Python by native/bridge.py `prime`, which compiles them first where
// needed), and leaves everything else to the Python path. The backward node launches the compose-backward kernel,
// then the magnitude gradient's second stage and the two LoRA GEMMs: on the autograd engine's device thread the
// Python `autograd.Function` costs more host time per layer than PEFT LoRA's C++ nodes.
//
// Math (docs/math.md): y = g (result - bias + s a B^T) + bias with a = x A^T; gdy = g dy;
// dm = sum_tokens dy * inner / norm; dB = s gdy^T a; da = s gdy B.
//
// Error messages are built with std::to_string, never by streaming numbers: streaming an integer into TORCH_CHECK's
// message has crashed the extension where the Python path raises (docs/host-notes.md).

#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>

#include "compose.h"

#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace flashdora_native {
void add_norm(pybind11::module_& m);   // norm.cpp
void add_check(pybind11::module_& m);  // check.cpp
void add_layer(pybind11::module_& m);  // layer.cpp
}  // namespace flashdora_native

namespace flashdora_native {

at::Tensor zero_like(const at::Tensor& a) {
  static auto* zeros = new std::map<std::pair<int64_t, int64_t>, at::Tensor>();
  auto key = std::make_pair(static_cast<int64_t>(a.scalar_type()), static_cast<int64_t>(a.get_device()));
  auto it = zeros->find(key);
  if (it == zeros->end()) it = zeros->emplace(key, at::zeros({}, a.options())).first;
  return it->second;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ComposeBackward::unpack_saved() {
  // create_graph=True: this node keeps no edge from inner to its producers, so it refuses (ops/compose_grad2.py
  // REFUSED, the same words); forwards under flashdora.double_backward() never take the C++ path.
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "flashdora: a gradient of a gradient (create_graph=True) through a DoRA layer needs the layer's "
              "forward to have run with flashdora.double_backward() on (e.g. `with flashdora.double_backward(): "
              "loss = model(x)`; first-order training never pays for it), or the model on PEFT's DoRA "
              "(flashdora.disable(model))");
  TORCH_CHECK(scales_.defined(),
              "flashdora: trying to backward through the compose a second time after its buffers were freed "
              "(specify retain_graph=True)");
  TORCH_CHECK(lora_B_._version() == b_version_,
              "flashdora: lora_B was modified by an inplace operation between the forward and the backward (version " +
                  std::to_string(b_version_) + " -> " + std::to_string(lora_B_._version()) +
                  "); the backward needs the values the forward used");
  auto self = getptr();
  return {a_.unpack(self), inner_.unpack(self), b_cast_.unpack(self)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ComposeBackward::kernel(const at::Tensor& grad,
                                                                                   const at::Tensor& inner) {
  at::Tensor dy = grad.contiguous();
  if (!aligned(dy)) dy = dy.clone();  // the plan's kernel assumes 16-byte alignment
  const int64_t n = dy.size(-1), t = dy.numel() / n;
  at::Tensor gdy = at::empty_like(dy, at::MemoryFormat::Contiguous);
  at::Tensor d_lx = lx_base_ ? at::empty_like(dy, at::MemoryFormat::Contiguous) : gdy;
  at::Tensor dg_part = at::empty({plan_.n_split, n}, scales_.options());
  std::vector<Arg> args = {
      ptr(dy), ptr(inner), ptr(scales_), ptr(gdy), ptr(d_lx), ptr(dg_part),
      integer(t), integer(n), integer(plan_.block_m), Arg{'f', nullptr, 0, gdy_scale_},
      integer(n), integer(n), integer(n), integer(n), integer(scales_.stride(0)),
  };
  launch(plan_, args, plan_.n_split, cdiv(n, plan_.block_n), current_stream(dy.device()));
  at::Tensor dm = plan_.n_split == 1 ? dg_part.select(0, 0) : dg_part.sum(0);
  return {dy, gdy, d_lx, dm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ComposeBackward::eager_kernel(
    const at::Tensor& dy, const at::Tensor& inner) const {
  const int64_t n = dy.size(-1), t = dy.numel() / n;
  at::Tensor d32 = dy.to(scales_.scalar_type()).reshape({t, n});
  at::Tensor gdy = ((gdy_scale_ == 1.0 ? d32 : d32 * gdy_scale_) * scales_.select(0, 0)).to(dy.scalar_type());
  gdy = gdy.view(dy.sizes());
  at::Tensor d_lx = lx_base_ ? (d32 * scales_.select(0, 1)).to(dy.scalar_type()).view(dy.sizes()) : gdy;
  at::Tensor dm = (d32 * inner.to(scales_.scalar_type()).reshape({t, n})).sum(0) * scales_.select(0, 2);
  return {dy, gdy, d_lx, dm};
}

at::Tensor ComposeBackward::d_a(const at::Tensor& gdy2, c10::ScalarType type, const at::Tensor& b_cast) const {
  const at::Tensor b = in_dtype(lora_B_, b_cast, type);
  return alpha_ == 1.0 ? at::mm(gdy2, b) : at::addmm(zero_, gdy2, b, 0, alpha_);
}

variable_list ComposeBackward::apply(variable_list&& grads) {
  variable_list out(lx_base_ ? 5 : 4);
  if (!grads[0].defined()) return out;
  auto [a, inner, b_cast] = unpack_saved();
  auto [dy, gdy, d_lx, dm] = kernel(grads[0], inner);
  const int64_t n = dy.size(-1), t = dy.numel() / n, r = a.size(-1);
  if (should_compute_output(0)) out[0] = lx_base_ ? dy : gdy;
  if (should_compute_output(3)) out[3] = dm;
  if (lx_base_ && should_compute_output(4)) out[4] = d_lx;
  if (should_compute_output(1) || should_compute_output(2)) {
    at::Tensor gdy2 = gdy.view({t, n});
    if (gdy2.scalar_type() != a.scalar_type()) gdy2 = gdy2.to(a.scalar_type());
    if (should_compute_output(2)) {  // s gdy^T a: [d_out, r], in a's dtype (autograd casts it to lora_B's)
      at::Tensor a2 = a.view({t, r});
      out[2] = alpha_ == 1.0 ? at::mm(gdy2.t(), a2) : at::addmm(zero_, gdy2.t(), a2, 0, alpha_);
    }
    if (should_compute_output(1)) out[1] = d_a(gdy2, a.scalar_type(), b_cast).view(a.sizes());  // s gdy B: [T, r]
  }
  return out;
}

void ComposeBackward::release_variables() {
  a_.reset_data();
  inner_.reset_data();
  scales_.reset();
  b_cast_.reset_data();
}

void fill_node(ComposeBackward& node, const at::Tensor& a, const at::Tensor& lora_B, const at::Tensor& inner,
               const at::Tensor& scales, double scaling, bool lx_base, const at::Tensor& b) {
  node.a_ = SavedVariable(a, false);
  node.inner_ = SavedVariable(inner, false);
  node.lora_B_ = lora_B;
  if (b.scalar_type() != lora_B.scalar_type() && keep_casts(a)) node.b_cast_ = SavedVariable(b, false);
  node.b_version_ = lora_B._version();
  node.scales_ = scales;
  node.lx_base_ = lx_base;
  node.alpha_ = lx_base ? 1.0 : scaling;
  node.gdy_scale_ = lx_base ? scaling : 1.0;
  node.zero_ = zero_like(a);
}

std::map<std::vector<int64_t>, Plan>& plans() {
  static auto* table = new std::map<std::vector<int64_t>, Plan>();  // (never freed: used until the process ends)
  return *table;
}

std::vector<int64_t> fwd_key(int64_t device, int64_t t, int64_t n, c10::ScalarType out_type, int64_t r,
                             c10::ScalarType a_type, c10::ScalarType b_type, int64_t b_stride, const at::Tensor& scales,
                             const std::optional<at::Tensor>& bias, bool save_inner,
                             const std::optional<at::Tensor>& lx_base) {
  return {0, device, n, r, static_cast<int64_t>(out_type), static_cast<int64_t>(a_type),
          static_cast<int64_t>(b_type), bias ? static_cast<int64_t>(bias->scalar_type()) : -1,
          static_cast<int64_t>(scales.scalar_type()), save_inner, spec(t), spec(b_stride), spec(scales.stride(0)),
          lx_base ? static_cast<int64_t>(lx_base->scalar_type()) : -1};
}

std::vector<int64_t> bwd_key(int64_t device, int64_t t, int64_t n, c10::ScalarType out_type, const at::Tensor& scales,
                             bool has_lx_base) {
  return {1, device, t, n, static_cast<int64_t>(out_type), static_cast<int64_t>(scales.scalar_type()),
          scales.stride(0), has_lx_base};
}

Found find_plan(std::vector<int64_t>&& key, const Plan** out) {
  Plan& plan = plans()[std::move(key)];  // (std::map: the reference stays valid while other keys are added)
  *out = &plan;
  if (plan.function != 0) return Found::plan;
  return ++plan.misses > kMaxMisses ? Found::given_up : Found::missing;
}

Found compose_plans(int64_t device, int64_t t, int64_t n, c10::ScalarType out_type, int64_t r, c10::ScalarType cd,
                    const at::Tensor& lora_B, bool cast_b, const at::Tensor& scales,
                    const std::optional<at::Tensor>& bias, bool train, const std::optional<at::Tensor>& lx_base,
                    const Plan** fwd, const Plan** bwd) {
  const Found found = find_plan(fwd_key(device, t, n, out_type, r, cd, cast_b ? cd : lora_B.scalar_type(),
                                        cast_b ? r : lora_B.stride(0), scales, bias, train, lx_base),
                                fwd);
  if (found != Found::plan || !train) return found;
  auto it = plans().find(bwd_key(device, t, n, out_type, scales, lx_base.has_value()));
  if (it == plans().end()) return Found::missing;
  *bwd = &it->second;
  return Found::plan;
}

void launch_forward(const Plan& plan, const at::Tensor& result, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor* lx_base, const at::Tensor* bias, const at::Tensor& scales, const at::Tensor& y,
                    const at::Tensor& inner, double scaling) {
  const int64_t n = result.size(-1), t = result.numel() / n, r = a.size(-1);
  std::vector<Arg> args = {
      ptr(result), ptr(a), ptr(b), lx_base ? ptr(*lx_base) : ptr(result), bias ? ptr(*bias) : ptr(scales),
      ptr(scales), ptr(y), ptr(inner),
      integer(t), integer(n), integer(r), Arg{'f', nullptr, 0, scaling},
      integer(n), integer(r), integer(b.stride(0)), integer(n), integer(n), integer(n), integer(scales.stride(0)),
  };
  launch(plan, args, cdiv(t, plan.block_m), cdiv(n, plan.block_n), current_stream(result.device()));
}

}  // namespace flashdora_native

namespace {

using namespace flashdora_native;

// A node of type T with the edges and saved state both node types share (set_history hangs it on y); `scaling`
// goes on the LoRA GEMMs' alpha without lx_base, on dy before g with it.
template <typename T>
auto new_node(const at::Tensor& result, const at::Tensor& a, const at::Tensor& lora_B, const at::Tensor& b,
              const at::Tensor& magnitude, const at::Tensor& inner, const at::Tensor& scales, double scaling,
              const std::optional<at::Tensor>& lx_base = std::nullopt) {
  auto node = make_node<T>();
  if (lx_base) {
    node->set_next_edges(torch::autograd::collect_next_edges(result, a, lora_B, magnitude, *lx_base));
  } else {
    node->set_next_edges(torch::autograd::collect_next_edges(result, a, lora_B, magnitude));
  }
  fill_node(*node, a, lora_B, inner, scales, scaling, lx_base.has_value(), b);
  return node;
}

// Hang a ComposeBackward launching `plan` on `y` (fresh, from the fused forward kernel): its inputs are result, a,
// lora_B, magnitude (and lx_base); `b`: lora_B as the kernel read it.
void hang_node(at::Tensor y, const at::Tensor& result, const at::Tensor& a, const at::Tensor& lora_B,
               const at::Tensor& b, const at::Tensor& magnitude, const at::Tensor& inner, const at::Tensor& scales,
               double scaling, Plan plan, const std::optional<at::Tensor>& lx_base = std::nullopt) {
  auto node = new_node<ComposeBackward>(result, a, lora_B, b, magnitude, inner, scales, scaling, lx_base);
  node->plan_ = std::move(plan);
  torch::autograd::set_history(y, node);
}

// native/bridge.py `compose`: the compose on the Triton path: y, or None where this call is not one it takes (the
// Python path runs), or False where it has no plan for it yet (bridge's `prime` files them, then calls again).
// `lx_base`: dropout's exact form (`x` is then the dropout-applied input), which PEFT calls without a bias. The checks
// come before any work: a call it declines has launched nothing.
py::object forward(const at::Tensor& result, const at::Tensor& x, const at::Tensor& lora_A, const at::Tensor& lora_B,
                   const at::Tensor& magnitude, const at::Tensor& scales, const std::optional<at::Tensor>& bias,
                   double scaling, int64_t seq, const std::optional<at::Tensor>& lx_base) {
  if (!result.is_cuda() || result.dim() < 1 || !result.is_contiguous() || result.numel() == 0) return py::none();
  if (lx_base && (bias || !lx_base->is_cuda() || lx_base->sizes() != result.sizes() || !lx_base->is_contiguous() ||
                  lx_base->scalar_type() == at::kDouble || !aligned(*lx_base))) {
    return py::none();
  }
  const int64_t n = result.size(-1), t = result.numel() / n, r = lora_A.size(0);
  const bool grad = at::GradMode::is_enabled();
  const bool train = grad && magnitude.requires_grad();
  if ((grad && !train) || (train && bias && bias->requires_grad())) return py::none();
  for (const at::Tensor* p : {&result, &x, &lora_A, &lora_B}) {
    if (p->scalar_type() == at::kDouble) return py::none();
  }
  if (scales.stride(-1) != 1 || lora_B.stride(1) != 1 || !aligned(result) || !aligned(scales)) return py::none();
  const auto device_type = result.device().type();
  const bool autocast = at::autocast::is_autocast_enabled(device_type);
  const c10::ScalarType cd = autocast ? at::autocast::get_autocast_dtype(device_type) : lora_A.scalar_type();
  const bool cast_b = cast_b_first(lora_B, t, cd);
  if (!cast_b && !aligned(lora_B)) return py::none();
  at::Tensor bias_c;
  if (bias) {
    bias_c = bias->contiguous();
    if (!aligned(bias_c)) return py::none();
  }
  const Plan *fwd = nullptr, *bwd = nullptr;
  switch (compose_plans(result.get_device(), t, n, result.scalar_type(), r, cd, lora_B, cast_b, scales, bias, train,
                        lx_base, &fwd, &bwd)) {
    case Found::given_up: return py::none();
    case Found::missing: return py::bool_(false);  // (native/bridge.py `prime` files the plans, then calls again)
    case Found::plan: break;
  }

  // a = x A^T in the matmul dtype, as ops/compose_fn.py `_lora_a`: under autocast with grad, autocast casts both
  // operands; without grad, lora_A is cast here (autocast would keep its copy until its region ends).
  at::Tensor a;
  if (autocast) {
    a = at::linear(x, grad || lora_A.scalar_type() == cd ? lora_A : lora_A.to(cd));
  } else {
    a = at::linear(x.scalar_type() == cd ? x : x.to(cd), lora_A);
  }
  if (!a.is_contiguous()) a = a.contiguous();
  TORCH_CHECK(a.scalar_type() == cd, "flashdora.native: the LoRA A matmul gave an unexpected dtype");
  // ops/compose.py `after_base`: the A matmul's backward waits for the base layer's (seq: below the base's nodes).
  if (train && seq >= 0 && a.grad_fn()) a.grad_fn()->set_sequence_nr(static_cast<uint64_t>(seq));
  at::Tensor b = lora_B;
  if (cast_b) {
    at::NoGradGuard no_grad;  // (what the kernel reads, and the node may keep: no history)
    b = lora_B.to(cd);
  }
  at::Tensor y = at::empty_like(result, at::MemoryFormat::Contiguous);
  at::Tensor inner = train ? at::empty_like(result, at::MemoryFormat::Contiguous) : y;
  launch_forward(*fwd, result, a, b, lx_base ? &*lx_base : nullptr, bias ? &bias_c : nullptr, scales, y, inner,
                 scaling);
  if (train) hang_node(y, result, a, lora_B, b, magnitude, inner, scales, scaling, *bwd, lx_base);
  return py::cast(y);
}

// File the forward kernel compiled for a call like this one (`a`: the LoRA A output or a stand-in of its dtype and
// width; `b`: lora_B as the kernel reads it).
void register_forward(const at::Tensor& result, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scales,
                      const std::optional<at::Tensor>& bias, bool save_inner, int64_t function, int64_t warps,
                      int64_t shared, int64_t block_m, int64_t block_n, std::string types, std::vector<int64_t> keep,
                      const std::optional<at::Tensor>& lx_base) {
  TORCH_CHECK(function != 0, "flashdora.native: register_forward needs a loaded kernel");
  const int64_t n = result.size(-1), t = result.numel() / n;
  plans()[fwd_key(result.get_device(), t, n, result.scalar_type(), a.size(-1), a.scalar_type(), b.scalar_type(),
                  b.stride(0), scales, bias, save_inner, lx_base)] =
      Plan{function, warps, shared, block_m, block_n, 1, std::move(types), std::move(keep)};
}

// File the backward kernel's plan for gradients shaped and typed like `result`.
void register_backward(const at::Tensor& result, const at::Tensor& scales, int64_t function, int64_t warps,
                       int64_t shared, int64_t block_n, int64_t n_split, int64_t rows, std::string types,
                       std::vector<int64_t> keep, bool has_lx_base) {
  TORCH_CHECK(function != 0, "flashdora.native: register_backward needs a loaded kernel");
  const int64_t n = result.size(-1);
  plans()[bwd_key(result.get_device(), result.numel() / n, n, result.scalar_type(), scales, has_lx_base)] =
      Plan{function, warps, shared, rows, block_n, n_split, std::move(types), std::move(keep)};
}

// The same node's math in ATen, no kernel: a CPU test of the node's wiring (tests/ops/test_native.py).
struct EagerComposeBackward : public ComposeBackward {
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& grad,
                                                                    const at::Tensor& inner) override {
    return eager_kernel(grad, inner);
  }
};

void attach_eager(at::Tensor y, const at::Tensor& result, const at::Tensor& a, const at::Tensor& lora_B,
                  const at::Tensor& magnitude, const at::Tensor& inner, const at::Tensor& scales, double scaling,
                  const std::optional<at::Tensor>& lx_base, const std::optional<at::Tensor>& b) {
  torch::autograd::set_history(y, new_node<EagerComposeBackward>(result, a, lora_B, b ? *b : lora_B, magnitude, inner,
                                                                 scales, scaling, lx_base));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "the compose's forward on the Triton path: y, None (not taken) or False (no plan yet)",
        py::arg("result"), py::arg("x"), py::arg("lora_A"), py::arg("lora_B"), py::arg("magnitude"),
        py::arg("scales"), py::arg("bias"), py::arg("scaling"), py::arg("seq"), py::arg("lx_base") = py::none());
  m.def("register_forward", &register_forward, "file the forward kernel's launch plan for calls like this one",
        py::arg("result"), py::arg("a"), py::arg("b"), py::arg("scales"), py::arg("bias"), py::arg("save_inner"),
        py::arg("function"), py::arg("warps"), py::arg("shared"), py::arg("block_m"), py::arg("block_n"),
        py::arg("types"), py::arg("keep"), py::arg("lx_base") = py::none());
  m.def("register_backward", &register_backward, "file the backward kernel's launch plan for gradients like these",
        py::arg("result"), py::arg("scales"), py::arg("function"), py::arg("warps"), py::arg("shared"),
        py::arg("block_n"), py::arg("n_split"), py::arg("rows"), py::arg("types"), py::arg("keep"),
        py::arg("has_lx_base") = false);
  flashdora_native::add_norm(m);
  flashdora_native::add_check(m);
  flashdora_native::add_layer(m);
  m.def("attach_eager", &attach_eager, "the same node with ATen math instead of the kernel (CPU tests)",
        py::arg("y"), py::arg("result"), py::arg("a"), py::arg("lora_B"), py::arg("magnitude"), py::arg("inner"),
        py::arg("scales"), py::arg("scaling"), py::arg("lx_base") = py::none(), py::arg("b") = py::none());
}
