// Faults on purpose (mirage run --fault / --faults): the shim's half. The launcher checks every
// spec and hands each process the list in MIRAGE_FAULTS; a fault whose rank is this process's
// RANK (a kill-node fault: whose node is this process's and this process its local rank 0)
// fires at its trigger, once per session (a marker file in the session's runtime folder
// claims it, so a worker torchrun restarts does not fire it again). Triggers counted here: the
// process's Nth device op (op path), Nth device allocation (the allocator), Nth collective (the
// emulated NCCL asks through mirage_fault_at_collective). Every fault that fires is logged on
// stderr with rank, trigger and time, and its marker is what the session summary lists.
// A lost GPU (lose-gpu) stays lost for the process: every later op, allocation, copy and
// synchronisation raises what CUDA (HIP) raises for a GPU that fell off the bus, and the emulated
// NCCL fails its collectives as NCCL does (mirage_device_lost).
#pragma once
#include <c10/core/Device.h>
#include <atomic>
#include <cstddef>
#include <string>

namespace mirage {

// Whether this process has an op- or allocation-triggered fault (read on the hot paths).
extern std::atomic<bool> g_fault_ops, g_fault_allocs;

// Reads MIRAGE_FAULTS (once, as the shim loads).
void faults_loaded();
// The op path's count: kills the process at the fault's op (or loses its GPU); on a lost GPU, raises.
void fault_at_op();
// Raises torch.AcceleratorError ("CUDA error: unknown error") once this process's GPU is lost,
// ("CUDA error: device-side assert triggered") once a kernel's device-side assert fired.
void check_device_not_lost();
// A kernel's device-side assert (an index out of bounds that a CUDA kernel checks on the device):
// prints `what` on stderr as the kernel's assertion is printed, and from then on, as on a GPU,
// every device op, allocation, synchronisation and collective of the process raises
// "CUDA error: device-side assert triggered" (this call first).
[[noreturn]] void device_side_assert(const std::string& what);
// The allocator's count: raises the caching allocator's out-of-memory error at the fault's
// allocation (as a real OOM on that one rank), through `raise_oom(dev, bytes)`.
void fault_at_alloc(c10::DeviceIndex dev, size_t nbytes, void (*raise_oom)(c10::DeviceIndex, int64_t));

}  // namespace mirage

extern "C" {
// The emulated NCCL's count, called as each collective starts: kills the process at a kill
// fault's collective, has the launcher kill its node at a kill-node fault's (and does not
// return), loses its GPU at a lose-gpu fault's; returns the milliseconds a stall
// fault holds this collective (0: none).
int64_t mirage_fault_at_collective();
// Whether a lose-gpu fault took this process's GPU.
bool mirage_device_lost();
// Records, for the session summary, an error this rank saw (the emulated NCCL's failures); a
// no-op outside a session with faults.
void mirage_fault_observed(const char* error);
}
