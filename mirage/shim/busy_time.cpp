// Busy time (busy_time.h): this process's counters, and the session's per GPU.
#include "busy_time.h"

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
// between busy_region_enter and busy_region_exit on the calling thread.
static thread_local std::vector<std::unique_ptr<BusyTimer>> tl_busy_regions;

}  // namespace mirage

MIRAGE_LIBRARY(m) {
  m.def("busy_region_enter(int device) -> ()", [](int64_t device) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    mirage::tl_busy_regions.push_back(std::make_unique<mirage::BusyTimer>(static_cast<c10::DeviceIndex>(device)));
  });
  m.def("busy_region_exit() -> ()", []() {
    TORCH_CHECK(!mirage::tl_busy_regions.empty(), "busy_region_exit without busy_region_enter");
    mirage::tl_busy_regions.pop_back();
  });
  m.def("busy_time_ns(int device) -> int", [](int64_t device) -> int64_t {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    return mirage::busy_time(static_cast<c10::DeviceIndex>(device));
  });
}
