// A norm cache miss on the Triton path, in C++ (native/bridge.py `norm_scales`; kernels/norm.py
// `norm_and_scales`). Ranks up to kernels/norm_small.py's MAX_R take that file's kernel (one launch, two where it
// splits d_in); the rest take the path below.
//
// A miss of the norm cache (once per layer and optimizer step in training) costs a dozen Python-level steps around
// its six launches, host time several LoRA layer calls long (docs/host-notes.md). This is the same
// work, launch for launch, for a 16-bit weight whose cross term is one chunk (kernels/norm_gemm.py): a = A in W's
// dtype, G = a a^T and C = W a^T (cuBLAS, float32 out, in the layout the Python path timed faster), the epilogue
// kernel, then the scales kernel. Bit for bit the Python path's result (the same ops and kernels).

#include <torch/extension.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "launch.h"

namespace {

using namespace flashdora_native;

struct NormPlan {
  bool transposed = false;  // C as [r, d_out] (a W^T) rather than [d_out, r]
  int64_t block_j = 0;      // the epilogue's r-slice (grid y)
  int64_t block_m = 0;      // its tuned BLOCK_M (grid x)
  Plan epilogue, scales;
  Plan small;               // kernels/norm_small.py's kernel (block_m: its tuned BLOCK_M; n_split: its d_in splits)
  Plan small_scales;        // with several splits, the scales kernel that adds their partial sums
  int64_t small_chunk = 0;  // the columns of one split
  int64_t misses = 0;       // calls that found no plan (function 0)
};

std::map<std::vector<int64_t>, NormPlan>& norm_plans() {
  static auto* table = new std::map<std::vector<int64_t>, NormPlan>();  // (never freed, as `plans`)
  return *table;
}

// Everything the two kernels' compiled forms and launch grids depend on, besides pointer alignment (checked).
std::vector<int64_t> norm_key(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                              const at::Tensor& magnitude) {
  return {weight.get_device(), weight.size(0), weight.size(1), lora_A.size(0),
          static_cast<int64_t>(weight.scalar_type()), static_cast<int64_t>(lora_A.scalar_type()),
          static_cast<int64_t>(lora_B.scalar_type()), static_cast<int64_t>(magnitude.scalar_type()),
          lora_B.stride(0), lora_B.stride(1), weight.stride(0), weight.stride(1), lora_A.stride(0),
          lora_A.stride(1)};
}

constexpr int64_t kChunkElements = 16 * 1024 * 1024;  // kernels/norm_gemm.py _CHUNK_ELEMENTS
constexpr int64_t kScalesBlock = 1024;                // kernels/scales.py SCALES_BLOCK

// The epilogue and the scales kernel from C = W a^T and G = a a^T: (norm, scales).
py::object finish(const NormPlan& plan, const at::Tensor& c, int64_t stride_cm, int64_t stride_cj,
                  const at::Tensor& g, const at::Tensor& lora_B, const at::Tensor& m, const at::Tensor& w_sq,
                  double scaling, void* stream) {
  const int64_t d_out = lora_B.size(0), r = lora_B.size(1);
  const int64_t n_part = cdiv(r, plan.block_j);
  at::Tensor part = at::empty({n_part, d_out}, w_sq.options());
  launch(plan.epilogue,
         {ptr(c), ptr(lora_B), ptr(g), ptr(w_sq), ptr(part), integer(d_out), integer(r),
          Arg{'f', nullptr, 0, 2.0 * scaling}, Arg{'f', nullptr, 0, scaling * scaling}, integer(stride_cm),
          integer(stride_cj), integer(lora_B.stride(0)), integer(lora_B.stride(1)), integer(part.stride(0))},
         cdiv(d_out, plan.block_m), cdiv(r, plan.block_j), stream);
  at::Tensor both = at::empty({4, d_out}, w_sq.options());
  at::Tensor norm = both.select(0, 0), scales = both.narrow(0, 1, 3);
  launch(plan.scales,
         {ptr(part), ptr(m), ptr(norm), ptr(scales), integer(n_part), integer(d_out), integer(scales.stride(0))},
         cdiv(d_out, kScalesBlock), 1, stream);
  return py::make_tuple(norm, scales);
}

// kernels/norm_small.py `norm_and_scales`: one launch writes the norm and the scales, or (d_in split) one writes
// the partial sums and the scales kernel adds them.
py::object norm_scales_small(const NormPlan& plan, const at::Tensor& weight, const at::Tensor& lora_A,
                             const at::Tensor& lora_B, const at::Tensor& m, const at::Tensor& w_sq, double scaling) {
  if (!aligned(weight) || !aligned(lora_A)) return py::none();
  const int64_t d_out = weight.size(0), d_in = weight.size(1), r = lora_A.size(0);
  const int64_t n_split = plan.small.n_split;
  at::Tensor both = at::empty({4, d_out}, w_sq.options());
  at::Tensor norm = both.select(0, 0), scales = both.narrow(0, 1, 3);
  at::Tensor part = n_split > 1 ? at::empty({n_split, d_out}, w_sq.options()) : norm;
  void* stream = current_stream(weight.device());
  launch(plan.small,
         {ptr(weight), ptr(lora_A), ptr(lora_B), ptr(w_sq), ptr(m), ptr(norm), ptr(scales), ptr(part),
          integer(d_out), integer(d_in), integer(r), Arg{'f', nullptr, 0, 2.0 * scaling},
          Arg{'f', nullptr, 0, scaling * scaling}, integer(plan.small_chunk), integer(weight.stride(0)),
          integer(weight.stride(1)), integer(lora_A.stride(0)), integer(lora_A.stride(1)), integer(lora_B.stride(0)),
          integer(lora_B.stride(1)), integer(scales.stride(0))},
         cdiv(d_out, plan.small.block_m), n_split, stream);
  if (n_split > 1) {
    launch(plan.small_scales,
           {ptr(part), ptr(m), ptr(norm), ptr(scales), integer(n_split), integer(d_out), integer(scales.stride(0))},
           cdiv(d_out, kScalesBlock), 1, stream);
  }
  return py::make_tuple(norm, scales);
}

// The checks on the adapters and ||W||^2; the contiguous magnitude, or an undefined tensor.
at::Tensor checked_magnitude(const at::Tensor& lora_A, const at::Tensor& lora_B, const at::Tensor& magnitude,
                             const at::Tensor& w_sq) {
  if (lora_A.dim() != 2 || lora_B.dim() != 2 || magnitude.dim() != 1) return at::Tensor();
  for (const at::Tensor* p : {&lora_A, &lora_B, &magnitude}) {
    if (p->scalar_type() == at::kDouble) return at::Tensor();
  }
  if (w_sq.scalar_type() != at::kFloat || w_sq.dim() != 1 || w_sq.stride(0) != 1 || !aligned(w_sq) ||
      !aligned(lora_B)) {
    return at::Tensor();
  }
  at::Tensor m = magnitude.contiguous();
  return aligned(m) ? m : at::Tensor();
}

// (norm, scales) as kernels/norm.py `norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, w_sq=w_sq)`
// returns them; None where this is not a call it takes; False where it has no plan for it yet (the Python path
// runs, then files one). The checks come before any work.
py::object norm_scales(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                       const at::Tensor& magnitude, const at::Tensor& w_sq, double scaling, int64_t max_small_r) {
  if (!weight.is_cuda() || weight.dim() != 2) return py::none();
  const auto wt = weight.scalar_type();
  if (wt != at::kHalf && wt != at::kBFloat16) return py::none();
  const at::Tensor m = checked_magnitude(lora_A, lora_B, magnitude, w_sq);
  if (!m.defined()) return py::none();
  const int64_t d_out = weight.size(0), d_in = weight.size(1), r = lora_A.size(0);
  if (d_out == 0 || d_in == 0 || r == 0 || d_out > kChunkElements / r || d_out % 4 != 0) return py::none();
  const auto a_type = lora_A.scalar_type();
  const bool small = r <= max_small_r && (a_type == at::kHalf || a_type == at::kBFloat16 || a_type == at::kFloat);
  NormPlan& plan = norm_plans()[norm_key(weight, lora_A, lora_B, magnitude)];
  if ((small ? plan.small : plan.epilogue).function == 0) {
    if (++plan.misses > kMaxMisses) return py::none();
    return py::bool_(false);
  }
  if (small) return norm_scales_small(plan, weight, lora_A, lora_B, m, w_sq, scaling);

  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // explicit dtypes throughout
  void* stream = current_stream(weight.device());
  const at::Tensor a = lora_A.to(wt);
  const at::Tensor g = at::mm(a, a.t(), at::kFloat);
  const at::Tensor c = plan.transposed ? at::mm(a, weight.t(), at::kFloat) : at::mm(weight, a.t(), at::kFloat);
  const int64_t stride_cm = plan.transposed ? 1 : c.stride(0), stride_cj = plan.transposed ? c.stride(0) : 1;
  return finish(plan, c, stride_cm, stride_cj, g, lora_B, m, w_sq, scaling, stream);
}

// bitsandbytes' dequantization kernels, as its library exports them (csrc/pythonInterface.cpp there).
using DequantFn = void (*)(float* code, unsigned char* a, float* absmax, void* out, int blocksize, int n,
                           void* stream);

// A 4-bit weight as `bitsandbytes.functional.dequantize_4bit` makes it: the same kernels of bitsandbytes' own library,
// in the same order (the nested absmax's blockwise dequantization, `+= offset`, the 4-bit dequantization), so the
// same bits, without the Python around them (native/bridge.py `dequantize_4bit` passes the kernels' addresses).
// None where it does not take the call (the Python function runs).
py::object dequantize_4bit(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                           std::vector<int64_t> shape, c10::ScalarType dtype, int64_t fn_4bit,
                           const std::optional<at::Tensor>& code2, const std::optional<at::Tensor>& absmax2,
                           const std::optional<at::Tensor>& offset, int64_t blocksize2, int64_t fn_blockwise) {
  const c10::Device device = packed.device();
  if (!packed.is_cuda() || packed.scalar_type() != at::kByte || !packed.is_contiguous() || fn_4bit == 0) {
    return py::none();
  }
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (numel <= 0 || numel > INT32_MAX || absmax.device() != device || !absmax.is_contiguous()) return py::none();
  const bool nested = code2.has_value();
  if (nested) {
    if (!absmax2 || !offset || fn_blockwise == 0 || absmax.scalar_type() != at::kByte ||
        code2->device() != device || absmax2->device() != device || offset->device() != device ||
        code2->scalar_type() != at::kFloat || absmax2->scalar_type() != at::kFloat || !code2->is_contiguous() ||
        !absmax2->is_contiguous() || absmax.numel() > INT32_MAX) {
      return py::none();
    }
  } else if (absmax.scalar_type() != at::kFloat) {
    return py::none();
  }
  const c10::DeviceGuard on_device(device);  // (bitsandbytes launches on the current device)
  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  void* stream = current_stream(device);
  at::Tensor amax = absmax;
  if (nested) {  // dequantize_blockwise(absmax, state2) into float32, then += offset
    amax = at::empty_like(absmax, absmax.options().dtype(at::kFloat));
    reinterpret_cast<DequantFn>(fn_blockwise)(code2->data_ptr<float>(), absmax.data_ptr<uint8_t>(),
                                               absmax2->data_ptr<float>(), amax.data_ptr(),
                                               static_cast<int>(blocksize2), static_cast<int>(absmax.numel()), stream);
    amax.add_(*offset);
  }
  at::Tensor out = at::empty(shape, packed.options().dtype(dtype));
  reinterpret_cast<DequantFn>(fn_4bit)(nullptr, packed.data_ptr<uint8_t>(), amax.data_ptr<float>(), out.data_ptr(),
                                       static_cast<int>(blocksize), static_cast<int>(numel), stream);
  return py::cast(out);
}

// File the plan of `norm_scales` for layers like this one (native/plans.py `norm_gemm_miss`).
void register_norm(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                   const at::Tensor& magnitude, bool transposed, int64_t block_j, int64_t block_m,
                   int64_t e_function, int64_t e_warps, int64_t e_shared, std::string e_types,
                   std::vector<int64_t> e_keep, int64_t s_function, int64_t s_warps, int64_t s_shared,
                   std::string s_types, std::vector<int64_t> s_keep) {
  TORCH_CHECK(e_function != 0 && s_function != 0, "flashdora.native: register_norm needs loaded kernels");
  TORCH_CHECK(block_j > 0 && block_m > 0, "flashdora.native: register_norm needs positive blocks");
  NormPlan& plan = norm_plans()[norm_key(weight, lora_A, lora_B, magnitude)];
  plan.transposed = transposed;
  plan.block_j = block_j;
  plan.block_m = block_m;
  plan.epilogue = Plan{e_function, e_warps, e_shared, 0, 0, 1, std::move(e_types), std::move(e_keep)};
  plan.scales = Plan{s_function, s_warps, s_shared, 0, 0, 1, std::move(s_types), std::move(s_keep)};
}

// File the plan of `norm_scales` for small ranks (native/plans.py `norm_small_miss`).
void register_norm_small(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                         const at::Tensor& magnitude, int64_t block_m, int64_t n_split, int64_t chunk,
                         int64_t function, int64_t warps, int64_t shared, std::string types, std::vector<int64_t> keep,
                         int64_t s_function, int64_t s_warps, int64_t s_shared, std::string s_types,
                         std::vector<int64_t> s_keep) {
  TORCH_CHECK(function != 0 && block_m > 0, "flashdora.native: register_norm_small needs a loaded kernel");
  TORCH_CHECK(n_split >= 1 && chunk > 0, "flashdora.native: register_norm_small needs a positive split");
  TORCH_CHECK(n_split == 1 || s_function != 0, "flashdora.native: register_norm_small needs the scales kernel");
  NormPlan& plan = norm_plans()[norm_key(weight, lora_A, lora_B, magnitude)];
  plan.small = Plan{function, warps, shared, block_m, 0, n_split, std::move(types), std::move(keep)};
  plan.small_scales = Plan{s_function, s_warps, s_shared, 0, 0, 1, std::move(s_types), std::move(s_keep)};
  plan.small_chunk = chunk;
}

}  // namespace

namespace flashdora_native {

void add_norm(pybind11::module_& m) {
  m.def("norm_scales", &norm_scales,
        "a norm cache miss's (norm, scales) on the Triton path: a tuple, None (not taken) or False (no plan yet)");
  m.def("register_norm", &register_norm, "file norm_scales' launch plans for layers like this one");
  m.def("register_norm_small", &register_norm_small, "file norm_scales' small-rank kernel for layers like this one");
  m.def("dequantize_4bit", &dequantize_4bit,
        "a bitsandbytes 4-bit weight dequantized by bitsandbytes' own kernels: a tensor, or None (not taken)");
}

}  // namespace flashdora_native
