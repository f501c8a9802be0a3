// torch.profiler's GPU side (ProfilerActivity.CUDA): what a CUDA build's Kineto gets from CUPTI
// (kernels, memcpys and their launches on the CPU thread, linked by correlation IDs), the shim
// hands to Kineto through its plugin interface (libkineto's IActivityProfiler), from the two
// choke points: every interval placed on the predicted timeline in clocked mode (device_clock.cpp
// keep()), every kernel the op path and the emulated NCCL run otherwise, at this host's times.
#pragma once

#include "device_clock.h"
#include "device_guard.h"

#include <atomic>
#include <cstdint>

namespace mirage {

// Whether a profiling session with GPU activity is recording (one relaxed load on the op path).
inline std::atomic<bool> g_profiling_device{false};
inline bool profiling_device() { return g_profiling_device.load(std::memory_order_relaxed); }

// The CUDA runtime calls this process's launches made so far, counted where the op path and
// the timeline see each kernel and copy: the correlation IDs of the activities reported, which
// number runtime calls through a process's life as CUPTI's do (trace readers such as HTA size
// their columns by them). An eager launch makes two: the launch and its check
// (C10_CUDA_KERNEL_LAUNCH_CHECK's cudaGetLastError); a launch's ID is its first.
inline std::atomic<uint32_t> g_runtime_calls{0};
inline uint32_t count_launch() { return g_runtime_calls.fetch_add(2, std::memory_order_relaxed) + 1; }

// The wall clock of the profiler's CPU events (ns since the epoch, c10::getTime()).
int64_t profiler_wall_ns();

// A piece of device work this thread launched at `launched_at` as launch number `launch`
// (count_launch), for the session recording: its times are predicted ns in clocked mode (the
// host's predicted clock when it issued the work), else wall ns (profiler_wall_ns).
void note_device_work(const Interval& work, int64_t launched_at, uint32_t launch);

// Without clocked mode, a fused kernel written over ATen (a KernelScope: fused attention) as the
// one kernel it stands for, lasting what its ATen work took here; its ATen ops are not reported
// on their own (the op path skips them inside a KernelScope).
class HostTimedFusedKernel {
 public:
  HostTimedFusedKernel(const KernelScope& scope, const char* name, DeviceIndex device, c10::ScalarType dtype)
      : name_(scope.outermost && !timing() && profiling_device() ? name : nullptr), device_(device), dtype_(dtype),
        began_(name_ ? profiler_wall_ns() : 0) {}
  ~HostTimedFusedKernel() {
    if (name_) {
      note_device_work(Interval{began_, profiler_wall_ns(), name_, 0, 0, tl_stream[device_], WorkKind::kCompute, device_,
                                dtype_}, began_, count_launch());
    }
  }
  HostTimedFusedKernel(const HostTimedFusedKernel&) = delete;
  HostTimedFusedKernel& operator=(const HostTimedFusedKernel&) = delete;

 private:
  const char* name_;
  DeviceIndex device_;
  c10::ScalarType dtype_;
  int64_t began_;
};

}  // namespace mirage

// For the emulated NCCL (another library): whether a session records, and a collective it ran
// without clocked mode between two profiler_wall_ns() readings. A transfer that completes on
// the communicator's worker thread names the CPU op that posted it: the op running on the
// posting thread (mirage_profiler_cpu_op), adopted by the worker while it reports the transfer.
extern "C" {
int mirage_profiler_recording();
int64_t mirage_profiler_wall_ns();
uint64_t mirage_profiler_cpu_op();
void mirage_profiler_adopt_cpu_op(uint64_t op);
void mirage_profiler_collective(int device, int64_t stream, int64_t start, int64_t end, const char* name,
                                int64_t bytes, int dtype);
}
