// CUDA graphs: as on a GPU, work issued while a graph is being captured is recorded, not run, and
// a replay runs the record again (graph_capture.cpp says how).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace mirage {

extern std::atomic<int64_t> g_capturing;  // the graph being captured, 0 if none

inline bool capturing() { return g_capturing.load(std::memory_order_relaxed) != 0; }

// What a GPU refuses while capturing (host copies, synchronisation, data-dependent shapes).
[[noreturn]] void refuse_during_capture();
// What a captured graph keeps of a tensor (private-pool memory is referred to, not owned).
at::Tensor graph_reference(const at::Tensor& t);
// Appends a step to the graph being captured.
void record_step(std::function<void()> step);
// The op's results without running it: its Meta kernel's shapes, fresh results allocated on the
// device (contents undefined) and aliases of arguments mapped back to them; `fresh` receives the
// fresh ones with their positions. For a capture, what a GPU refuses raises CUDA's error; else
// (clocked mode's --predict-only) an op that needs its data returns false, its arguments intact.
bool run_on_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool capture,
                 std::vector<std::pair<at::Tensor, size_t>>* fresh);
// Records one op issued during capture and leaves its (not yet computed) results on the stack.
void capture_op(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace mirage
