// Busy time (busy_time.h): this process's counters, and the session's per GPU.
#include "busy_time.h"

#include "device_guard.h"
#include "profiler_activities.h"
#include "session_table.h"
#include "unobserved_ops.h"

#include <torch/library.h>

#include <array>
#include <atomic>
#include <memory>
#include <vector>

namespace mirage {

static std::array<std::atomic<int64_t>, kMaxDevices> g_busy_ns;  // this process's, per device

void add_busy(DeviceIndex device, int64_t ns) {
  g_busy_ns[device].fetch_add(ns, std::memory_order_relaxed);
  if (g_shared.words) SharedTable::at(g_shared.gpu_busy(node_gpu(device))).fetch_add(ns, std::memory_order_relaxed);
}

int64_t busy_time(DeviceIndex device) {
  if (g_shared.words) return SharedTable::at(g_shared.gpu_busy(node_gpu(device))).load(std::memory_order_relaxed);
  return g_busy_ns[device].load(std::memory_order_relaxed);
}

// Device work that does not pass the op path (a torch.compile'd graph's host kernels), timed
// between busy_region_enter and busy_region_exit on the calling thread; without clocked mode,
// torch.profiler's GPU side gets it as one kernel of the time it took (clocked mode places it
// on the timeline itself: op_cost.cpp's clock_compiled_graph).
struct BusyRegion {
  BusyTimer timer;
  DeviceIndex device;
  int64_t profiled_from;  // wall ns, or -1: not recorded for the profiler
};
static thread_local std::vector<std::unique_ptr<BusyRegion>> tl_busy_regions;

static void end_busy_region() {
  const BusyRegion& region = *tl_busy_regions.back();
  if (region.profiled_from >= 0) {
    note_device_work(Interval{region.profiled_from, profiler_wall_ns(), kCompiledGraph, 0, 0, tl_stream[region.device],
                              WorkKind::kCompute, region.device}, region.profiled_from, count_launch());
  }
  tl_busy_regions.pop_back();
}

}  // namespace mirage

MIRAGE_LIBRARY(m) {
  m.def("busy_region_enter(int device) -> ()", [](int64_t device) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    const auto dev = static_cast<c10::DeviceIndex>(device);
    const bool profiled = !mirage::timing() && mirage::profiling_device();
    mirage::tl_busy_regions.push_back(std::unique_ptr<mirage::BusyRegion>(
        new mirage::BusyRegion{mirage::BusyTimer(dev, /*precise=*/true), dev, profiled ? mirage::profiler_wall_ns() : -1}));
  });
  m.def("busy_region_exit() -> ()", []() {
    TORCH_CHECK(!mirage::tl_busy_regions.empty(), "busy_region_exit without busy_region_enter");
    mirage::end_busy_region();
  });
  m.def("busy_time_ns(int device) -> int", [](int64_t device) -> int64_t {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    return mirage::busy_time(static_cast<c10::DeviceIndex>(device));
  });
}
