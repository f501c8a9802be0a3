// Same-host shared-memory all-reduce for emulated NCCL (implementation: shm_allreduce.cpp).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>

namespace mirage::shm {

// All-reduces `numel` elements of `dtype` at `data` (host memory, dense) in place across the
// ranks of `pg`. Returns false, having done nothing, when the shared-memory path does not apply
// to this group or this call (the caller then uses the group's gloo backend); every rank of the
// group reaches the same answer. Throws DistBackendError naming `what` and the missing ranks
// when the peers do not arrive within `timeout`.
bool all_reduce(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* data, int64_t numel, at::ScalarType dtype,
                c10d::ReduceOp::RedOpType op, std::chrono::milliseconds timeout, const std::string& what);

// Drops this process's state for the group named `group_name` (its segment mapping); called
// when Python destroys the group, before its address can hold another group.
void forget_process_group(const std::string& group_name);

}  // namespace mirage::shm
