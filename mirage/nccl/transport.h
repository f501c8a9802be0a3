// The emulated NCCL backend's transports: what moves a communicator's bytes between its ranks.
//
// Two, as NCCL has: same-host shared memory (shm_transport.cpp; NCCL's SHM and P2P transports),
// and TCP sockets (socket_transport.cpp; NCCL's net transport), which NCCL_SHM_DISABLE=1 with
// NCCL_P2P_DISABLE=1 select, and which ranks on different isolated nodes use (node_hierarchy.cpp
// combines the two). Both implement the
// Communicator below with the same semantics: every function works on host memory (the device
// tensors' bytes, dense); counts are elements; each element is reduced once, in rank order, so
// every rank gets the same bits. Every collective first compares the ranks' calls, so a desync
// fails on every rank naming each call. A peer that does not arrive by the deadline raises
// c10::DistBackendError naming the call and the ranks concerned; a peer that died, or whose
// communicator was aborted, raises NCCL's ncclRemoteError as soon as it is seen (within 200 ms),
// as NCCL's proxy reports a closed connection. The communicator is unusable after either, as an
// NCCL communicator is.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mirage::nccl {

using Clock = std::chrono::steady_clock;

// The collectives as the cross-rank check names them.
enum class Kind : int32_t {
  kAllReduce, kAllGather, kReduceScatter, kBroadcast, kReduce, kGather, kScatter, kAllToAll, kBarrier,
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
  // Clocked mode: when this rank's stream lets the call start (predicted ns); not compared.
  int64_t ready_ns = 0;
  bool operator==(const Call& o) const {
    return kind == o.kind && dtype == o.dtype && op_or_root == o.op_or_root && numel == o.numel;
  }
};

// Where a collective must be done by, and how to name it if it is not.
struct Timing {
  Clock::time_point deadline;
  std::chrono::milliseconds timeout;
  std::string what;   // e.g. "WorkNCCL(SeqNum=3, OpType=ALLREDUCE, ...)"
  uint64_t seq = 0;   // the call's number in its group, the same on every rank
  int64_t ready_ns = 0;  // clocked mode: when this rank may start the call (Call::ready_ns)
};

// How the reduction treats the contributions (NCCL's ops; bitwise ones do not exist in NCCL).
struct Reduction {
  c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM;  // SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM
  double factor = 1.0;            // PREMUL_SUM with a scalar factor
  const void* factor_data = nullptr;  // PREMUL_SUM with a tensor factor: one element of the dtype
};

// What travels ahead of a message: its length (a transport may flag it), and in clocked mode
// the time the sender's stream reached the send, from which the receive can start.
struct MessageHeader {
  uint64_t length = 0;
  int64_t clock = 0;
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
  MessageHeader header;     // sent ahead of the message (received: the sender's)
  int64_t clock = 0;        // clocked mode, sending: when this rank's stream reaches the send
  size_t header_done = 0;
  uint64_t source = 0;      // a direct copy (shared memory transport): where the bytes lie in the sender's memory
  size_t source_done = 0;
  bool finished() const { return header_done == sizeof(header) && done == bytes; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // A name for this communicator instance, the same on all its ranks and different from every
  // other communicator of the session (a group re-created under an old name included).
  const std::string& instance() const { return instance_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual const char* transport() const = 0;
  // How bytes reach group rank `peer`, in NCCL_DEBUG=INFO's words ("P2P/direct pointer",
  // "SHM/direct/direct", "NET/Socket/0").
  virtual std::string peer_path(int peer) const = 0;

  virtual void all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                          const Timing& timing) = 0;
  virtual void reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
                      const Timing& timing) = 0;
  // outs[r] = rank r's `in` (numel elements each).
  virtual void all_gather(const std::vector<char*>& outs, const char* in, int64_t numel, at::ScalarType dtype,
                          const Timing& timing) = 0;
  // out (numel) = the reduction over ranks of their in[rank * numel ...] (in: size x numel).
  virtual void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype,
                              const Reduction& reduction, const Timing& timing) = 0;
  virtual void broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) = 0;
  // Only the calls are exchanged and compared: a barrier, and the opening of collectives that
  // move their data point to point (gather, scatter, all_to_all).
  virtual void agree(const Call& call, const Timing& timing) = 0;
  // Moves every transfer to completion, all at once (so no order of sends and receives can
  // deadlock). `channel` separates users: 0 point-to-point ops, 1 collectives. Whenever nothing
  // can move, `poll` may append transfers issued meanwhile; `finished(i)` is told of each one
  // done. A transfer past its deadline raises, naming `what` and the peer.
  virtual void transfer(std::vector<Transfer>& transfers, int channel, const std::string& what,
                        const std::function<void(std::vector<Transfer>&)>& poll = {},
                        const std::function<void(size_t)>& finished = {}) = 0;
  // gather, scatter, all_to_all: the calls agreed (`asked`), then send[r] goes to rank r and
  // recv[r] comes from it (a null piece is none; this rank's own piece is copied). By default
  // the pieces travel as transfers on channel 1.
  using Piece = std::pair<char*, size_t>;
  virtual void exchange_pieces(const Call& asked, const std::vector<Piece>& send, const std::vector<Piece>& recv,
                               const Timing& timing);
  // Wakes a transfer() of this process that waits for its peers, so that it takes the work just
  // queued (`poll`) now: its sends may be what the peers wait for.
  virtual void interrupt_transfer() = 0;

  // Refuses a communicator that failed before (a timeout or a desync).
  void check_usable(const std::string& what) const;
  // Whether the last failure was NCCL's ncclRemoteError (a peer died or aborted), which
  // ProcessGroupNCCL's watchdog turns into taking the process down.
  bool remote_failed() const { return remote_failed_; }
  // ncclCommAbort: this rank's pending and future calls fail, and the peers waiting for it are
  // told (ncclRemoteError on their side), as NCCL's proxy connections close.
  virtual void abort() { unusable_ = aborted_ = true; }
  // Clocked mode: the latest ready time of all ranks in the last call compared, which is when a
  // collective starts (the last rank to reach it starts it).
  int64_t agreed_ready_ns() const { return agreed_ready_ns_; }

 protected:
  Communicator(int rank, int size, std::string instance) : instance_(std::move(instance)), rank_(rank), size_(size) {}
  // Raises the desync report unless every rank's call equals `asked` (calls[r]: rank r's).
  void check_calls_match(const Call* calls, const Call& asked, const std::string& what);
  [[noreturn]] void fail_timeout(const Timing& timing, const std::vector<int>& missing, const char* waiting_for);
  // ncclRemoteError: group rank `peer` is gone; `last_error` is what NCCL's "Last error:" says.
  [[noreturn]] void fail_remote(const std::string& last_error);
  // Raises if this communicator was aborted (by another thread) while a call of it waited.
  void check_not_aborted(const std::string& what) const;
  // A receive whose matching send had another size (the header of `t` says what was sent), or
  // on the sending side, a send the receiver refused for that reason.
  [[noreturn]] void fail_size(const Transfer& t, const std::string& what);
  // exchange_pieces' copy of what a rank sends itself (sizes checked).
  static void copy_own_piece(const Piece& send, const Piece& recv);

  std::string instance_;
  int rank_, size_;
  std::atomic<bool> unusable_{false};  // written by the point-to-point worker too
  std::atomic<bool> remote_failed_{false}, aborted_{false};
  int64_t agreed_ready_ns_ = 0;
};

