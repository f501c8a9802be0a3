// Clocked mode's half in the emulated NCCL: the shim's predicted timeline, which collectives
// and point-to-point transfers are placed on (clock.cpp: the communicator's streams, the
// collective's size as nccl-tests count it, and where each operation ends).
#pragma once

#include <cstdint>

namespace mirage::nccl {

// The shim's predicted timeline (mirage/shim/device_clock.h's C interface), found through dlsym as
// the arena is: the shim is loaded with RTLD_GLOBAL before this module, which must also import
// without it (its build imports it). Without clocked mode (or the shim) `on` is false.
struct ShimClock {
  int (*enabled)() = nullptr;
  int64_t (*new_stream)() = nullptr;
  int64_t (*ready)(int, int64_t) = nullptr;
  int64_t (*collective)(int, int64_t, int64_t, int64_t, const char*, int64_t, int, int, int) = nullptr;
  void (*current_stream_waits)(int, int64_t) = nullptr;
  int64_t (*cost_ns)(int, int64_t, int, int, double) = nullptr;
  double (*link_slowdown)(const int64_t*, int) = nullptr;
  // torch.profiler's GPU side without clocked mode (mirage/shim/profiler_activities.h): whether a
  // session records, its wall clock, and a collective that ran between two readings of it.
  int (*profiler_recording)() = nullptr;
  int64_t (*profiler_wall_ns)() = nullptr;
  void (*profiler_collective)(int, int64_t, int64_t, int64_t, const char*, int64_t, int) = nullptr;
  // the CPU op running on the calling thread (0: none, or not recording); the one a worker
  // thread reports work for (0: none)
  uint64_t (*profiler_cpu_op)() = nullptr;
  void (*adopt_cpu_op)(uint64_t) = nullptr;
  bool on = false;
  // --predict-only (the shim's predict_only(), device_clock.h): kernels compute nothing, so
  // collectives carry no payload (no_payload.cpp).
  bool predict_only = false;

  static const ShimClock& get();
  // Whether torch.profiler records the GPU side now, with this host's times (no clocked mode).
  bool profiling_host_times() const { return !on && profiler_recording && profiler_wall_ns && profiler_collective &&
                                             new_stream && profiler_recording(); }
};
inline const ShimClock& shim_clock() { return ShimClock::get(); }

}  // namespace mirage::nccl
