// The session's shared table: with a session service, every process on an emulated GPU draws on
// one capacity and one busy time. The run process holds the table in a memfd that every process
// maps, opened at boot through /proc/<run pid>/fd/<n> (MIRAGE_SHM; layout in
// mirage/daemon/shared_table.py): no name in /dev/shm, so it goes with the last process mapping
// it. Each process adds to its own slot (no round trip to the service, no writer but the owner);
// a GPU's use is the sum over the slots on its node.
#pragma once

#include "config.h"

#include <atomic>
#include <cstdint>

namespace mirage {

struct SharedTable {
  int64_t* words = nullptr;
  int64_t gpus_per_node = 0, max_slots = 0, node = 0;
  int64_t* slot = nullptr;  // this process's slot: [pid, node, rank, reserved, bytes per GPU...]

  static constexpr int64_t kMagic = 0x6d6972616765;  // "mirage"
  static constexpr int64_t kHeader = 8, kSlotHead = 4, kHighWater = 6;
  int64_t* gpu_peak(DeviceIndex dev) const { return words + kHeader + node * gpus_per_node + dev; }
  int64_t* gpu_busy(DeviceIndex dev) const {  // after the slots (shared_table.py)
    return slot_at(max_slots) + node * gpus_per_node + dev;
  }
  int64_t* slot_at(int64_t i) const {
    return words + kHeader + words[2] * gpus_per_node + i * (kSlotHead + gpus_per_node);
  }
  static std::atomic_ref<int64_t> at(int64_t* p) { return std::atomic_ref<int64_t>(*p); }
};
extern SharedTable g_shared;  // words == nullptr: no session (--in-process), private counters only

// The node's GPU behind this process's device `dev` (they differ under CUDA_VISIBLE_DEVICES):
// the shared table has a column per node GPU.
inline DeviceIndex node_gpu(DeviceIndex dev) { return config().node_gpu[dev]; }

}  // namespace mirage
