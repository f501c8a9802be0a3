// Clocked mode in the emulated NCCL (clock.h): each operation's place on the predicted timeline.
// A collective starts when the last rank reaches it (the ranks' ready times travel in the call
// they compare anyway: Call::ready_ns, Communicator::agreed_ready_ns) and lasts what op_cost
// says for its size; a receive starts when both its sender and its own stream are there.

#include "clock.h"

#include "process_group.h"

#include <dlfcn.h>

#include <cstdlib>

namespace mirage::nccl {

// A send or a receive, as the shim's cost model numbers it (after Kind's collectives).
constexpr int kP2pKind = 9;

const ShimClock& ShimClock::get() {
  static const ShimClock clock = [] {
    ShimClock c;
    c.enabled = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "mirage_timing_enabled"));
    c.new_stream = reinterpret_cast<int64_t (*)()>(dlsym(RTLD_DEFAULT, "mirage_clock_new_stream"));
    c.ready = reinterpret_cast<int64_t (*)(int, int64_t)>(dlsym(RTLD_DEFAULT, "mirage_clock_ready"));
    c.collective = reinterpret_cast<int64_t (*)(int, int64_t, int64_t, int64_t, const char*, int64_t, int, int, int)>(
        dlsym(RTLD_DEFAULT, "mirage_clock_place_collective"));
    c.current_stream_waits = reinterpret_cast<void (*)(int, int64_t)>(
        dlsym(RTLD_DEFAULT, "mirage_clock_current_stream_waits"));
    c.cost_ns = reinterpret_cast<int64_t (*)(int, int64_t, int, int, double)>(
        dlsym(RTLD_DEFAULT, "mirage_collective_cost_ns"));
    c.link_slowdown = reinterpret_cast<double (*)(const int64_t*, int)>(dlsym(RTLD_DEFAULT, "mirage_link_slowdown"));
    c.profiler_recording = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "mirage_profiler_recording"));
    c.profiler_wall_ns = reinterpret_cast<int64_t (*)()>(dlsym(RTLD_DEFAULT, "mirage_profiler_wall_ns"));
    c.profiler_collective = reinterpret_cast<void (*)(int, int64_t, int64_t, int64_t, const char*, int64_t, int)>(
        dlsym(RTLD_DEFAULT, "mirage_profiler_collective"));
    c.profiler_cpu_op = reinterpret_cast<uint64_t (*)()>(dlsym(RTLD_DEFAULT, "mirage_profiler_cpu_op"));
    c.adopt_cpu_op = reinterpret_cast<void (*)(uint64_t)>(dlsym(RTLD_DEFAULT, "mirage_profiler_adopt_cpu_op"));
    c.on = c.enabled && c.new_stream && c.ready && c.collective && c.current_stream_waits && c.cost_ns &&
           c.link_slowdown && c.enabled();
    const char* predict_only = std::getenv("MIRAGE_PREDICT_ONLY");
    c.predict_only = c.on && predict_only && *predict_only;
    return c;
  }();
  return clock;
}

// The communicator's own stream (ProcessGroupNCCL takes one per device).
int64_t ProcessGroupNCCL::comm_stream() {
  if (comm_stream_ < 0) comm_stream_ = shim_clock().new_stream();
  return comm_stream_;
}

// Point-to-point traffic with `peer` has a stream of its own, as ProcessGroupNCCL gives each pair
// of ranks a communicator and stream (sends and receives of other pairs overlap).
int64_t ProcessGroupNCCL::p2p_stream(int peer) {
  std::lock_guard<std::mutex> g(p2p_streams_mu_);
  auto [it, fresh] = p2p_streams_.emplace(peer, 0);
  if (fresh) it->second = shim_clock().new_stream();
  return it->second;
}

