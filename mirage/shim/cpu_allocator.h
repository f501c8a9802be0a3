// The CPU allocator beside the emulated device. A device kernel runs as PyTorch's CPU kernel,
// whose results (device memory once the op path adopts them) and scratch come from the CPU
// allocator; on a GPU box neither is this process's CPU memory, so torch.profiler
// (profile_memory=True) must not be told of them as CPU allocations, as torch's CPU allocator
// tells it of every allocation. While a device kernel runs on a thread (DeviceKernelRunning),
// its CPU allocations are made without that report; all others are torch's own.
#pragma once

namespace mirage {

inline thread_local int tl_device_kernels_running = 0;

struct DeviceKernelRunning {
  DeviceKernelRunning() { ++tl_device_kernels_running; }
  ~DeviceKernelRunning() { --tl_device_kernels_running; }
  DeviceKernelRunning(const DeviceKernelRunning&) = delete;
  DeviceKernelRunning& operator=(const DeviceKernelRunning&) = delete;
};

}  // namespace mirage
