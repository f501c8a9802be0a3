// A communicator over ranks on several isolated emulated nodes: shared memory (SHM/P2P) inside
// each node, sockets between nodes, as NCCL moves a node's traffic over NVLink/xGMI and the
// nodes' traffic over the NIC.
//
// Isolated nodes (mirage run --isolate-nodes) have a /dev/shm each, so one shared-memory
// segment cannot hold the whole group; and cross-node bytes must cross each node's eth0 for the
// network to be what is tested. So the group is three communicators:
//   local   the ranks of this node (shm_transport.cpp), ordered by group rank; local rank 0 is
//           the node's leader
//   leaders the node leaders (socket_transport.cpp), ordered by their group rank
//   mesh    every rank (socket_transport.cpp): point-to-point traffic and the collectives that
//           NCCL also builds from it (gather, scatter, all_to_all) go straight to their peer;
//           a pair connects at its first transfer, as NCCL's point-to-point connections
// and each collective is the phases NCCL's hierarchical algorithms run: reduce in the node,
// reduce across the leaders, broadcast in the node. Every rank still gets the same bits (the
// leaders' result is what each node broadcasts). Each phase compares the calls of the ranks it
// joins, so a desync is still found (named by the phase's operation), and a peer that dies fails
// the phase that waits for it with ncclRemoteError.
//
// Clocked mode: each phase starts from the latest ready time the previous one agreed on, so the
// last phase's agreed time is the whole group's, as one call would have it.

#include "transport.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

namespace mirage::nccl {
namespace {

class HierarchicalCommunicator final : public Communicator {
 public:
  HierarchicalCommunicator(int rank, int size, std::vector<int> node_of_rank, std::unique_ptr<Communicator> local,
                           std::unique_ptr<Communicator> leaders, std::unique_ptr<Communicator> mesh)
      : Communicator(rank, size, mesh->instance()),
        node_of_rank_(std::move(node_of_rank)),
        local_(std::move(local)),
        leaders_(std::move(leaders)),
        mesh_(std::move(mesh)) {
    for (int r = 0; r < size_; ++r) ranks_of_node_[node_of_rank_[r]].push_back(r);
    for (const auto& node : ranks_of_node_) max_local_ = std::max(max_local_, static_cast<int>(node.second.size()));
  }

  const char* transport() const override { return "shared memory within a node, sockets across nodes"; }
  std::string peer_path(int peer) const override {
    if (node_of_rank_[peer] != node()) return "NET/Socket/0";
    const auto& mine = ranks_of_node_.at(node());
    return local_->peer_path(static_cast<int>(std::find(mine.begin(), mine.end(), peer) - mine.begin()));
  }

  void all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                  const Timing& timing) override {
    guarded([&] { hierarchical_all_reduce(data, numel, dtype, reduction, timing); });
  }

  // The root's result is the all-reduce's; the other ranks' buffers stay as they were, as NCCL
  // leaves a reduce's non-root send buffers.
  void reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
              const Timing& timing) override {
    guarded([&] {
      const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
      std::vector<char> result(data, data + bytes);
      hierarchical_all_reduce(result.data(), numel, dtype, reduction, timing);
      if (rank_ == root) std::memcpy(data, result.data(), bytes);
    });
  }

