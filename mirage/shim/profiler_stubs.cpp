// The profiler's CUDA methods (torch::profiler::impl::ProfilerStubs), as a CUDA build registers
// them from libtorch_cuda: torch.profiler with ProfilerActivity.CUDA on a build whose Kineto has
// no CUPTI (KINETO_GPU_FALLBACK, and the legacy profiler's use_device="cuda") records a CUDA
// event on the current stream around each op and reports the time between them as the op's
// device time (key_averages()'s device/CUDA columns). A CPU build leaves the default stubs,
// which fail each record with "Failed to record CUDA event" and a stack trace. These record the
// emulated device's events (device_guard.cpp): its host time at record without clocked mode,
// its stream's predicted clock with it, so the device time is the predicted kernel time.
#include "config.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/stubs/base.h>

namespace mirage {
namespace {

const c10::impl::DeviceGuardImplInterface& cuda_guard() { return *c10::impl::getDeviceGuardImpl(DeviceType::CUDA); }

struct MirageProfilerStubs final : torch::profiler::impl::ProfilerStubs {
  void record(DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    const auto& guard = cuda_guard();
    const DeviceIndex index = guard.getDevice().index();
    if (device) *device = index;
    void* raw = nullptr;
    guard.record(&raw, guard.getStream(c10::Device(DeviceType::CUDA, index)), index, c10::EventFlag::PYTORCH_DEFAULT);
    *event = std::shared_ptr<void>(raw, [index](void* e) { cuda_guard().destroyEvent(e, index); });
    if (cpu_ns) *cpu_ns = c10::getTime();
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* start,
                const torch::profiler::impl::ProfilerVoidEventStub* end) const override {
    // as CUDA's stub: microseconds (cudaEventElapsedTime's milliseconds x 1000)
    return static_cast<float>(cuda_guard().elapsedTime(start->get(), end->get(), -1) * 1000.0);
  }
  // NVTX without a tool attached (nsys, ncu) records nothing, as on a GPU box run without one.
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    const auto& guard = cuda_guard();
    const c10::Device previous = guard.getDevice();
    for (DeviceIndex i = 0; i < config().num_devices; ++i) {
      guard.setDevice(c10::Device(DeviceType::CUDA, i));
      op(i);
    }
    guard.setDevice(previous);
  }
  void synchronize() const override { cuda_guard().synchronizeDevice(-1); }
};

const bool registered = [] {
  static MirageProfilerStubs stubs;
  torch::profiler::impl::registerCUDAMethods(&stubs);
  return true;
}();

}  // namespace
}  // namespace mirage
