// Same-host shared-memory collectives for emulated NCCL (implementation: shm_collectives.cpp).
//
// Each call works on host memory (the device tensors' bytes, dense) and returns false, having
// done nothing, when the shared-memory path does not apply to this group or call; the caller then
// uses the group's gloo backend, and every rank of the group reaches the same answer. Counts are
// elements per rank. A peer that does not arrive within `timeout`, or that asked for a different
// call, raises DistBackendError naming `what` and the ranks concerned.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>

namespace mirage::shm {

// In place: data = the reduction over ranks of their data.
bool all_reduce(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* data, int64_t numel, at::ScalarType dtype,
                c10d::ReduceOp::RedOpType op, std::chrono::milliseconds timeout, const std::string& what);

// out (size x numel) = every rank's in (numel), in rank order.
bool all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* out, const void* in, int64_t numel,
                at::ScalarType dtype, std::chrono::milliseconds timeout, const std::string& what);

// out (numel) = the reduction over ranks of their in[rank * numel ...] (in: size x numel).
bool reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* out, const void* in, int64_t numel,
                    at::ScalarType dtype, c10d::ReduceOp::RedOpType op, std::chrono::milliseconds timeout,
                    const std::string& what);

// In place: data = root's data.
bool broadcast(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* data, int64_t numel, at::ScalarType dtype,
               int root, std::chrono::milliseconds timeout, const std::string& what);

// The collectives this process's threads are sleeping in, as a JSON list of {group, seq (the
// call's number in its group), name, dtype, numel, waited_ms, missing (group ranks that have not
// arrived)}: what the runtime's hang watch reports to the flight recorder.
std::string waits_json();

// Drops this process's state for the group named `group_name` (its segment mapping); called
// when Python destroys the group, before its address can hold another group.
void forget_process_group(const std::string& group_name);

}  // namespace mirage::shm
