// Busy time: how long each device ran work, for torch.cuda.utilization and `mirage smi` (and,
// through the session table, the power and temperature they report). Measured in host time by the
// op path; a torch.compile'd graph, which does not pass the op path, is timed as a region.
#pragma once

#include "config.h"

#include <cstdint>
#include <ctime>

namespace mirage {

void add_busy(DeviceIndex device, int64_t ns);
// The device's busy time: all processes of the session on that GPU, or this one without a service.
int64_t busy_time(DeviceIndex device);

// The clock an op's busy time is read on: CLOCK_MONOTONIC_COARSE, the kernel's last tick (1-4 ms
// apart), which costs a few nanoseconds where a precise read costs tens, twice for every op. Summed
// over many ops a coarse clock is unbiased (work of d ns crosses a tick with probability d / tick),
// and utilization is a rate over a sampling window of about a second, as NVML's is. A region (a
// compiled graph) is timed on the precise clock: it is one piece of work, which must count whole.
inline int64_t busy_clock_ns(bool precise) {
  timespec now;
  clock_gettime(precise ? CLOCK_MONOTONIC : CLOCK_MONOTONIC_COARSE, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

// Measures one piece of device work into the device's busy time; work inside work (an op a
// timed op or a compiled graph runs) is counted once, by the outermost timer.
inline thread_local int tl_busy_depth = 0;

class BusyTimer {
 public:
  explicit BusyTimer(DeviceIndex device, bool precise = false)
      : device_(device), outermost_(tl_busy_depth++ == 0), precise_(precise), start_(busy_clock_ns(precise)) {}
  ~BusyTimer() {
    --tl_busy_depth;
    if (!outermost_ || device_ < 0 || device_ >= kMaxDevices) return;
    const int64_t spent = busy_clock_ns(precise_) - start_;
    if (spent > 0) add_busy(device_, spent);  // most ops see no tick: no shared counter touched
  }
  BusyTimer(const BusyTimer&) = delete;
  BusyTimer& operator=(const BusyTimer&) = delete;

 private:
  DeviceIndex device_;
  bool outermost_;
  bool precise_;
  int64_t start_;
};

}  // namespace mirage
