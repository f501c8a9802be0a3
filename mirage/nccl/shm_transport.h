// Same-host shared-memory transport of the emulated NCCL backend (implementation:
// shm_transport.cpp).
//
// Every emulated GPU of a session lives on this host, so a communicator needs no sockets: the
// ranks of a group map one /dev/shm segment (a slot per rank, a futex barrier, every rank's
// current call) for the collectives, and one ring per ordered pair of ranks, created on first
// use, for point-to-point traffic. All functions work on host memory (the device tensors'
// bytes, dense); counts are elements. A peer that does not arrive by the deadline, or that asked
// for a different call, raises c10::DistBackendError naming the call and the ranks concerned;
// the communicator is unusable after that, as an NCCL communicator is.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mirage::nccl {

using Clock = std::chrono::steady_clock;

// The collectives as the cross-rank check names them.
enum class Kind : int32_t {
  kAllReduce, kAllGather, kReduceScatter, kBroadcast, kReduce, kGather, kScatter, kAllToAll, kBarrier,
  kAllGatherUneven, kReduceScatterUneven,
};
const char* kind_name(Kind kind);
const char* reduce_op_name(c10d::ReduceOp::RedOpType op);  // "SUM", "AVG", ...

// What a rank asked for: compared with every peer's call at the call's first barrier.
struct Call {
  Kind kind;
  int32_t dtype;
  int32_t op_or_root;  // the reduce op, or the root
  int32_t padding = 0;  // numel stays 8-byte aligned in shared memory
  int64_t numel;  // per rank (all_gather: the input; reduce_scatter: the output); -1: may differ
  bool operator==(const Call&) const = default;
};

// Where a collective must be done by, and how to name it if it is not.
struct Timing {
  Clock::time_point deadline;
  std::chrono::milliseconds timeout;
  std::string what;   // e.g. "WorkNCCL(SeqNum=3, OpType=ALLREDUCE, ...)"
  uint64_t seq = 0;   // the call's number in its group, the same on every rank
};

// How the reduction treats the contributions (NCCL's ops; bitwise ones do not exist in NCCL).
struct Reduction {
  c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM;  // SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM
  double factor = 1.0;            // PREMUL_SUM with a scalar factor
  const void* factor_data = nullptr;  // PREMUL_SUM with a tensor factor: one element of the dtype
};

// One point-to-point transfer: `bytes` to or from group rank `peer`, due by `deadline`.
struct Transfer {
  bool send;
  int peer;
  char* data;
  size_t bytes;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout;
  size_t done = 0;          // payload bytes moved
  uint64_t header = 0;      // the message's length, sent ahead of it
  size_t header_done = 0;
  bool finished() const { return header_done == sizeof(header) && done == bytes; }
};

class Communicator {
 public:
  // Collective over the group's store: rank 0 creates the segment and publishes its name, the
  // others map it; the last rank to map it unlinks the name. Returns null when this process is
  // not in a mirage session (no MIRAGE_SESSION) or /dev/shm cannot hold the segment.
  static std::unique_ptr<Communicator> connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               std::chrono::milliseconds timeout);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // A name for this communicator instance, the same on all its ranks and different from every
  // other communicator of the session (a group re-created under an old name included).
  const std::string& instance() const { return instance_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  void all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, const Timing& timing);
  void reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
              const Timing& timing);
  // outs[r] = rank r's `in` (numel elements each).
  void all_gather(const std::vector<char*>& outs, const char* in, int64_t numel, at::ScalarType dtype,
                  const Timing& timing);
  void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                      const Timing& timing);
  void broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing);
  // Only the calls are exchanged and compared: a barrier, and the opening of collectives that
  // move their data over the pair rings (gather, scatter, all_to_all, uneven sizes).
  void agree(const Call& call, const Timing& timing);
  // Moves every transfer to completion, all at once (so no order of sends and receives can
  // deadlock). `channel` separates users: 0 point-to-point ops, 1 collectives. Whenever nothing
  // can move, `poll` may append transfers issued meanwhile; `finished(i)` is told of each one
  // done. A transfer past its deadline raises, naming `what` and the peer.
  void transfer(std::vector<Transfer>& transfers, int channel, const std::string& what,
                const std::function<void(std::vector<Transfer>&)>& poll = {},
                const std::function<void(size_t)>& finished = {});

  // Marks the communicator failed (a timeout or a desync elsewhere); later calls refuse.
  void check_usable(const std::string& what) const;

 private:
  struct Ring;
  Communicator(void* base, size_t bytes, int rank, int size, std::string instance);
  uint32_t* arrived() const;
  uint32_t* generation() const;
  uint64_t* entered(int r) const;
  uint32_t* doorbell(int r) const;
  Call* call(int buffer, int r) const;
  char* slot(int buffer, int r) const;
  int next_buffer() { return static_cast<int>(chunks_++ & 1); }
  void barrier(const Timing& timing);
  void exchange(int buffer, const Call& asked, bool first_chunk, const Timing& timing);
  void check_calls_match(int buffer, const Call& asked, const std::string& what);
  void ring_bell(int r);
  Ring& ring(int src, int dst, int channel);
  [[noreturn]] void fail_timeout(const Timing& timing, const std::vector<int>& missing, const char* waiting_for);

  char* base_;
  size_t bytes_;
  int rank_, size_;
  bool spin_;
  std::string instance_;
  uint64_t chunks_ = 0, barriers_ = 0;
  Call current_{};
  std::atomic<bool> unusable_{false};  // written by the point-to-point worker too
  std::vector<std::unique_ptr<Ring>> rings_;  // [channel][src][dst], mapped on first use
};

}  // namespace mirage::nccl
