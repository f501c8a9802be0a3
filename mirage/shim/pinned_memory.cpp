// The pinned-memory allocator (pinned_memory.h) and torch.cuda.host_memory_stats' counters.
#include "pinned_memory.h"
#include "unobserved_ops.h"

#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/llvmMathExtras.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace mirage {

PinnedMemoryAllocator g_pinned;

c10::DataPtr PinnedMemoryAllocator::allocate(size_t n) {
  void* p = c10::alloc_cpu(n == 0 ? 1 : n);
  const int64_t counted = static_cast<int64_t>(c10::llvm::PowerOf2Ceil(n == 0 ? 1 : n));
  {
    std::lock_guard<std::mutex> g(mu);
    live.emplace(p, counted);
    blocks[0] += 1, blocks[2] += 1, blocks[1] = std::max(blocks[1], blocks[0]);
    bytes[0] += counted, bytes[2] += counted, bytes[1] = std::max(bytes[1], bytes[0]);
  }
  return {p, p, &PinnedMemoryAllocator::release, c10::Device(c10::DeviceType::CPU)};
}

void PinnedMemoryAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

bool PinnedMemoryAllocator::is_pinned(const void* p) {
  std::lock_guard<std::mutex> g(mu);
  return live.count(p) != 0;
}

void PinnedMemoryAllocator::release(void* p) {
  {
    std::lock_guard<std::mutex> g(g_pinned.mu);
    auto it = g_pinned.live.find(p);
    if (it != g_pinned.live.end()) {
      g_pinned.blocks[0] -= 1, g_pinned.blocks[3] += 1;
      g_pinned.bytes[0] -= it->second, g_pinned.bytes[3] += it->second;
      g_pinned.live.erase(it);
    }
  }
  c10::free_cpu(p);
}

}  // namespace mirage

MIRAGE_LIBRARY(m) {
  m.def("host_memory_counts() -> int[]", []() {
    std::lock_guard<std::mutex> g(mirage::g_pinned.mu);
    const auto& p = mirage::g_pinned;
    return std::vector<int64_t>{p.blocks[0], p.blocks[1], p.blocks[2], p.blocks[3],
                                p.bytes[0], p.bytes[1], p.bytes[2], p.bytes[3]};
  });
  m.def("reset_host_memory_counts(bool peak) -> ()", [](bool peak) {
    std::lock_guard<std::mutex> g(mirage::g_pinned.mu);
    auto& p = mirage::g_pinned;
    if (peak) {
      p.blocks[1] = p.blocks[0], p.bytes[1] = p.bytes[0];
    } else {
      p.blocks[2] = p.blocks[3] = p.bytes[2] = p.bytes[3] = 0;
    }
  });
}