  void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                      const Timing& timing) override {
    guarded([&] {
      const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
      std::vector<char> all(in, in + bytes * static_cast<size_t>(size_));
      hierarchical_all_reduce(all.data(), numel * size_, dtype, reduction, timing);
      std::memcpy(out, all.data() + bytes * static_cast<size_t>(rank_), bytes);
    });
  }

  // The root's node first (root to its node), then the leaders (the root's leader to the other
  // leaders), then every other node (its leader to it).
  void broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) override {
    guarded([&] {
      Timing phase = timing;
      if (timing.ready_ns) phase.ready_ns = whole_group_ready(Call{Kind::kBroadcast, static_cast<int32_t>(dtype), root,
                                                                  0, numel}, timing);
      const int root_node = node_of_rank_[root];
      if (node() == root_node && local_) local_->broadcast(data, numel, dtype, local_index(root), phase);
      if (leaders_) leaders_->broadcast(data, numel, dtype, root_node, phase);  // node k's leader is leader k
      if (node() != root_node && local_) local_->broadcast(data, numel, dtype, 0, phase);
      agreed_ready_ns_ = phase.ready_ns;
    });
  }

  // Each node gathers its ranks' pieces, the leaders exchange their nodes' pieces (a node with
  // fewer ranks pads its block), and each leader hands its node the pieces of the other nodes.
  void all_gather(const std::vector<char*>& outs, const char* in, int64_t numel, at::ScalarType dtype,
                  const Timing& timing) override {
    guarded([&] {
      const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
      const auto& mine = ranks_of_node_.at(node());
      Timing phase = timing;
      if (local_) {
        std::vector<char*> local_outs;
        for (int r : mine) local_outs.push_back(outs[r]);
        local_->all_gather(local_outs, in, numel, dtype, phase);
        phase.ready_ns = local_->agreed_ready_ns();
      } else if (outs[rank_] != in) {
        std::memmove(outs[rank_], in, bytes);
      }
      const size_t block = bytes * static_cast<size_t>(max_local_);
      std::vector<char> everything(block * ranks_of_node_.size());
      if (leaders_) {
        std::vector<char> own(block);
        for (size_t j = 0; j < mine.size(); ++j) std::memcpy(own.data() + j * bytes, outs[mine[j]], bytes);
        std::vector<char*> blocks;
        for (size_t n = 0; n < ranks_of_node_.size(); ++n) blocks.push_back(everything.data() + n * block);
        leaders_->all_gather(blocks, own.data(), static_cast<int64_t>(block), at::kByte, phase);
        phase.ready_ns = leaders_->agreed_ready_ns();
      }
      if (local_) {
        local_->broadcast(everything.data(), static_cast<int64_t>(everything.size()), at::kByte, 0, phase);
        phase.ready_ns = local_->agreed_ready_ns();
      }
      size_t n = 0;
      for (const auto& [other, ranks] : ranks_of_node_) {
        if (other != node()) {
          for (size_t j = 0; j < ranks.size(); ++j) std::memcpy(outs[ranks[j]], everything.data() + n * block + j * bytes, bytes);
        }
        ++n;
      }
      agreed_ready_ns_ = phase.ready_ns;
    });
  }

  void agree(const Call& call, const Timing& timing) override {
    guarded([&] { agreed_ready_ns_ = whole_group_ready(call, timing); });
  }

  void exchange_pieces(const Call& asked, const std::vector<Piece>& send, const std::vector<Piece>& recv,
                       const Timing& timing) override {
    guarded([&] {
      mesh_->exchange_pieces(asked, send, recv, timing);
      agreed_ready_ns_ = mesh_->agreed_ready_ns();
    });
  }

  void transfer(std::vector<Transfer>& transfers, int channel, const std::string& what,
                const std::function<void(std::vector<Transfer>&)>& poll, const std::function<void(size_t)>& finished) override {
    guarded([&] { mesh_->transfer(transfers, channel, what, poll, finished); });
  }

  void interrupt_transfer() override { mesh_->interrupt_transfer(); }

  void abort() override {
    Communicator::abort();
    for (Communicator* part : {local_.get(), leaders_.get(), mesh_.get()}) {
      if (part) part->abort();
    }
  }

 private:
  int node() const { return node_of_rank_[rank_]; }
  int local_index(int rank) const {
    const auto& ranks = ranks_of_node_.at(node_of_rank_[rank]);
    return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  }

  // A failure of a part is this communicator's: unusable from now on, and a peer's death is
  // ncclRemoteError for the watchdog.
  template <typename Work>
  void guarded(Work&& work) {
    try {
      work();
    } catch (...) {
      unusable_ = true;
      for (Communicator* part : {local_.get(), leaders_.get(), mesh_.get()}) {
        if (part && part->remote_failed()) remote_failed_ = true;
      }
      throw;
    }
  }

  // Every rank of the group has reached `call`: the node's ranks, then the leaders, then the
  // node again (which the leader releases). Returns the group's latest ready time.
  int64_t whole_group_ready(const Call& call, const Timing& timing) {
    Timing phase = timing;
    if (local_) {
      local_->agree(call, phase);
      phase.ready_ns = local_->agreed_ready_ns();
    }
    if (leaders_) {
      leaders_->agree(call, phase);
      phase.ready_ns = leaders_->agreed_ready_ns();
    }
    if (local_) {
      local_->agree(call, phase);
      phase.ready_ns = local_->agreed_ready_ns();
    }
    return phase.ready_ns;
  }

  // In the node (onto the leader), across the leaders, back to the node. AVG is a sum divided
  // once by the group's size; PREMUL_SUM scales each contribution in the node's phase only.
  void hierarchical_all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                               const Timing& timing) {
    Reduction summed = reduction;
    if (reduction.op == c10d::ReduceOp::AVG) summed.op = c10d::ReduceOp::SUM;
    Reduction across = summed;
    if (reduction.op == c10d::ReduceOp::PREMUL_SUM) across = Reduction{c10d::ReduceOp::SUM};
    Timing phase = timing;
    if (local_) {
      local_->reduce(data, numel, dtype, summed, 0, phase);
      phase.ready_ns = local_->agreed_ready_ns();
    } else if (reduction.op == c10d::ReduceOp::PREMUL_SUM) {
      scale(dtype, data, numel, reduction, 0);
    }
    if (leaders_) {
      leaders_->all_reduce(data, numel, dtype, across, phase);
      phase.ready_ns = leaders_->agreed_ready_ns();
      if (reduction.op == c10d::ReduceOp::AVG) scale(dtype, data, numel, reduction, size_);
    }
    if (local_) {
      local_->broadcast(data, numel, dtype, 0, phase);
      phase.ready_ns = local_->agreed_ready_ns();
    }
    agreed_ready_ns_ = phase.ready_ns;
  }

  std::vector<int> node_of_rank_;           // each group rank's node, numbered in order of first rank
  std::map<int, std::vector<int>> ranks_of_node_;
  int max_local_ = 1;
  std::unique_ptr<Communicator> local_;     // null when this rank is alone on its node
  std::unique_ptr<Communicator> leaders_;   // null unless this rank leads its node
  std::unique_ptr<Communicator> mesh_;
};

}  // namespace

