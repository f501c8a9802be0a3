// torch.cuda.memory._record_memory_history: while enabled, every action of a device's allocator,
// with the Python stack of the call that caused it (gathered before the allocator's lock is taken:
// gathering may wait for the GIL), and each live block's allocation stack for snapshots.
#pragma once

#include "caching_allocator.h"
#include "config.h"

#include <torch/csrc/profiler/combined_traceback.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace mirage {

struct HistoryEntry {
  TraceAction action;
  uint64_t address;
  size_t size;
  int64_t stream;
  int64_t time_us;
  std::shared_ptr<torch::CapturedTraceback> frames;
};
struct MemoryHistory {
  std::atomic<bool> enabled{false};
  std::atomic<bool> stacks{true};
  std::mutex mu;
  size_t max_entries = SIZE_MAX;
  std::array<std::deque<HistoryEntry>, kMaxDevices> traces;
  std::array<std::unordered_map<uint64_t, std::shared_ptr<torch::CapturedTraceback>>, kMaxDevices> block_frames;
};
extern MemoryHistory g_history;

std::shared_ptr<torch::CapturedTraceback> gather_stack();
// The allocator observer that appends an action of device `dev` to its history, with `frames`.
Observer history_observer(DeviceIndex dev, std::shared_ptr<torch::CapturedTraceback> frames);

}  // namespace mirage
