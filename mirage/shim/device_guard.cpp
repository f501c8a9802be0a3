// The CUDA device guard (c10::impl::DeviceGuardImplInterface): current device, streams, events.
#include "device_guard.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <chrono>

namespace mirage {

static std::atomic<c10::StreamId> g_next_stream_id{1};

struct MirageGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {DeviceType::CUDA, tl_device}; }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    tl_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { tl_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, tl_stream[d.index()]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, g_next_stream_id++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    tl_stream[s.device_index()] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return config().num_devices; }
  // Work is synchronous, so an event is just the host time at which it was recorded (ms).
  void record(void** event, const c10::Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new double(0);
    *static_cast<double*>(*event) =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override { delete static_cast<double*>(event); }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start && end, "Both events must be recorded before calculating elapsed time.");
    return *static_cast<double*>(end) - *static_cast<double*>(start);
  }
};
C10_REGISTER_GUARD_IMPL(CUDA, MirageGuard);

}  // namespace mirage
