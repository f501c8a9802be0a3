// The CPU allocator beside the emulated device and the cache of host bytes behind device
// kernels' allocations (cpu_allocator.h).
#include "cpu_allocator.h"

#include "caching_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <malloc.h>

#include <array>
#include <vector>

namespace mirage {
namespace {

// Size classes: 64-byte steps up to 1 KiB, then four to each doubling up to 1 MiB (at most a
// quarter more than asked for). A freed block is filed under the largest class its usable size
// holds, so any pointer glibc handed out may be given back, whatever size it was asked for.
constexpr size_t kLinearStep = 64, kLinearEnd = 1024, kLinearClasses = kLinearEnd / kLinearStep;
constexpr size_t kMaxCachedBlock = size_t{1} << 20, kMaxCachedBytes = size_t{16} << 20;
constexpr int kLinearEndLog2 = 10, kMaxLog2 = 20;
constexpr size_t kClasses = kLinearClasses + (kMaxLog2 - kLinearEndLog2) * 4;

int floor_log2(size_t n) { return 63 - __builtin_clzll(n); }

// The smallest class holding `n` bytes (0 < n <= kMaxCachedBlock).
size_t class_holding(size_t n) {
  if (n <= kLinearEnd) return (n + kLinearStep - 1) / kLinearStep - 1;
  const int k = floor_log2(n - 1);  // 2^k < n <= 2^(k+1)
  const size_t step = (size_t{1} << k) / 4;
  const size_t quarters = (n - (size_t{1} << k) + step - 1) / step;  // 1..4
  return kLinearClasses + static_cast<size_t>(k - kLinearEndLog2) * 4 + quarters - 1;
}

// The largest class a block of `usable` bytes holds (usable >= kLinearStep).
size_t class_within(size_t usable) {
  if (usable >= kMaxCachedBlock) return kClasses - 1;
  if (usable <= kLinearEnd) return usable / kLinearStep - 1;
  const int k = floor_log2(usable);  // 2^k <= usable < 2^(k+1)
  const size_t quarters = (usable - (size_t{1} << k)) / ((size_t{1} << k) / 4);  // 0..3
  return kLinearClasses + static_cast<size_t>(k - kLinearEndLog2) * 4 + quarters - 1;
}

size_t class_size(size_t index) {
  if (index < kLinearClasses) return (index + 1) * kLinearStep;
  const size_t above = index - kLinearClasses;
  const size_t base = size_t{1} << (kLinearEndLog2 + above / 4);
  return base + base / 4 * (above % 4 + 1);
}

class HostBytesCache {
 public:
  void* take(size_t nbytes) {
    if (nbytes == 0 || nbytes > kMaxCachedBlock) return c10::alloc_cpu(nbytes);
    const size_t index = class_holding(nbytes);
    {
      std::lock_guard<SpinLock> held(mu_);
      std::vector<void*>& blocks = free_[index];
      if (!blocks.empty()) {
        void* data = blocks.back();
        blocks.pop_back();
        cached_bytes_ -= class_size(index);
        return data;
      }
    }
    return c10::alloc_cpu(class_size(index));
  }

  void give(void* data) {
    if (data == nullptr) return;
    const size_t usable = malloc_usable_size(data);
    if (usable >= kLinearStep && usable <= kMaxCachedBlock + kLinearStep) {
      const size_t index = class_within(usable);
      std::lock_guard<SpinLock> held(mu_);
      if (cached_bytes_ + class_size(index) <= kMaxCachedBytes) {
        free_[index].push_back(data);
        cached_bytes_ += class_size(index);
        return;
      }
    }
    c10::free_cpu(data);
  }

  void release() {
    std::array<std::vector<void*>, kClasses> freed;
    {
      std::lock_guard<SpinLock> held(mu_);
      freed.swap(free_);
      cached_bytes_ = 0;
    }
    for (auto& blocks : freed) {
      for (void* data : blocks) c10::free_cpu(data);
    }
  }

 private:
  SpinLock mu_;
  std::array<std::vector<void*>, kClasses> free_;
  size_t cached_bytes_ = 0;
};

// Never destroyed: blocks are given back from other static destructors at exit.
HostBytesCache& host_bytes() {
  static HostBytesCache* cache = new HostBytesCache;
  return *cache;
}

class CpuAllocator final : public c10::Allocator {
 public:
  explicit CpuAllocator(c10::Allocator* torchs) : torchs_(torchs) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (tl_device_kernels_running == 0 || nbytes == 0) return torchs_->allocate(nbytes);
    void* data = host_bytes().take(nbytes);  // as torch's allocator allocates, without its report
    return {data, data, &host_bytes_give, c10::Device(c10::DeviceType::CPU)};
  }
  // raw_allocate's blocks are freed with this: torch's deleter frees an unreported block as well
  c10::DeleterFnPtr raw_deleter() const override { return torchs_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    torchs_->copy_data(dest, src, count);
  }

 private:
  c10::Allocator* torchs_;
};

const bool installed = [] {
  static CpuAllocator allocator(c10::GetDefaultCPUAllocator());
  c10::SetCPUAllocator(&allocator, /*priority=*/1);  // above torch's default (0)
  return true;
}();

}  // namespace

void* host_bytes_take(size_t nbytes) { return host_bytes().take(nbytes); }
void host_bytes_give(void* data) { host_bytes().give(data); }
void host_bytes_release() { host_bytes().release(); }

}  // namespace mirage
