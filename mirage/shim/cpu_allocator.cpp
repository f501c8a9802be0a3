// The CPU allocator beside the emulated device (cpu_allocator.h): torch's default CPU
// allocator, except for allocations a device kernel makes, which skip its report to the profiler.
#include "cpu_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace mirage {
namespace {

class CpuAllocator final : public c10::Allocator {
 public:
  explicit CpuAllocator(c10::Allocator* torchs) : torchs_(torchs) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (tl_device_kernels_running == 0 || nbytes == 0) return torchs_->allocate(nbytes);
    void* data = c10::alloc_cpu(nbytes);  // as torch's allocator allocates, without its report
    return {data, data, &c10::free_cpu, c10::Device(c10::DeviceType::CPU)};
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
}  // namespace mirage
