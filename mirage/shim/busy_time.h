// Busy time: how long each device ran work, for torch.cuda.utilization and `mirage smi` (and,
// through the session table, the power and temperature they report). Measured in host time by the
// op path; a torch.compile'd graph, which does not pass the op path, is timed as a region.
#pragma once

#include "config.h"

#include <chrono>
#include <cstdint>

namespace mirage {

void add_busy(DeviceIndex device, int64_t ns);
// The device's busy time: all processes of the session on that GPU, or this one without a service.
int64_t busy_time(DeviceIndex device);

// Measures one piece of device work into the device's busy time; work inside work (an op a
// timed op or a compiled graph runs) is counted once, by the outermost timer.
inline thread_local int tl_busy_depth = 0;

class BusyTimer {
 public:
  explicit BusyTimer(DeviceIndex device)
      : device_(device), outermost_(tl_busy_depth++ == 0), start_(std::chrono::steady_clock::now()) {}
  ~BusyTimer() {
    --tl_busy_depth;
    if (!outermost_ || device_ < 0 || device_ >= kMaxDevices) return;
    const auto spent = std::chrono::steady_clock::now() - start_;
    add_busy(device_, std::chrono::duration_cast<std::chrono::nanoseconds>(spent).count());
  }
  BusyTimer(const BusyTimer&) = delete;
  BusyTimer& operator=(const BusyTimer&) = delete;

 private:
  DeviceIndex device_;
  bool outermost_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace mirage
