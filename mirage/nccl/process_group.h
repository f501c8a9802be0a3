// The emulated NCCL backend: a c10d Backend of its own, the one place every collective on an
// emulated GPU passes, whoever issues it (Python, DDP's reducer, FSDP, functional collectives).
//
// It is what torch.distributed builds where it would build ProcessGroupNCCL (mirage puts this
// class in its place, see mirage/runtime/distributed.py), so `init_process_group("nccl")`, the
// cuda default, "cuda:nccl,cpu:gloo", new_group, DeviceMesh and every group a framework creates
// get it for cuda. Around each operation it does what ProcessGroupNCCL does around a kernel
// launch. One concern a file:
//   backend.cpp         the communicator's life: connection to a transport, shrink, abort,
//                       NCCL_DEBUG=INFO's lines; the Python binding
//   checks.cpp          NCCL's argument checks and error messages (and the duplicate-GPU check
//                       of the first collective); the ranks' calls are compared by the transports
//   dispatch.cpp        each collective's arguments to the transport's calls, through
//                       collective(): the one path every collective takes
//   no_payload.cpp      --timing --predict-only: collectives whose ranks compare their calls and
//                       agree on the clock, but move no payload (collectives() below)
//   point_to_point.cpp  send/recv: a worker thread that moves every pending transfer at once
//   work.cpp            Work objects with futures (work.h)
//   watchdog.cpp        what a failed or timed-out operation does (TORCH_NCCL_ASYNC_ERROR_HANDLING,
//                       TORCH_NCCL_BLOCKING_WAIT), faults on purpose (--fault)
//   flight_recorder.cpp the feed: a JSON line per start and end to the session, the trace buffer,
//                       profiler events named as NCCL's ("nccl:all_reduce")
//   clock.cpp           clocked mode: the communicator's streams and each operation's predicted end
//   races.cpp           --check-races: each operation's reads and writes on its stream (races.h)
//
// Collectives run to completion in the calling thread, in issue order: on a GPU they would run
// in issue order on the communicator's stream, and a caller that touches their buffers before
// waiting races with them there (--check-races reports it). Point-to-point operations go to a worker thread that moves every
// pending send and receive at once, as NCCL's stream would, so isend/irecv in any order and
// batch_isend_irecv never deadlock.
#pragma once

#include "checks.h"
#include "flight_recorder.h"
#include "transport.h"
#include "work.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace mirage::nccl {

// ---------------------------------------------------------------- options

struct NCCLConfig : torch::CustomClassHolder {
  int blocking = 1;
  int cga_cluster_size = 4;
  int min_ctas = 1;
  int max_ctas = 32;
  std::string net_name;
  int split_share = 0;
  int cta_policy = 0;
};

struct Options : c10d::Backend::Options {
  explicit Options(bool is_high_priority_stream = false)
      : c10d::Backend::Options("nccl", std::chrono::minutes(10)), is_high_priority_stream(is_high_priority_stream),
        config(c10::make_intrusive<NCCLConfig>()) {}
  bool is_high_priority_stream;
  c10::intrusive_ptr<NCCLConfig> config;
  c10::intrusive_ptr<c10d::Backend> split_from;
  int split_color = 0;
};

// ---------------------------------------------------------------- the backend

class ProcessGroupNCCL final : public c10d::Backend {
 public:
  // backend.cpp: life
  ProcessGroupNCCL(c10::intrusive_ptr<c10d::Store> store, int rank, int size, c10::intrusive_ptr<Options> options);
  ~ProcessGroupNCCL() override { stop_worker(); }