// The collective as nccl-tests size it: its kind (mirage::nccl::Kind) and the bytes its bus
// factor applies to (the buffer for all_reduce, broadcast, reduce; the whole gathered or
// scattered buffer for all_gather, reduce_scatter, all_to_all, gather, scatter).
std::pair<int, int64_t> ProcessGroupNCCL::bus_shape(const Record& r) const {
  const std::string& name = r.name;
  const int64_t out_bytes = r.bytes_out;
  if (name.rfind("all_reduce", 0) == 0) return {static_cast<int>(Kind::kAllReduce), r.bytes};
  if (name.rfind("all_gather", 0) == 0) return {static_cast<int>(Kind::kAllGather), std::max(out_bytes, r.bytes * size_)};
  if (name.rfind("reduce_scatter", 0) == 0) return {static_cast<int>(Kind::kReduceScatter), std::max(r.bytes, out_bytes * size_)};
  if (name == "broadcast") return {static_cast<int>(Kind::kBroadcast), r.bytes};
  if (name == "reduce") return {static_cast<int>(Kind::kReduce), r.bytes};
  if (name == "gather") return {static_cast<int>(Kind::kGather), r.bytes * size_};
  if (name == "scatter") return {static_cast<int>(Kind::kScatter), out_bytes * size_};
  if (name.rfind("all_to_all", 0) == 0) return {static_cast<int>(Kind::kAllToAll), r.bytes};
  return {static_cast<int>(Kind::kBarrier), 0};
}

// Whether the collective about to run is clocked; if so, the call carries when this rank's
// communicator stream lets it start.
bool ProcessGroupNCCL::clock_collective_start() {
  const bool clocked = shim_clock().on && barrier_device_ >= 0;
  if (clocked) timing_.ready_ns = shim_clock().ready(barrier_device_, comm_stream());
  return clocked;
}

// A clocked collective that succeeded: it starts when the last rank reached it and takes its cost.
void ProcessGroupNCCL::clock_collective_end(EmulatedWork& work, const Record& r, const char* profiling, int dtype) {
  const auto [kind, bus_bytes] = bus_shape(r);
  const int64_t cost = shim_clock().cost_ns(kind, bus_bytes, size_, nodes_in_group_, nic_slowdown_);
  const int64_t end = shim_clock().collective(barrier_device_, comm_stream(), comm_->agreed_ready_ns(), cost,
                                              profiling, bus_bytes, dtype, kind, size_);
  work.set_predicted_end(barrier_device_, comm_stream(), end);
}

// A send leaves when this rank's stream reaches it, its clock in the message's header; the
// receive ends once both sides are there (clock_receive_end, when the message arrives).
void ProcessGroupNCCL::clock_transfer(Pending& p, const at::Tensor& t, int peer, bool sending) {
  p.clock_device = t.device().index();
  const bool across = static_cast<size_t>(peer) < host_of_rank_.size() && host_of_rank_[peer] != host_of_rank_[rank_];
  double slowdown = 1.0;  // a slow link between the two ranks' nodes (--fault slow-link)
  if (across && static_cast<size_t>(peer) < node_of_rank_.size()) {
    const int64_t pair[2] = {node_of_rank_[rank_], node_of_rank_[peer]};
    slowdown = shim_clock().link_slowdown(pair, 2);
  }
  p.cost_ns = shim_clock().cost_ns(kP2pKind, nbytes(t), 2, across ? 2 : 1, slowdown);
  p.ready_ns = shim_clock().ready(p.clock_device, p2p_stream(peer));
  if (sending) {
    p.transfer.clock = p.ready_ns;
    p.work->set_predicted_end(p.clock_device, p2p_stream(peer),
                              shim_clock().collective(p.clock_device, p2p_stream(peer), p.ready_ns, p.cost_ns,
                                                      "nccl:send", nbytes(t), -1, kP2pKind, 2));
  }
}

// A receive, both sides there: it starts from the later of the two.
void ProcessGroupNCCL::clock_receive_end(Pending& done, int64_t sender_clock) {
  const int64_t start = std::max(done.ready_ns, sender_clock);
  const int64_t stream = p2p_stream(done.record.peer);
  done.work->set_predicted_end(done.clock_device, stream,
                               shim_clock().collective(done.clock_device, stream, start, done.cost_ns, "nccl:recv",
                                                       static_cast<int64_t>(done.own_bytes), -1, kP2pKind, 2));
}

}  // namespace mirage::nccl
