// The DoRA compose's backward as a C++ autograd node (flashdora.native; design: docs/decisions.md).
//
// The Python path's backward is a torch.autograd.Function: on the autograd engine's device thread, inside a model's
// backward, its Python costs more host time per layer than PEFT LoRA's C++ nodes. This node does the same work in
// C++: it launches the compose-backward Triton kernel that the Python path compiled and tuned (its CUfunction and
// launch plan come from Python, once per shape), then the magnitude gradient's second stage and the two LoRA GEMMs.
// The forward stays Python (the fused forward kernel); `attach` hangs this node on its output.
//
// Math (docs/math.md): gdy = g dy; dm = sum_tokens dy * inner / norm; dB = s gdy^T a; da = s gdy B.
//
// Error messages are built with std::to_string, never by streaming numbers: with the device machines' g++ 13 and
// torch 2.11, streaming an integer into TORCH_CHECK's message crashed in the extension's own copy of
// std::ostream::_M_insert (a segfault where the Python path raises).

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>

#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// cuLaunchKernel, from the driver torch has loaded (no link against CUDA: this file builds against any torch).
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);

LaunchFn launch_fn() {
  static LaunchFn fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    return lib == nullptr ? nullptr : reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
  }();
  return fn;
}

// One compiled compose-backward kernel: what Triton's launcher would pass it, decided in Python (kernels/native.py).
struct Plan {
  int64_t function = 0;     // CUfunction
  int64_t warps = 4;
  int64_t shared = 0;       // dynamic shared memory, bytes
  int64_t block_n = 0;      // the tuned BLOCK_N (grid y = cdiv(N, BLOCK_N))
  int64_t n_split = 1;      // grid x: token ranges, each one partial sum row of dm
  int64_t rows = 0;         // tokens per program
  std::string types;        // per kernel parameter passed: 'O' pointer, 'i' i32, 'l' i64, 'f' f32 (then padding)
  std::vector<int64_t> keep;  // which of the 15 arguments are parameters (the rest Triton folded into constants)
};

// A kernel argument before packing: a pointer, an integer or a float.
struct Arg {
  char kind;
  void* ptr;
  int64_t i;
  double f;
};

