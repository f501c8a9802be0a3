// PyTorch's GPU trace (c10::impl::GPUTrace): what CUDA's runtime wrappers report to the
// callbacks of torch.cuda._gpu_trace (event creation, record, wait and synchronisation, stream
// creation and synchronisation, device synchronisation, memory allocation and release). The
// CUDA Sanitizer subscribes to them to know which streams are ordered; the emulated device
// reports the same events at the same places, with its stream ids as the stream handles (what
// `torch.cuda.Stream.cuda_stream` gives).
#pragma once

#include <c10/core/impl/GPUTrace.h>

#include <cstdint>

namespace mirage {

// The interpreter to report to, or nullptr while no one traces (one atomic load).
inline const c10::impl::PyInterpreter* gpu_trace() { return c10::impl::GPUTrace::get_trace(); }

inline uintptr_t trace_handle(const void* p) { return reinterpret_cast<uintptr_t>(p); }

}  // namespace mirage