  const std::string getBackendName() const override { return "nccl"; }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override { return options_; }
  c10::intrusive_ptr<Options> options() const { return options_; }
  bool supportsCoalescing() const override { return true; }
  bool supportsSplitting() const override { return false; }
  // ncclCommShrink exists from NCCL 2.27 (the emulated NCCL's version); RCCL 2.26 lacks it, so a
  // ROCm build of torch refuses dist.shrink_group, and so does an AMD profile.
  bool supportsShrinking() const override { return std::string(library()) == "NCCL"; }

  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                                           const c10::intrusive_ptr<c10d::Backend::Options>& opts_override) override;
  uint64_t uid() const { return uid_; }
  const std::string& instance() const { return comm_->instance(); }

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  void setTimeout(std::chrono::milliseconds timeout) override { options_->timeout = timeout; }
  void add_ephemeral_timeout(std::chrono::milliseconds extra) { ephemeral_timeout_ += extra; }
  void eagerConnectSingleDevice(at::Device) override {}
  void enableCollectivesTiming() override { measure_durations_ = true; }

  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // dispatch.cpp: collectives
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    TORCH_CHECK(false, "ProcessGroupNCCL does not support recvAnysource");
  }

  // point_to_point.cpp
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int) override {
    return point_to_point(tensors, dst, true);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int) override {
    return point_to_point(tensors, src, false);
  }

  // backend.cpp: ncclCommAbort: what waits on this communicator here fails at once, and so do the
  // peers waiting for this rank (ncclRemoteError there); a new group is what can be used next.
  void abort() override;
  void shutdown() override { stop_worker(); }
  c10d::ErrorType getError() override { return failed_ ? c10d::ErrorType::COMM_ERROR : c10d::ErrorType::SUCCESS; }

 private:
  static uint64_t& next_uid();
  static char* data(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }
  // Where collectives go: the transport (answering for stood-in members under --stand-ins), or
  // under --predict-only the same without payload.
  Communicator& collectives() { return without_payload_ ? *without_payload_ : with_payload(); }
  Communicator& with_payload() { return stand_ins_ ? *stand_ins_ : *comm_; }
  // A peer's rank on the transport (under --stand-ins, among the running members; an absent one refused).
  int transport_peer(int peer) const;

  std::string group_name() const { return options_->group_name.empty() ? "0" : options_->group_name; }
  std::vector<uint64_t> group_ranks() const;
  int my_global_rank() const;
  void log_init() const;  // backend.cpp

  // checks.cpp
  const at::Tensor& single(std::vector<at::Tensor>& tensors) const;
  void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* what) const;
  void check_root(int root) const;
  void check_distinct_gpus(const std::vector<at::Tensor>& tensors);

  // dispatch.cpp
  template <typename Fn>
  c10::intrusive_ptr<c10d::Work> collective(c10d::OpType type, const char* profiling, const char* name,
                                            const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs,
                                            std::chrono::milliseconds asked_timeout, std::string reduce_op, Fn&& run);
  void gather_flat(const at::Tensor& out, const at::Tensor& in);
  void scatter_flat(const at::Tensor& out, const at::Tensor& in, const Reduction& reduction);
  void exchange_pieces(Kind kind, int root, at::ScalarType dtype, const std::vector<std::pair<char*, size_t>>& send,
                       const std::vector<std::pair<char*, size_t>>& recv);
  static std::string op_name(const c10d::ReduceOp& op) { return reduce_op_name(op.op_); }

  // flight_recorder.cpp
  Record make_record(c10d::OpType type, const char* profiling, const char* name, const std::vector<at::Tensor>& ins,
                     const std::vector<at::Tensor>& outs, std::chrono::milliseconds timeout, std::string reduce_op,
                     bool p2p);
  void record(const Record& r, bool entering);
  void keep_trace(const Record& r);
  void finish_trace(const Record& r);
  std::tuple<std::string, std::string> profiler_group() const { return {group_name(), getGroupDesc()}; }
  void record_param_comms(const Record& r, const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs);
  static std::string param_comms_name(const Record& r);

  // watchdog.cpp
  std::chrono::milliseconds timeout_for(std::chrono::milliseconds asked) const;
  std::string describe_work(const Record& r) const;
  std::string log_prefix() const;
  std::exception_ptr on_failure(const Record& r, const c10::Error& e, bool timed_out);
  static bool device_lost();
  void dump_trace_once();
  static bool timed_out(const c10::Error& e);
  void inject_fault(const Record& r);

  // point_to_point.cpp
  struct Pending {
    c10::intrusive_ptr<EmulatedWork> work;
    Record record;
    Transfer transfer;
    int clock_device = -1;  // clocked mode: where, when ready and for how long
    int64_t ready_ns = 0, cost_ns = 0;
    uint64_t own_bytes = 0;  // the tensor's (what the timeline reports)
    // --predict-only, floating-point data: the transfer carries this cell (the size, sent, or
    // the sender's, received) instead of the tensor's bytes
    std::unique_ptr<uint64_t> size_only;
    // torch.profiler: the CPU op that posted it (0: none), and without clocked mode its device
    // and when it was posted (-1: not recorded), for the GPU side's SendRecv kernel
    uint64_t cpu_op = 0;
    int profiled_device = -1;
    int64_t profiled_from = -1;
  };

  // clock.cpp
  int64_t comm_stream();
  int64_t p2p_stream(int peer);
  std::pair<int, int64_t> bus_shape(const Record& r) const;
  bool clock_collective_start();
  // `dtype`: the collective's data's c10::ScalarType (-1: none), for the profiler's kernel names
  void clock_collective_end(EmulatedWork& work, const Record& r, const char* profiling, int dtype);
  void clock_transfer(Pending& p, const at::Tensor& t, int peer, bool sending);
  void clock_receive_end(Pending& done, int64_t sender_clock);

  // point_to_point.cpp
  c10::intrusive_ptr<c10d::Work> point_to_point(std::vector<at::Tensor>& tensors, int peer, bool sending);
  void run_worker();
  void stop_worker();

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<Options> options_;
  uint64_t uid_;
  std::unique_ptr<Communicator> comm_;
  std::optional<StandInMap> stand_ins_map_;  // --stand-ins, where some members are stood in for
  std::unique_ptr<Communicator> stand_ins_;  // over comm_, answering for them (declared after it)
  std::unique_ptr<Communicator> without_payload_;  // --predict-only: over stand_ins_ or comm_ (declared after them)
  bool blocking_wait_ = false;
  std::atomic<bool> measure_durations_{false};  // Works measure their duration
  int async_error_handling_ = 3;
  std::chrono::milliseconds ephemeral_timeout_{0};
  std::mutex collective_mu_;
  Timing timing_;  // of the collective in progress (under collective_mu_)
  std::atomic<uint64_t> seq_{0}, p2p_seq_{0};
  int shrinks_ = 0;  // this communicator's shrinks so far (each forms under a key of its own)
  bool gpus_checked_ = false;
  int nodes_in_group_ = 1;               // emulated nodes the group spans (from the first collective)
  double nic_slowdown_ = 1.0;            // --fault slow-link between two of them (clocked mode)
  std::vector<int64_t> host_of_rank_;    // each rank's node (its NCCL_HOSTID's hash)
  std::vector<int64_t> node_of_rank_;    // each rank's emulated node (MIRAGE_NODE_RANK)
  int64_t comm_stream_ = -1;             // clocked mode: the communicator's stream
  std::mutex p2p_streams_mu_;
  std::map<int, int64_t> p2p_streams_;   // clocked mode: a stream per point-to-point peer
  int barrier_device_ = -1;  // see barrier()
  std::atomic<bool> failed_{false};
  std::mutex mu_;  // coalescing state and the point-to-point queue
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<EmulatedWork>> coalesced_;
  std::deque<Pending> queue_;
  std::condition_variable queue_cv_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace mirage::nccl
