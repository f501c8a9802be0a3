// The CUDA device guard (c10::impl::DeviceGuardImplInterface): current device, streams, events.
#include "device_guard.h"
#include "faults.h"

#include "device_clock.h"
#include "gpu_trace.h"
#include "race_checker.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <chrono>

namespace mirage {

static std::atomic<c10::StreamId> g_next_stream_id{1};

c10::StreamId new_stream_id() { return g_next_stream_id++; }

// What an event holds: when it was recorded (ns: host time, or in clocked mode predicted time).
struct RecordedEvent {
  int64_t ns = 0;
  bool recorded = false;
  std::shared_ptr<const races::VectorClock> order;  // --check-races: its stream's clock when recorded
};

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
  // A device without an index (torch.Stream(device="cuda")) is the current one, as CUDA's
  // getCurrentCUDAStream / getStreamFromPool take index -1.
  static c10::Device indexed(c10::Device d) { return d.has_index() ? d : c10::Device(DeviceType::CUDA, tl_device); }
  c10::Stream getStream(c10::Device d) const override {
    d = indexed(d);
    return c10::Stream(c10::Stream::UNSAFE, d, tl_stream[d.index()]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, indexed(d)); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    c10::Stream stream(c10::Stream::UNSAFE, indexed(d), new_stream_id());
    if (auto* trace = gpu_trace()) (*trace)->trace_gpu_stream_creation(DeviceType::CUDA, stream.id());
    return stream;
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    tl_stream[s.device_index()] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return config().num_devices; }
  // Work is done when issued, so without clocked mode an event is the host time at which it
  // was recorded; in clocked mode, its stream's predicted clock (device_clock.h).
  void record(void** event, const c10::Stream& stream, const DeviceIndex, const c10::EventFlag) const override {
    auto* trace = gpu_trace();
    if (*event == nullptr) {
      *event = new RecordedEvent{};
      if (trace) (*trace)->trace_gpu_event_creation(DeviceType::CUDA, trace_handle(*event));
    }
    if (trace) (*trace)->trace_gpu_event_record(DeviceType::CUDA, trace_handle(*event), stream.id());
    auto* e = static_cast<RecordedEvent*>(*event);
    e->recorded = true;
    if (C10_UNLIKELY(races::on())) e->order = races::snapshot(stream.device_index(), stream.id());
    if (timing()) {  // an idle stream reaches the record when the host issues it
      e->ns = std::max(stream_time(stream.device_index(), stream.id()), host_time());
    } else {
      e->ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
                  .count();
    }
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    if (auto* trace = gpu_trace()) (*trace)->trace_gpu_event_deletion(DeviceType::CUDA, trace_handle(event));
    delete static_cast<RecordedEvent*>(event);
  }
  // wait_event: the stream's later work starts after the event.
  void block(void* event, const c10::Stream& stream) const override {
    auto* e = static_cast<RecordedEvent*>(event);
    if (!e) return;  // waiting for an event never recorded: nothing to wait for, as on CUDA
    if (auto* trace = gpu_trace()) (*trace)->trace_gpu_event_wait(DeviceType::CUDA, trace_handle(e), stream.id());
    if (timing() && e->recorded) stream_waits_for(stream.device_index(), stream.id(), e->ns);
    if (C10_UNLIKELY(races::on()) && e->order) races::stream_waits(stream.device_index(), stream.id(), *e->order);
  }
  // Work is done when issued, so a query says done; the host may act on it as on a synchronisation.
  bool queryEvent(void* event) const override {
    auto* e = static_cast<RecordedEvent*>(event);
    if (C10_UNLIKELY(races::on()) && e && e->order) races::host_waits(*e->order);
    return true;
  }
  bool queryStream(const c10::Stream& stream) const override {
    if (C10_UNLIKELY(races::on())) races::host_waits_for_stream(stream.device_index(), stream.id());
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    check_device_not_lost();
    if (auto* trace = gpu_trace()) (*trace)->trace_gpu_stream_synchronization(DeviceType::CUDA, stream.id());
    if (timing()) host_waits_for(stream_time(stream.device_index(), stream.id()));
    if (C10_UNLIKELY(races::on())) races::host_waits_for_stream(stream.device_index(), stream.id());
  }
  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<RecordedEvent*>(event);
    if (auto* trace = gpu_trace(); trace && e) (*trace)->trace_gpu_event_synchronization(DeviceType::CUDA, trace_handle(e));
    if (timing() && e && e->recorded) host_waits_for(e->ns);
    if (C10_UNLIKELY(races::on()) && e && e->order) races::host_waits(*e->order);
  }
  void synchronizeDevice(const DeviceIndex device) const override {
    check_device_not_lost();
    if (auto* trace = gpu_trace()) (*trace)->trace_gpu_device_synchronization(DeviceType::CUDA);
    if (timing()) host_waits_for(device_time(device < 0 ? tl_device : device));
    if (C10_UNLIKELY(races::on())) races::host_waits_for_device(device < 0 ? tl_device : device);
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start && end, "Both events must be recorded before calculating elapsed time.");
    auto* from = static_cast<RecordedEvent*>(start);
    auto* to = static_cast<RecordedEvent*>(end);
    return static_cast<double>(to->ns - from->ns) / 1e6;
  }
};
C10_REGISTER_GUARD_IMPL(CUDA, MirageGuard);

}  // namespace mirage
