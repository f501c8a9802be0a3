// Pinned host memory is ordinary host memory; we only remember which pointers were pinned, and
// keep torch.cuda.host_memory_stats' counts (blocks are counted at the next power of two, as the
// caching host allocator rounds them; nothing is cached, so every block is an active request).
#pragma once

#include <c10/core/Allocator.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace mirage {

struct PinnedMemoryAllocator final : c10::Allocator {
  std::mutex mu;
  std::unordered_map<const void*, int64_t> live;  // pointer -> counted (rounded) bytes
  // current, peak, allocated, freed: blocks, then bytes
  int64_t blocks[4] = {0, 0, 0, 0}, bytes[4] = {0, 0, 0, 0};
  static void release(void* p);
  c10::DataPtr allocate(size_t n) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  bool is_pinned(const void* p);
};
extern PinnedMemoryAllocator g_pinned;

}  // namespace mirage
