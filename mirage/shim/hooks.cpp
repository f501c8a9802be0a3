// What torch asks a CUDA build for through registries, at import and later: the CUDA hooks
// (hasCUDA, device count, generators, pinned memory) and DDP's reducer timer.
#include "device_clock.h"
#include "device_guard.h"
#include "device_memory.h"
#include "generators.h"
#include "pinned_memory.h"

#include "unobserved_ops.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

namespace mirage {

// torch.__config__.show()'s lines about the GPU build (mirage/runtime/build_config.py sets them:
// the toolkit, cuDNN or MIOpen versions of the profile's build).
static std::string g_build_config;

MIRAGE_LIBRARY(m) {
  m.def("set_cuda_build_config(str lines) -> ()", [](std::string lines) { g_build_config = std::move(lines); });
}

struct MirageHooks final : at::CUDAHooksInterface {
  explicit MirageHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return config().num_devices > 0; }
  bool hasCUDA() const override { return config().num_devices > 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  std::string showConfig() const override { return g_build_config; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return config().num_devices; }
  int getNumGPUs() const override { return config().num_devices; }
  DeviceIndex current_device() const override { return tl_device; }
  DeviceIndex getCurrentDevice() const override { return tl_device; }
  void setCurrentDevice(DeviceIndex d) const override {
    check_index(d);
    tl_device = d;
  }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    DeviceIndex old = tl_device;
    setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(DeviceIndex d) const override {
    return default_generator(d < 0 ? tl_device : d);
  }
  at::Generator getNewGenerator(DeviceIndex d) const override { return new_generator(d < 0 ? tl_device : d); }
  bool isPinnedPtr(const void* data) const override { return g_pinned.is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned; }
  c10::Allocator* getCUDADeviceAllocator() const override { return current_device_allocator(); }
  c10::Device getDeviceFromPtr(void*) const override { return c10::Device(DeviceType::CUDA, tl_device); }
  void deviceSynchronize(DeviceIndex device) const override {
    if (timing()) host_waits_for(device_time(device < 0 ? tl_device : device));
  }
};
}  // namespace mirage

// C10_REGISTER_TYPED_CLASS must name the registry in namespace at.
namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", mirage::MirageHooks)
}

// DDP's reducer asks for a timer for its device type; work is synchronous, so host time it is.
namespace c10d {
struct MirageHostTimer final : Timer {
  explicit MirageHostTimer(c10::Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto from = getTimestamp(start), to = getTimestamp(end);
    if (!from || !to || *to < *from) return std::nullopt;
    return *to - *from;
  }
};
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kCUDA, MirageHostTimer);
}  // namespace c10d
