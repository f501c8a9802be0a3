// Point-to-point operations (process_group.h): send and recv queue a transfer for the
// communicator's worker thread, which moves every pending transfer at once, as NCCL's stream
// would, so isend/irecv in any order and batch_isend_irecv never deadlock.

#include "process_group.h"

#include "clock.h"
#include "races.h"

namespace mirage::nccl {

using c10d::OpType;

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::point_to_point(std::vector<at::Tensor>& tensors, int peer, bool sending) {
  const at::Tensor& t = single(tensors);
  TORCH_CHECK_WITH(DistBackendError, !stopping_, "the process group was destroyed or aborted");
  // (A rank may send to itself, as NCCL allows within a batch: its own ring carries it.)
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "Invalid ", sending ? "destination" : "source", " rank ", peer,
                    " for a group of ", size_, " (this rank ", rank_, ")");
  const auto timeout = timeout_for(c10d::kUnsetTimeout);
  std::string profiling = std::string(sending ? "nccl:send " : "nccl:recv ") + std::to_string(rank_) +
                          (sending ? "->" : "<-") + std::to_string(peer);
  Pending p;
  {
    std::lock_guard<std::mutex> g(mu_);
    p.record = make_record(sending ? OpType::SEND : OpType::RECV, profiling.c_str(), sending ? "send" : "recv",
                           tensors, tensors, timeout, "", true);
  }
  p.record.peer = peer;
  p.work = c10::make_intrusive<EmulatedWork>(rank_, p.record.type, profiling.c_str(), tensors, tensors, p.record.seq,
                                             describe_work(p.record), profiler_group(), size_);
  record_param_comms(p.record, tensors, tensors);
  if (measure_durations_) p.work->time_it();
  p.transfer = Transfer{sending, transport_peer(peer), data(t), static_cast<size_t>(nbytes(t)), Clock::now() + timeout,
                        timeout};
  p.own_bytes = p.transfer.bytes;
  if (shim_clock().predict_only && !moves_bytes(t.scalar_type())) {  // no_payload.cpp: its size, not its bytes
    p.size_only = std::make_unique<uint64_t>(p.own_bytes);
    p.transfer.data = reinterpret_cast<char*>(p.size_only.get());
    p.transfer.bytes = sizeof(uint64_t);
  }
  if (shim_clock().profiler_cpu_op) p.cpu_op = shim_clock().profiler_cpu_op();
  if (t.is_cuda() && shim_clock().profiling_host_times()) {
    p.profiled_device = t.device().index();
    p.profiled_from = shim_clock().profiler_wall_ns();
  }
  if (shim_clock().on && t.is_cuda()) clock_transfer(p, t, peer, sending);
  if (shim_races().on && t.is_cuda()) {  // --check-races (races.h): a send reads, a receive writes
    const std::vector<at::Tensor> none;
    p.work->set_race_order(t.device().index(), p2p_stream(peer),
                           shim_races().issue(t.device().index(), p2p_stream(peer),
                                              "the NCCL stream of process group '" + group_name() +
                                                  "' to and from rank " + std::to_string(peer),
                                              sending ? tensors : none, sending ? none : tensors, profiling.c_str()));
  }
  keep_trace(p.record);
  record(p.record, true);
  c10::intrusive_ptr<EmulatedWork> work = p.work;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (coalescing_) coalesced_.push_back(work);
    queue_.push_back(std::move(p));
    if (!worker_.joinable()) worker_ = std::thread([this] { run_worker(); });
  }
  queue_cv_.notify_one();
  comm_->interrupt_transfer();
  return work;
}

void ProcessGroupNCCL::run_worker() {
  std::vector<Pending> active;
  std::vector<Transfer> transfers;
  const auto take_new = [&](std::vector<Transfer>& list) {
    std::lock_guard<std::mutex> g(mu_);
    // Destroying or aborting the group ends what is still pending, as ncclCommAbort does.
    TORCH_CHECK_WITH(DistBackendError, !stopping_, "the process group was destroyed or aborted while it was "
                     "pending");
    while (!queue_.empty()) {
      active.push_back(std::move(queue_.front()));
      queue_.pop_front();
      list.push_back(active.back().transfer);
    }
  };
  const auto finished = [&](size_t i) {
    Pending& done = active[i];
    if (done.cpu_op) shim_clock().adopt_cpu_op(done.cpu_op);  // torch.profiler: the op that posted it
    if (done.clock_device >= 0 && !done.transfer.send) clock_receive_end(done, transfers[i].header.clock);
    if (done.profiled_from >= 0) {
      shim_clock().profiler_collective(done.profiled_device, p2p_stream(done.record.peer), done.profiled_from,
                                       shim_clock().profiler_wall_ns(), done.transfer.send ? "nccl:send" : "nccl:recv",
                                       static_cast<int64_t>(done.own_bytes), -1);
    }
    if (done.cpu_op) shim_clock().adopt_cpu_op(0);
    active[i].record.completed_ns = wall_ns();
    active[i].record.state = "completed";
    finish_trace(active[i].record);
    record(active[i].record, false);
    if (done.size_only && !done.transfer.send && *done.size_only != done.own_bytes) {
      const c10::DistBackendError mismatch(c10::SourceLocation{__func__, __FILE__, __LINE__},
          "point-to-point " + describe_work(done.record) + ": a receive of " + std::to_string(done.own_bytes) +
          " bytes from group rank " +
          std::to_string(done.record.peer) + " matched a send of " + std::to_string(*done.size_only) +
          " bytes (a send and its recv must have the same size, as with NCCL)");
      return active[i].work->complete(on_failure(active[i].record, mismatch, false));
    }
    active[i].work->complete();
  };
  while (true) {
    {
      std::unique_lock<std::mutex> g(mu_);
      queue_cv_.wait(g, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
    }
    active.clear();
    transfers.clear();
    take_new(transfers);
    try {
      comm_->transfer(transfers, 0, "point-to-point " + describe_work(active[0].record), take_new, finished);
    } catch (const c10::DistBackendError& e) {
      for (size_t i = 0; i < active.size(); ++i) {
        if (transfers[i].finished()) continue;
        record(active[i].record, false);
        active[i].work->complete(on_failure(active[i].record, e, timed_out(e)));
      }
    }
  }
}

void ProcessGroupNCCL::stop_worker() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) worker_.detach();
    else worker_.join();
  }
  // What the worker never took fails as well, as ncclCommAbort fails everything pending.
  std::deque<Pending> left;
  {
    std::lock_guard<std::mutex> g(mu_);
    left.swap(queue_);
  }
  for (auto& p : left) {
    record(p.record, false);
    p.work->complete(std::make_exception_ptr(c10::DistBackendError(
        c10::SourceLocation{__func__, __FILE__, __LINE__},
        log_prefix() + describe_work(p.record) + " failed: the process group was destroyed or aborted while it "
        "was pending")));
  }
}

}  // namespace mirage::nccl
