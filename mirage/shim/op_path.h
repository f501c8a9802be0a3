// The op path (op_path.cpp): every operator on a device tensor without a kernel of its own
// passes `fallback`, which runs PyTorch's CPU kernel on CPU views of the device memory and
// re-labels the results as device memory; the observers of device work (memory accounting,
// busy time, graph capture, the device clock) hook in there.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace mirage {

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

// The host side of an operator a CUDA build has a CUDA kernel for and a CPU build has no CPU
// kernel for (cuda_only_kernels.cpp): it takes the op's arguments from the stack (CPU views of
// the device tensors) and pushes its results, as a boxed CPU kernel would.
using HostKernel = void (*)(torch::jit::Stack* stack);

// `fallback` with `host` in place of the CPU build's kernel, so that such an op is still one
// kernel of the op path: one op on the timeline, in the memory model and in the profiler, as on
// a GPU.
void fallback_on_host(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack,
                      HostKernel host);

// Applies `fn` to every tensor of a Tensor[] or Tensor[][] value, in place.
template <class Fn>
inline void map_tensor_lists(c10::IValue& iv, Fn&& fn) {
  if (iv.isTensorList()) {
    auto list = iv.toTensorList();
    for (size_t j = 0; j < list.size(); ++j) list[j] = fn(list[j]);
    iv = std::move(list);
  } else if (iv.isList()) {
    auto outer = iv.toList();
    for (size_t j = 0; j < outer.size(); ++j) {
      c10::IValue inner = outer.get(j);
      if (!inner.isTensorList()) return;
      map_tensor_lists(inner, fn);
      outer.set(j, std::move(inner));
    }
  }
}

}  // namespace mirage
