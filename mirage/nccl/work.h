// What a collective or point-to-point call returns: a c10d Work with its future, as
// ProcessGroupNCCL's WorkNCCL behaves (wait, timeouts in blocking wait, durations, and in
// clocked mode the predicted end its waiter's stream waits for).
#pragma once

#include "transport.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <string>
#include <tuple>
#include <vector>

namespace mirage::nccl {

class EmulatedWork final : public c10d::Work {
 public:
  EmulatedWork(int rank, c10d::OpType type, const char* profiling_title, const std::vector<at::Tensor>& inputs,
               std::vector<at::Tensor> outputs, uint64_t seq, std::string description,
               std::tuple<std::string, std::string> group, int group_size);

  ~EmulatedWork() override;
  // Clocked mode: the operation ends at `end_ns` on `stream` (its communicator's) of `device`.
  void set_predicted_end(int device, int64_t stream, int64_t end_ns) {
    stream_device_ = device;
    stream_ = stream;
    end_ns_ = end_ns;
    predicted_ = true;
  }
  // --check-races: it ran on `stream` of `device`, and `order` (races.h) is what wait() orders the
  // waiter's stream after.
  void set_race_order(int device, int64_t stream, void* order) {
    stream_device_ = device;
    stream_ = stream;
    race_order_ = order;
  }

  // Completes the work (and its future); an error is kept for wait() to raise. In clocked mode
  // and with --check-races the future's events are recorded on the communicator's stream, as
  // ProcessGroupNCCL's are, so whoever waits on the future (DDP's reducer) waits for the
  // operation (its predicted end; its place in the streams' order).
  void complete(std::exception_ptr error = nullptr);

  std::vector<at::Tensor> result() override { return outputs_; }
  // TORCH_NCCL_ENABLE_TIMING (or enableCollectivesTiming): how long the operation ran.
  float getDuration() const override;
  void time_it() { timed_ = true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  uint64_t getSequencenumber() const override { return seq_; }
  void synchronize() override {}

  bool wait(std::chrono::milliseconds timeout) override;

  const std::string& description() const { return description_; }

 private:
  std::vector<at::Tensor> outputs_;
  uint64_t seq_;
  std::string description_;
  std::tuple<std::string, std::string> group_;  // (name, description), for the profiler
  int group_size_;
  Clock::time_point started_ = Clock::now();
  float duration_ms_ = 0;
  bool timed_ = false;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  int stream_device_ = -1;  // clocked mode, --check-races: where the operation runs
  int64_t stream_ = 0;
  bool predicted_ = false;  // clocked mode: when it ends
  int64_t end_ns_ = 0;
  void* race_order_ = nullptr;  // --check-races
};

// A work made of others (the coalesced ops of a batch): complete when all of them are.
class CoalescedWork final : public c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<EmulatedWork>> works)
      : c10d::Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {}
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout) override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<EmulatedWork>> works_;
};

}  // namespace mirage::nccl
