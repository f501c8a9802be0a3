// The checks NCCL makes of a call's arguments, with ProcessGroupNCCL's error messages, and the
// small facts they rest on (which library this is, which dtypes NCCL has). The checks the ranks
// make of each other's calls (desyncs) are the transports' (transport.h: check_calls_match).
#pragma once

#include "transport.h"

#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <string>

namespace mirage::nccl {

// An environment flag as torch reads TORCH_NCCL_*: unset or empty gives `fallback`; "0" and
// "false" are off.
bool env_flag(const char* name, bool fallback);
int env_int(const char* name, int fallback);

// "RCCL" on an AMD profile (MIRAGE_VENDOR=amd), else "NCCL": what error messages name.
const char* library();

// ProcessGroupNCCL's checkSingleTensor: CUDA, dense, contiguous, a dtype NCCL has.
void check_tensor(const at::Tensor& t);

// Complex tensors travel as their real views (NCCL has no complex type).
inline at::Tensor as_real(const at::Tensor& t) { return t.is_complex() ? at::view_as_real(t) : t; }

inline int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.numel() * t.element_size()); }

// NCCL's reduce op for `op` on `t`'s dtype (ProcessGroupNCCL's getNcclReduceOp and its errors).
Reduction reduction_of(const c10d::ReduceOp& op, const at::Tensor& t);

}  // namespace mirage::nccl