// The NCCL (RCCL) version the backend reports, for its error messages ("2.27.5"); set by the
// runtime from the version torch.cuda.nccl.version() gives.
std::string& nccl_version();
// Whether process `pid` has ended (gone, or a zombie nobody reaped yet).
bool process_ended(int64_t pid);

// acc = acc (op) x, elementwise, in `dtype` (bool as uint8). Plain loops, vectorised by the
// compiler: ATen kernels would wake intra-op threads, and with more ranks than cores the peers
// need every core.
void accumulate(at::ScalarType dtype, char* acc, const char* x, int64_t n, c10d::ReduceOp::RedOpType op);
// memcpy for a P2P copy between two ranks' tensors: from kStreamingCopyBytes, with stores that
// bypass the cache (the destination is not read again soon, and a cached store first reads the
// line it overwrites: a third of the memory traffic of a copy, on a host whose ranks are bound
// by its memory bandwidth).
constexpr size_t kStreamingCopyBytes = size_t{256} << 10;
void copy_between_ranks(char* to, const char* from, size_t bytes);
// PREMUL_SUM's scaling of one contribution (data *= factor); with `divisor`, AVG's division.
void scale(at::ScalarType dtype, char* data, int64_t n, const Reduction& reduction, int divisor);

// The transports. Both are collective over the group's store and block until every rank has
// joined (sockets `on_first_use`: not collective, each pair connects at its first transfer); null when the transport cannot serve this process (shared memory: no mirage session,
// or /dev/shm too small). With `p2p` (NCCL_P2P_DISABLE unset), shared memory copies large
// messages straight between the ranks' device memory where every rank can map every peer's.
std::unique_ptr<Communicator> connect_shared_memory(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    bool p2p, std::chrono::milliseconds timeout);
// `on_first_use`: each pair of ranks connects at its first transfer (not collective).
std::unique_ptr<Communicator> connect_sockets(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                              std::chrono::milliseconds timeout, bool on_first_use = false);
// Ranks on isolated emulated nodes (MIRAGE_ISOLATED_NODES): shared memory within each node and
// sockets across nodes (node_hierarchy.cpp); a group within one node is plain shared memory.
std::unique_ptr<Communicator> connect_across_nodes(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                   bool p2p, std::chrono::milliseconds timeout);
// --timing --predict-only (no_payload.cpp): collectives through `transport` whose ranks only
// compare their calls and agree on when the collective starts; no payload moves. Point-to-point
// transfers still go through `transport`. `transport` keeps the state (failures, agreed ready
// time) and must outlive the result.
std::unique_ptr<Communicator> without_payload(Communicator& transport);
// --predict-only: whether data of `dtype` moves its bytes: integers and bools, which steer the
// program; floating-point data is what no kernel computed.
bool moves_bytes(at::ScalarType dtype);
// --stand-ins, --stand-ins-in-node (stand_ins.cpp): a group's members, of which those of a
// data-parallel replica other than 0, or not first in their tensor-parallel group on their node,
// are stood in for by the running member at their place. Null when every member runs.
struct StandInMap {
  int rank = 0;                // the caller's full group rank
  int running_rank = 0;       // its rank among the running members (the transport's)
  int running_size = 0;
  std::vector<int> stand_in;  // per member: the running rank that answers for it (its own if it runs)
  std::vector<char> runs;     // per member: whether it runs (else its stand-in answers for it)
  std::vector<int> node_replica;  // per member: its data-parallel replica (0: on a running node)
  std::vector<int> local_offset;  // per member: its distance from its stand-in on their node
};
std::optional<StandInMap> stand_in_map(int rank, int size, const std::vector<uint64_t>& global_ranks);
// The group's collectives over its full membership, through `running` (the running members'
// transport, which keeps the state and must outlive the result).
std::unique_ptr<Communicator> with_stand_ins(Communicator& running, StandInMap map);
// The address this process's socket connections are made to, and the interface it is on (see
// socket_transport.cpp); NCCL_DEBUG=INFO names it.
std::string socket_interface();

}  // namespace mirage::nccl
