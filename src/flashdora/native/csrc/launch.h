// What flashdora.native's C++ files share: a compiled Triton kernel's launch plan, filed from Python, and its launch
// through the driver's cuLaunchKernel (no link against CUDA: the extension builds against any torch).

#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace flashdora_native {

// cuLaunchKernel, from the driver torch has loaded (no link against CUDA: this file builds against any torch).
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);

inline void* libcuda() {
  static void* lib = [] {
    void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return handle == nullptr ? dlopen("libcuda.so.1", RTLD_NOW) : handle;
  }();
  return lib;
}

inline void* driver_symbol(const char* name) { return libcuda() == nullptr ? nullptr : dlsym(libcuda(), name); }

inline LaunchFn launch_fn() {
  static LaunchFn fn = reinterpret_cast<LaunchFn>(driver_symbol("cuLaunchKernel"));
  return fn;
}

// Make the current device's primary context current on this thread where no context is. The CUDA runtime does it
// lazily, at a thread's first runtime call; the autograd engine's device thread can reach a node of ours before any
// (a backward that starts at a flashdora layer's output), and the driver's cuLaunchKernel then finds no context
// (CUresult 201). cuCtxGetCurrent is the whole cost of every other launch.
inline void ensure_context() {
  using GetFn = int (*)(void**);
  using DeviceFn = int (*)(int*, int);
  using RetainFn = int (*)(void**, int);
  using SetFn = int (*)(void*);
  static GetFn get = reinterpret_cast<GetFn>(driver_symbol("cuCtxGetCurrent"));
  void* ctx = nullptr;
  if (get == nullptr || get(&ctx) != 0 || ctx != nullptr) return;
  static DeviceFn device_get = reinterpret_cast<DeviceFn>(driver_symbol("cuDeviceGet"));
  static RetainFn retain = reinterpret_cast<RetainFn>(driver_symbol("cuDevicePrimaryCtxRetain"));
  static SetFn set = reinterpret_cast<SetFn>(driver_symbol("cuCtxSetCurrent"));
  TORCH_CHECK(device_get != nullptr && retain != nullptr && set != nullptr,
              "flashdora.native: the CUDA driver's context functions were not found in libcuda.so.1");
  const int index = static_cast<int>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index());
  int device = 0;
  TORCH_CHECK(device_get(&device, index) == 0 && retain(&ctx, device) == 0 && set(ctx) == 0,
              "flashdora.native: could not make CUDA device " + std::to_string(index) + "'s context current");
}

// One compiled Triton kernel and its tuned blocks: what Triton's launcher would pass it, decided in Python
// (native/plans.py: compose_fwd, compose_bwd).
struct Plan {
  int64_t function = 0;     // CUfunction
  int64_t warps = 4;
  int64_t shared = 0;       // dynamic shared memory, bytes
  int64_t block_m = 0;      // forward: the tuned BLOCK_M (grid x = cdiv(T, BLOCK_M)); backward: tokens per program
  int64_t block_n = 0;      // the tuned BLOCK_N (grid y = cdiv(N, BLOCK_N))
  int64_t n_split = 1;      // backward: grid x, token ranges, each one partial sum row of dm
  std::string types;        // per kernel parameter passed: 'O' pointer, 'i' i32, 'l' i64, 'f' f32 (then padding)
  std::vector<int64_t> keep;  // which arguments are parameters (the rest Triton folded into constants)
  int64_t misses = 0;       // a placeholder (function 0): calls that found no plan under its key
};

// A kernel argument before packing: a pointer, an integer or a float.
struct Arg {
  char kind;
  void* ptr;
  int64_t i;
  double f;
};

// The current stream of `device` (the autograd engine sets it to the forward's for this node), as a cudaStream_t.
inline void* current_stream(const c10::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

inline void launch(const Plan& plan, const std::vector<Arg>& args, int64_t grid_x, int64_t grid_y, void* stream) {
  LaunchFn fn = launch_fn();
  TORCH_CHECK(fn != nullptr, "flashdora.native: cuLaunchKernel not found in libcuda.so.1");
  ensure_context();
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
  int rc = fn(reinterpret_cast<void*>(plan.function), static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y), 1,
              static_cast<unsigned>(32 * plan.warps), 1, 1, static_cast<unsigned>(plan.shared),
              stream, params.data(), nullptr);
  TORCH_CHECK(rc == 0, "flashdora.native: cuLaunchKernel failed with CUresult " + std::to_string(rc));
}

inline bool aligned(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline Arg ptr(const at::Tensor& t) { return Arg{'O', t.data_ptr(), 0, 0.0}; }
inline Arg integer(int64_t v) { return Arg{'i', nullptr, v, 0.0}; }

// What Triton specializes a compiled kernel on for an integer argument (kernels/launcher.py `_specialization`).
inline int64_t spec(int64_t v) { return ((v & 15) == 0) + 2 * (v == 1) + 4 * (v >= INT32_MIN && v <= INT32_MAX); }

// A key (a forward's, a norm's) still without a plan after this many calls: left to the Python path.
constexpr int kMaxMisses = 64;

}  // namespace flashdora_native
