// What compose.cpp (the compose's C++ forward and node) and layer.cpp (the whole layer in one call) share: the
// compose's backward node, its launch plans by key, and the forward kernel's launch.

#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>

#include "launch.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace flashdora_native {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// kernels/compose.py CAST_B_FIRST, CAST_B_WORK and kernels/configs.py FUSED_SMALL_R (tests/ops/test_native.py checks)
constexpr int64_t kCastBFirst = 8 * (1 << 20);
constexpr int64_t kCastBWork = 2147483648;  // 2^31
constexpr int64_t kFusedSmallR = 32;

// kernels/compose.py `cast_b_first`: the fused forward over `t` tokens gets lora_B cast to the matmul dtype `cd` in
// one pass first, rather than in its registers.
inline bool cast_b_first(const at::Tensor& lora_B, int64_t t, c10::ScalarType cd) {
  return lora_B.scalar_type() != cd &&
         (lora_B.numel() >= kCastBFirst || (t * lora_B.numel() >= kCastBWork && lora_B.size(-1) > kFusedSmallR));
}

// Whether a node keeps the forward's casts of lora_A and lora_B to the matmul dtype (r x d_in, d_out x r) for its
// backward instead of casting them again there: above rank kKeepCastsAboveR, where the casts' GPU time counts (below
// it a cast takes a microsecond or two, and under checkpointing the saved-tensor hooks of a kept one cost the host
// about what the cast launch they spare does), and where they add at most about a quarter to the
// [T, r + d_out (+ d_in)] the node saves anyway (4 r <= T). PEFT LoRA's matmul nodes keep theirs at any rank and T.
// `a`: the LoRA A output, [..., r] over T tokens.
constexpr int64_t kKeepCastsAboveR = 32;
inline bool keep_casts(const at::Tensor& a) {
  const int64_t r = a.size(-1);
  return r > kKeepCastsAboveR && 4 * r <= a.numel() / r;
}

// An adapter weight in the matmul dtype `type`: the parameter itself where it has that dtype, else the forward's
// kept cast (`keep_casts`; undefined when none was kept), else a new cast.
inline at::Tensor in_dtype(const at::Tensor& weight, const at::Tensor& kept, c10::ScalarType type) {
  if (weight.scalar_type() == type) return weight;
  return kept.defined() && kept.scalar_type() == type ? kept : weight.to(type);
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

// The eager path's 0-dim zero for addmm's ignored input, one per dtype and device.
at::Tensor zero_like(const at::Tensor& a);

// d_result, d_a, d_lora_B, d_magnitude (and d_lx_base) of `y = compose(result, a, lora_B, magnitude[, lx_base])`.
// Without lx_base: y = g (result - bias + s a B^T) + bias, d_result = g dy, s on the LoRA GEMMs' alpha. With
// dropout's lx_base = lx W^T: y = result + (g - 1) lx_base + g s a B^T, d_result = dy, d_lx_base = (g - 1) dy, and
// the LoRA GEMMs take (dy s) g, PEFT's rounding (ops/compose_fn.py `_bwd`).
struct ComposeBackward : public Node {
  SavedVariable a_, inner_;
  at::Tensor lora_B_, scales_, zero_;  // (not saved variables: no saved-tensor hooks; lora_B's version checked here)
  SavedVariable b_cast_;  // lora_B as the forward cast it to the matmul dtype (`keep_casts`), or none; saved, so that
                          // checkpointing drops it with the rest until its recomputation
  uint32_t b_version_ = 0;
  double alpha_ = 1.0;      // the LoRA GEMMs' alpha
  double gdy_scale_ = 1.0;  // the kernel's factor on dy before g
  bool lx_base_ = false;
  Plan plan_;

  std::string name() const override { return "FlashDoraComposeBackward"; }
  // (a, inner, lora_B's cast or an undefined tensor), after the checks the Python path makes.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> unpack_saved();
  // The compose-backward kernel on dy: (dy as launched, gdy, d_lx_base (gdy without lx_base), dm). Virtual: the CPU
  // tests' twins compute the same in ATen.
  virtual std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& grad,
                                                                            const at::Tensor& inner);
  // The same in ATen (the CPU tests' twins override `kernel` with it).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> eager_kernel(const at::Tensor& grad,
                                                                          const at::Tensor& inner) const;
  // s gdy B, [T, r] in a's dtype (gdy2: [T, n] in a's dtype; b_cast: lora_B's kept cast, or undefined).
  at::Tensor d_a(const at::Tensor& gdy2, c10::ScalarType type, const at::Tensor& b_cast) const;
  variable_list apply(variable_list&& grads) override;
  void release_variables() override;
};

// Every plan Python has filed, by key; a forward key seen without a plan holds a placeholder that counts misses.
std::map<std::vector<int64_t>, Plan>& plans();

// The forward kernel compiled for a call whose result is [t, n] of `out_type` on `device`: everything the
// autotuner's key, the constexpr flags and Triton's specialization depend on (all pointers 16-byte aligned: the
// callers check; `a` is a fresh [T, r] tensor).
std::vector<int64_t> fwd_key(int64_t device, int64_t t, int64_t n, c10::ScalarType out_type, int64_t r,
                             c10::ScalarType a_type, c10::ScalarType b_type, int64_t b_stride, const at::Tensor& scales,
                             const std::optional<at::Tensor>& bias, bool save_inner,
                             const std::optional<at::Tensor>& lx_base);

// The backward kernel's plan (its token split depends on T itself; dropout's lx_base adds an output).
std::vector<int64_t> bwd_key(int64_t device, int64_t t, int64_t n, c10::ScalarType out_type, const at::Tensor& scales,
                             bool has_lx_base);

enum class Found { plan, missing, given_up };

// The plan filed under `key` in `*out`; a key without one counts a miss, and is given up after kMaxMisses.
Found find_plan(std::vector<int64_t>&& key, const Plan** out);

// The plans a compose call launches, whose result is [t, n] of `out_type` and whose matmuls run in `cd`: the forward
// kernel's in `*fwd` and, in training, the backward kernel's in `*bwd` (its token split depends on T). `missing`
// where either is not filed yet (native/bridge.py `prime` files both; no miss is counted for the backward's).
Found compose_plans(int64_t device, int64_t t, int64_t n, c10::ScalarType out_type, int64_t r, c10::ScalarType cd,
                    const at::Tensor& lora_B, bool cast_b, const at::Tensor& scales,
                    const std::optional<at::Tensor>& bias, bool train, const std::optional<at::Tensor>& lx_base,
                    const Plan** fwd, const Plan** bwd);

// The fused forward kernel: y (and, in training, inner) from result, a = x A^T and b (lora_B as the kernel reads it).
void launch_forward(const Plan& plan, const at::Tensor& result, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor* lx_base, const at::Tensor* bias, const at::Tensor& scales, const at::Tensor& y,
                    const at::Tensor& inner, double scaling);

// Fill `node`'s ComposeBackward state (not its edges). `b`: lora_B as the forward kernel read it (a cast copy, kept
// for the backward where `keep_casts` says so; lora_B itself otherwise).
void fill_node(ComposeBackward& node, const at::Tensor& a, const at::Tensor& lora_B, const at::Tensor& inner,
               const at::Tensor& scales, double scaling, bool lx_base, const at::Tensor& b);

}  // namespace flashdora_native