std::unique_ptr<Communicator> connect_across_nodes(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                   bool p2p, std::chrono::milliseconds timeout) {
  const char* host = std::getenv("NCCL_HOSTID");
  const std::string mine = host ? host : "";
  store->set("mirage/host/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> host_keys;
  for (int r = 0; r < size; ++r) host_keys.push_back("mirage/host/" + std::to_string(r));
  const auto hosts = store->multiGet(host_keys);  // one request, not one a rank: N ranks would make N^2
  std::vector<int> node_of_rank(static_cast<size_t>(size));
  std::map<std::string, int> nodes;
  for (int r = 0; r < size; ++r) {
    node_of_rank[r] = nodes.emplace(std::string(hosts[r].begin(), hosts[r].end()), static_cast<int>(nodes.size())).first->second;
  }
  if (nodes.size() == 1) return connect_shared_memory(store, rank, size, p2p, timeout);
  const int node = node_of_rank[rank];  // nodes are numbered by their first rank: node k has the k-th leader
  std::vector<int> local_ranks;
  for (int r = 0; r < size; ++r) {
    if (node_of_rank[r] == node) local_ranks.push_back(r);
  }
  const int local_rank = static_cast<int>(std::find(local_ranks.begin(), local_ranks.end(), rank) - local_ranks.begin());
  const int local_size = static_cast<int>(local_ranks.size());
  // The mesh's pairs connect at their first transfer (most never talk); every rank is in its
  // node's communicator or the leaders', so one that cannot come up still fails the group.
  auto mesh = connect_sockets(c10::make_intrusive<c10d::PrefixStore>("mirage/mesh", store), rank, size, timeout,
                              /*on_first_use=*/true);
  std::unique_ptr<Communicator> local;
  if (local_size > 1) {
    local = connect_shared_memory(
        c10::make_intrusive<c10d::PrefixStore>("mirage/node-" + std::to_string(node), store), local_rank, local_size,
        p2p, timeout);
    if (!local) return nullptr;
  }
  std::unique_ptr<Communicator> leaders;
  if (local_rank == 0) {
    leaders = connect_sockets(c10::make_intrusive<c10d::PrefixStore>("mirage/leaders", store), node,
                              static_cast<int>(nodes.size()), timeout);
  }
  return std::make_unique<HierarchicalCommunicator>(rank, size, std::move(node_of_rank), std::move(local),
                                                    std::move(leaders), std::move(mesh));
}

}  // namespace mirage::nccl