// The current stream of `device` (the autograd engine sets it to the forward's for this node), as a cudaStream_t.
void* current_stream(const c10::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

void launch(const Plan& plan, const std::vector<Arg>& args, void* stream) {
  LaunchFn fn = launch_fn();
  TORCH_CHECK(fn != nullptr, "flashdora.native: cuLaunchKernel not found in libcuda.so.1");
  std::vector<uint64_t> storage(plan.types.size(), 0);  // 8 bytes per parameter, written in its own type
  std::vector<void*> params(plan.types.size(), nullptr);
  for (size_t k = 0; k < plan.types.size(); ++k) {
    void* slot = &storage[k];
    params[k] = slot;
    char ty = plan.types[k];
    if (k >= plan.keep.size()) {  // padding: a null pointer per scratch parameter newer Triton adds
      continue;
    }
    const Arg& a = args.at(static_cast<size_t>(plan.keep[k]));
    if (ty == 'O') {
      void* p = a.ptr;
      std::memcpy(slot, &p, sizeof(p));
    } else if (ty == 'i') {
      int32_t v = static_cast<int32_t>(a.i);
      std::memcpy(slot, &v, sizeof(v));
    } else if (ty == 'l') {
      int64_t v = a.i;
      std::memcpy(slot, &v, sizeof(v));
    } else if (ty == 'f') {
      float v = static_cast<float>(a.kind == 'f' ? a.f : static_cast<double>(a.i));
      std::memcpy(slot, &v, sizeof(v));
    } else {
      TORCH_CHECK(false, "flashdora.native: unsupported kernel parameter type " + std::string(1, ty));
    }
  }
  int rc = fn(reinterpret_cast<void*>(plan.function), static_cast<unsigned>(plan.n_split),
              static_cast<unsigned>((args[7].i + plan.block_n - 1) / plan.block_n), 1,
              static_cast<unsigned>(32 * plan.warps), 1, 1, static_cast<unsigned>(plan.shared),
              stream, params.data(), nullptr);
  TORCH_CHECK(rc == 0, "flashdora.native: cuLaunchKernel failed with CUresult " + std::to_string(rc));
}

// A new node of type T, owned the way this torch owns nodes (std::shared_ptr up to 2.12, c10::intrusive_ptr after).
template <typename T>
auto make_node() {
  using Ptr = decltype(std::declval<T&>().getptr());
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

Arg ptr(const at::Tensor& t) { return Arg{'O', t.data_ptr(), 0, 0.0}; }
Arg integer(int64_t v) { return Arg{'i', nullptr, v, 0.0}; }

// d_result, d_a, d_lora_B, d_magnitude of `y = compose(result, a, lora_B, magnitude)` without dropout's lx_base.
struct ComposeBackward : public Node {
  SavedVariable a_, inner_;
  at::Tensor lora_B_, scales_, zero_;  // (not saved variables: no saved-tensor hooks; lora_B's version checked here)
  uint32_t b_version_ = 0;
  double alpha_ = 1.0;
  Plan plan_;

  std::string name() const override { return "FlashDoraComposeBackward"; }

  // (a, inner), after the checks the Python path makes.
  std::pair<at::Tensor, at::Tensor> unpack_saved() {
    TORCH_CHECK(scales_.defined(),
                "flashdora: trying to backward through the compose a second time after its buffers were freed "
                "(specify retain_graph=True)");
    TORCH_CHECK(lora_B_._version() == b_version_,
                "flashdora: lora_B was modified by an inplace operation between the forward and the backward (version " +
                    std::to_string(b_version_) + " -> " + std::to_string(lora_B_._version()) +
                    "); the backward needs the values the forward used");
    auto self = getptr();
    return {a_.unpack(self), inner_.unpack(self)};
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(4);
    if (!grads[0].defined()) return out;
    auto [a, inner] = unpack_saved();
    at::Tensor dy = grads[0].contiguous();
    if (reinterpret_cast<uintptr_t>(dy.data_ptr()) & 15) dy = dy.clone();  // the plan's kernel assumes 16-byte alignment
    const int64_t n = dy.size(-1), t = dy.numel() / n, r = a.size(-1);
    at::Tensor gdy = at::empty_like(dy, at::MemoryFormat::Contiguous);
    at::Tensor dg_part = at::empty({plan_.n_split, n}, scales_.options());
    std::vector<Arg> args = {
        ptr(dy), ptr(inner), ptr(scales_), ptr(gdy), ptr(gdy), ptr(dg_part),
        integer(t), integer(n), integer(plan_.rows), Arg{'f', nullptr, 0, 1.0},
        integer(n), integer(n), integer(n), integer(n), integer(scales_.stride(0)),
    };
    launch(plan_, args, current_stream(dy.device()));
    if (should_compute_output(0)) out[0] = gdy;
    if (should_compute_output(3)) out[3] = plan_.n_split == 1 ? dg_part.select(0, 0) : dg_part.sum(0);
    if (should_compute_output(1) || should_compute_output(2)) {
      at::Tensor gdy2 = gdy.view({t, n});
      if (gdy2.scalar_type() != a.scalar_type()) gdy2 = gdy2.to(a.scalar_type());
      if (should_compute_output(2)) {  // s gdy^T a: [d_out, r], in a's dtype (autograd casts it to lora_B's)
        at::Tensor a2 = a.view({t, r});
        out[2] = alpha_ == 1.0 ? at::mm(gdy2.t(), a2) : at::addmm(zero_, gdy2.t(), a2, 0, alpha_);
      }
      if (should_compute_output(1)) {  // s gdy B: [T, r]
        at::Tensor b = lora_B_.scalar_type() == a.scalar_type() ? lora_B_ : lora_B_.to(a.scalar_type());
        at::Tensor da = alpha_ == 1.0 ? at::mm(gdy2, b) : at::addmm(zero_, gdy2, b, 0, alpha_);
        out[1] = da.view(a.sizes());
      }
    }
    return out;
  }

  void release_variables() override {
    a_.reset_data();
    inner_.reset_data();
    scales_.reset();
  }
};

// A node of type T with the edges and saved state both node types share (set_history hangs it on y).
template <typename T>
auto new_node(const at::Tensor& result, const at::Tensor& a, const at::Tensor& lora_B, const at::Tensor& magnitude,
              const at::Tensor& inner, const at::Tensor& scales, double alpha) {
  auto node = make_node<T>();
  node->set_next_edges(torch::autograd::collect_next_edges(result, a, lora_B, magnitude));
  node->a_ = SavedVariable(a, false);
  node->inner_ = SavedVariable(inner, false);
  node->lora_B_ = lora_B;
  node->b_version_ = lora_B._version();
  node->scales_ = scales;
  node->alpha_ = alpha;
  return node;
}

// Hang a ComposeBackward on `y` (fresh, from the fused forward kernel): its inputs are result, a, lora_B, magnitude.
void attach(at::Tensor y, const at::Tensor& result, const at::Tensor& a, const at::Tensor& lora_B,
            const at::Tensor& magnitude, const at::Tensor& inner, const at::Tensor& scales, const at::Tensor& zero,
            double alpha, int64_t function, int64_t warps, int64_t shared, int64_t block_n,
            int64_t n_split, int64_t rows, std::string types, std::vector<int64_t> keep) {
  auto node = new_node<ComposeBackward>(result, a, lora_B, magnitude, inner, scales, alpha);
  node->zero_ = zero;
  node->plan_ = Plan{function, warps, shared, block_n, n_split, rows, std::move(types), std::move(keep)};
  torch::autograd::set_history(y, node);
}

// The same node's math in ATen, no kernel: a CPU test of the node's wiring (flashdora.native's tests).
struct EagerComposeBackward : public ComposeBackward {
  variable_list apply(variable_list&& grads) override {
    variable_list out(4);
    if (!grads[0].defined()) return out;
    auto [a, inner] = unpack_saved();
    at::Tensor dy = grads[0];
    const int64_t n = dy.size(-1), t = dy.numel() / n, r = a.size(-1);
    at::Tensor d32 = dy.to(scales_.scalar_type()).reshape({t, n});
    at::Tensor gdy = (d32 * scales_.select(0, 0)).to(dy.scalar_type()).view(dy.sizes());
    if (should_compute_output(0)) out[0] = gdy;
    if (should_compute_output(3)) {
      out[3] = (d32 * inner.to(scales_.scalar_type()).reshape({t, n})).sum(0) * scales_.select(0, 2);
    }
    at::Tensor gdy2 = gdy.reshape({t, n}).to(a.scalar_type());
    if (should_compute_output(2)) out[2] = at::mm(gdy2.t(), a.reshape({t, r})) * alpha_;
    if (should_compute_output(1)) out[1] = (at::mm(gdy2, lora_B_.to(a.scalar_type())) * alpha_).view(a.sizes());
    return out;
  }
};

void attach_eager(at::Tensor y, const at::Tensor& result, const at::Tensor& a, const at::Tensor& lora_B,
                  const at::Tensor& magnitude, const at::Tensor& inner, const at::Tensor& scales, double alpha) {
  torch::autograd::set_history(y, new_node<EagerComposeBackward>(result, a, lora_B, magnitude, inner, scales, alpha));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attach", &attach, "hang the compose's C++ backward node on y (CUDA, a compiled kernel's plan)");
  m.def("attach_eager", &attach_eager, "the same node with ATen math instead of the kernel (CPU tests)");
}
