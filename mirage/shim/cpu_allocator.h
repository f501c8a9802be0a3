// The CPU allocator beside the emulated device. A device kernel runs as PyTorch's CPU kernel,
// whose results (device memory once the op path adopts them) and scratch come from the CPU
// allocator; on a GPU box neither is this process's CPU memory, so torch.profiler
// (profile_memory=True) must not be told of them as CPU allocations, as torch's CPU allocator
// tells it of every allocation. While a device kernel runs on a thread (DeviceKernelRunning),
// its CPU allocations are made without that report; all others are torch's own.
//
// Those allocations' bytes, and device blocks' under 1 MiB, come from a cache of freed host
// bytes (host_bytes_take / host_bytes_give) rather than straight from malloc. glibc serves a
// 64-byte-aligned block over 1 KiB (past its per-thread cache; a 32 x 64 float result is 8 KiB)
// from its arena: memalign's slow path, the arena's lock, its bins and their consolidation on
// every free, and memory that is not the block just freed. A small-op step allocates and frees
// thousands of them; the cache hands back the block of that size freed last, on any thread, as
// the GPU caching allocator reuses device memory.
#pragma once

#include <cstddef>

namespace mirage {

inline thread_local int tl_device_kernels_running = 0;

struct DeviceKernelRunning {
  DeviceKernelRunning() { ++tl_device_kernels_running; }
  ~DeviceKernelRunning() { --tl_device_kernels_running; }
  DeviceKernelRunning(const DeviceKernelRunning&) = delete;
  DeviceKernelRunning& operator=(const DeviceKernelRunning&) = delete;
};

// At least `nbytes` of host memory, 64-byte aligned: a cached block of the smallest size class
// that holds it, else a fresh one (c10::alloc_cpu) of that class's size.
void* host_bytes_take(size_t nbytes);
// Returns memory from host_bytes_take or c10::alloc_cpu: kept for reuse while the cache holds
// under its bound (16 MiB) and the block is at most 1 MiB, otherwise freed.
void host_bytes_give(void* data);
// Frees every cached block (torch.cuda.empty_cache: the cached memory goes back).
void host_bytes_release();

}  // namespace mirage
