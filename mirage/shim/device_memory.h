// Device memory: what each emulated GPU holds for this process and the session, the model of
// the caching allocator that decides it (caching_allocator.h), private pools (use_mem_pool, a
// CUDA graph's), and the allocator torch asks for (REGISTER_ALLOCATOR for CUDA). The bytes are
// host memory (shared_device_memory.h); what is modelled is the bookkeeping and the capacity.
#pragma once

#include "caching_allocator.h"
#include "config.h"

#include <c10/core/Allocator.h>

#include <array>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mirage {

// Each device's caching-allocator bookkeeping (statistics, segments, pools).
extern std::array<DeviceCache, kMaxDevices> g_caches;

// A block of the device's caching allocator for `nbytes`; raises the allocator's OOM error.
CachedBlock* allocate_block(DeviceIndex dev, size_t nbytes);
void free_device_block(DeviceIndex dev, CachedBlock* block);
// The allocator model's block behind a device storage's bytes (null: not the allocator's, e.g.
// memory shared from another process).
const CachedBlock* device_block_of(const c10::DataPtr& data);
// A segment's bytes leave this process's (and the session's) count of the device's memory.
void release_segment_bytes(DeviceIndex dev, size_t bytes);

// The allocator of device `dev` (storages keep it), and the one of the current device.
c10::Allocator* device_allocator(DeviceIndex dev);
c10::Allocator* current_device_allocator();

// torch.cuda.use_mem_pool: the MemPools this thread allocates into, per device (innermost last).
inline thread_local std::array<std::vector<PoolId>, kMaxDevices> tl_pools;

// The private pool of the CUDA graph being captured, and its device (-1: none). A capture is
// process-wide (autograd's device threads issue a captured backward pass), so is its pool.
extern PoolId g_capture_pool;
extern std::atomic<int> g_capture_device;

// A private pool's blocks live in their segment's memory (caching_allocator.h), so they have no
// header: their data pointer is their context, as on CUDA, and this table finds their block.
// free_pool_block is the allocator's raw deleter (the one cudagraph trees look for and swap).
struct PoolBlocks {
  std::mutex mu;
  std::unordered_map<const void*, std::pair<DeviceIndex, CachedBlock*>> by_data;
};
extern PoolBlocks g_pool_blocks;
c10::DataPtr pool_block_data(DeviceIndex dev, CachedBlock* block);
bool release_pool_block(void* data);
void free_pool_block(void* data);

}  // namespace mirage
