// A GPU kernel that mirage computes as several ATen ops on the device, timed and profiled as
// the one kernel it is: register `AsOneKernel<name, &fn>::call` for the operator (explicit and
// CUDA-only kernels; the op path's own way for a host composite is fallback_on_host).
#pragma once

#include "device_clock.h"
#include "graph_capture.h"
#include "op_cost.h"
#include "profiler_activities.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

namespace mirage {

// What a kernel moves: the bytes of the tensors it takes and returns (scalars, absent tensors none).
inline int64_t moved(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.numel() * t.itemsize()) : 0; }
inline int64_t moved(const std::optional<at::Tensor>& t) { return t ? moved(*t) : 0; }
template <typename... T>
int64_t moved(const std::tuple<T...>& t) {
  return std::apply([](const auto&... each) { return (int64_t{0} + ... + moved(each)); }, t);
}
template <typename T>
int64_t moved(const T&) {
  return 0;
}
inline const at::Tensor* defined_tensor(const at::Tensor& t) { return t.defined() ? &t : nullptr; }
inline const at::Tensor* defined_tensor(const std::optional<at::Tensor>& t) { return t && t->defined() ? &*t : nullptr; }
template <typename T>
const at::Tensor* defined_tensor(const T&) {
  return nullptr;
}

// One GPU kernel (CUDA's fused_dropout_kernel, batch_norm_collect_statistics_kernel,
// lstm_cell_forward, ...) that `fn` computes as several ATen ops on the device: in
// clocked mode it is timed as that one kernel moving its operands and results, and torch.profiler
// shows that one kernel, as a GPU's does. A result that is an argument (an out= variant) is
// counted once. A CUDA graph capture records the ops one by one for its replays.
template <const char* name, auto fn>
struct AsOneKernel;
template <const char* name, typename R, typename... A, R (*fn)(A...)>
struct AsOneKernel<name, fn> {
  static R call(A... args) {
    const at::Tensor* first = nullptr;
    ((first = first ? first : defined_tensor(args)), ...);
    if (first == nullptr || capturing()) return fn(args...);
    const DeviceIndex dev = first->device().index();
    const at::ScalarType dtype = first->scalar_type();
    KernelScope kernel;
    const HostTimedFusedKernel profiled(kernel, name, dev, dtype);
    R result = fn(args...);
    if (timing() && kernel.outermost) {
      int64_t bytes = (int64_t{0} + ... + moved(args));
      if constexpr (!std::is_reference_v<R>) bytes += moved(result);
      clock_memory_kernel(name, dev, bytes, dtype);
    }
    return result;
  }
};

}  // namespace mirage
