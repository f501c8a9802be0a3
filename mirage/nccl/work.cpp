// Work and futures (work.h): what every operation of the emulated NCCL returns.

#include "work.h"

#include "clock.h"
#include "races.h"

#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include <algorithm>

namespace mirage::nccl {

EmulatedWork::EmulatedWork(int rank, c10d::OpType type, const char* profiling_title,
                           const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs, uint64_t seq,
                           std::string description, std::tuple<std::string, std::string> group, int group_size)
    : c10d::Work(rank, type, profiling_title, inputs), outputs_(std::move(outputs)), seq_(seq),
      description_(std::move(description)), group_(std::move(group)), group_size_(group_size) {
  std::vector<c10::Device> devices;
  for (const auto& t : outputs_) {
    if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), devices);
}

EmulatedWork::~EmulatedWork() {
  if (race_order_) shim_races().release(race_order_);
}

void EmulatedWork::complete(std::exception_ptr error) {
  duration_ms_ = std::chrono::duration<float, std::milli>(Clock::now() - started_).count();
  if (error) {
    future_->setError(error);
  } else if (stream_device_ >= 0) {
    c10::StreamGuard on_comm_stream(
        c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(stream_device_)),
                    stream_));
    future_->markCompleted(c10::IValue(outputs_));
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish(error);
}

float EmulatedWork::getDuration() const {
  TORCH_CHECK(timed_, "getDuration only works if timing was enabled");
  return duration_ms_;
}

bool EmulatedWork::wait(std::chrono::milliseconds timeout) {
  // The profiler's record of the wait, as WorkNCCL::wait makes it.
  RECORD_PARAM_COMMS(static_cast<int>(seq_), group_, rank_, "wait", 0, 0, at::kByte, std::vector<int64_t>(),
                     std::vector<int64_t>(), -1, -1, group_size_);
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout == std::chrono::milliseconds(0)) {  // kNoTimeout
    cv_.wait(lock, [&] { return completed_; });
  } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
    C10_THROW_ERROR(DistBackendError, "[Rank " + std::to_string(rank_) + "] " + description_ +
                    " timed out in blocking wait after " + std::to_string(timeout.count()) + " ms.");
  }
  if (exception_) std::rethrow_exception(exception_);
  if (predicted_) shim_clock().current_stream_waits(stream_device_, end_ns_);  // the caller's stream waits
  if (race_order_) shim_races().wait(race_order_, stream_device_);
  return true;
}

bool CoalescedWork::isCompleted() {
  return std::all_of(works_.begin(), works_.end(), [](auto& w) { return w->isCompleted(); });
}

bool CoalescedWork::isSuccess() const {
  return std::all_of(works_.begin(), works_.end(), [](auto& w) { return w->isSuccess(); });
}

std::exception_ptr CoalescedWork::exception() const {
  for (auto& w : works_) {
    if (auto e = w->exception()) return e;
  }
  return nullptr;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  for (auto& w : works_) w->wait(timeout);
  return true;
}

std::vector<at::Tensor> CoalescedWork::result() {
  std::vector<at::Tensor> all;
  for (auto& w : works_) {
    for (auto& t : w->result()) all.push_back(t);
  }
  return all;
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() {
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(c10::FutureType::create(c10::ListType::ofTensors()));
  for (auto& w : works_) futures.push_back(w->getFuture());
  auto all = c10::collectAll(futures);
  auto result = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  auto outputs = this->result();
  all->addCallback([result, outputs](c10::ivalue::Future& f) {
    if (f.hasError()) result->setError(f.exception_ptr());
    else result->markCompleted(c10::IValue(outputs));
  });
  return result;
}

}  // namespace mirage::nccl
