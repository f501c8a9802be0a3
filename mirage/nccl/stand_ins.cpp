// Stand-in replicas (mirage run --stand-ins K; docs/stand-in-replicas.md). The job's world has
// W ranks in K data-parallel replicas, whose index changes every `stride` ranks (W / K: data
// parallelism outermost); the ranks of replica 0 run, each standing for the K - 1 ranks of the
// other replicas at its place (their work is the same as its own). With --stand-ins-in-node T,
// only the first of every T consecutive ranks runs, standing for the rest of its tensor-parallel
// group too (the same kernels on shards of the same shapes). A group keeps its full membership:
// the backend reports its full size and the caller's full rank, so FSDP shards into W pieces and
// the clock costs each collective for every rank and node it spans. Its transport joins the
// running members only, and this communicator answers for the absent ones, on the assumption
// that an absent member's contribution is its stand-in's:
// - all_reduce: SUM and PREMUL_SUM count each running contribution once per member it stands
//   for; AVG, MIN and MAX are unchanged; other reductions are refused;
// - all_gather: an absent member's piece is a copy of its stand-in's;
// - reduce_scatter: the full input is reduced among the running members as all_reduce reduces it,
//   and each keeps its own slice;
// - broadcast and reduce: an absent root is replaced by its stand-in.
// Stand-ins need --predict-only, where floating-point collectives carry no payload (no_payload.cpp
// wraps this communicator and answers them before they reach it): what arrives here is the
// integer data that steers the program (object sizes, pickles, counts). Collectives whose pieces
// go point to point (gather, scatter, all_to_all) with integer data are refused: no stand-in
// answer is defined for them.

#include "checks.h"
#include "transport.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace mirage::nccl {
namespace {

class WithStandIns final : public Communicator {
 public:
  WithStandIns(Communicator& running, StandInMap map)
      : Communicator(map.rank, static_cast<int>(map.stand_in.size()), running.instance()),
        running_(running), map_(std::move(map)) {}

  const char* transport() const override { return running_.transport(); }
  std::string peer_path(int peer) const override { return running_.peer_path(map_.stand_in[peer]); }

  void all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                  const Timing& timing) override {
    running_.all_reduce(data, numel, dtype, weighted(reduction), timing);
  }
  void reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
              const Timing& timing) override {
    running_.reduce(data, numel, dtype, weighted(reduction), map_.stand_in[root], timing);
  }
  void all_gather(const std::vector<char*>& outs, const char* in, int64_t numel, at::ScalarType dtype,
                  const Timing& timing) override {
    std::vector<char*> running_outs(running_.size());
    for (size_t member = 0; member < outs.size(); ++member) {
      if (map_.runs[member]) running_outs[map_.stand_in[member]] = outs[member];
    }
    running_.all_gather(running_outs, in, numel, dtype, timing);
    const size_t bytes = static_cast<size_t>(numel) * at::elementSize(dtype);
    for (size_t member = 0; member < outs.size(); ++member) {
      if (!map_.runs[member]) std::memcpy(outs[member], running_outs[map_.stand_in[member]], bytes);
    }
  }
  void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                      const Timing& timing) override {
    const size_t slice = static_cast<size_t>(numel) * at::elementSize(dtype);
    std::vector<char> whole(in, in + slice * static_cast<size_t>(size()));
    running_.all_reduce(whole.data(), numel * size(), dtype, weighted(reduction), timing);
    std::memcpy(out, whole.data() + slice * static_cast<size_t>(rank()), slice);
  }
  void broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) override {
    running_.broadcast(data, numel, dtype, map_.stand_in[root], timing);
  }
  void agree(const Call& call, const Timing& timing) override { running_.agree(call, timing); }
  void transfer(std::vector<Transfer>& transfers, int channel, const std::string& what,
                const std::function<void(std::vector<Transfer>&)>& poll,
                const std::function<void(size_t)>& finished) override {
    running_.transfer(transfers, channel, what, poll, finished);
  }
  void exchange_pieces(const Call& asked, const std::vector<Piece>& send, const std::vector<Piece>& recv,
                       const Timing& timing) override {
    TORCH_CHECK(false, "mirage --stand-ins: ", kind_name(asked.kind), " of integer data over a group with stood-in "
                "members has no stand-in answer (", timing.what, "); run without --stand-ins");
  }
  void interrupt_transfer() override { running_.interrupt_transfer(); }

 private:
  // Each running contribution counted for every member it stands for (all members stand for the
  // same number: stand_in_map checks it).
  Reduction weighted(const Reduction& reduction) const {
    Reduction r = reduction;
    const double copies = static_cast<double>(size()) / running_.size();
    if (copies == 1.0) return r;
    if (r.op == c10d::ReduceOp::SUM) {
      r.op = c10d::ReduceOp::PREMUL_SUM;
      r.factor = copies;
    } else if (r.op == c10d::ReduceOp::PREMUL_SUM && !r.factor_data) {
      r.factor *= copies;
    } else {
      TORCH_CHECK(r.op == c10d::ReduceOp::AVG || r.op == c10d::ReduceOp::MIN || r.op == c10d::ReduceOp::MAX,
                  "mirage --stand-ins: the reduction ", reduce_op_name(r.op), " of integer data over a group with "
                  "stood-in members has no stand-in answer; run without --stand-ins");
    }
    return r;
  }

  Communicator& running_;  // the running members' transport (ProcessGroupNCCL's comm_): it keeps the state
  StandInMap map_;
};

}  // namespace

std::optional<StandInMap> stand_in_map(int rank, int size, const std::vector<uint64_t>& global_ranks) {
  const char* running_world = std::getenv("MIRAGE_STAND_INS_RUNNING_WORLD");
  if (!running_world || !*running_world) return std::nullopt;
  const uint64_t running = std::strtoull(running_world, nullptr, 10);
  const uint64_t copies = static_cast<uint64_t>(env_int("MIRAGE_STAND_INS", 1));
  // The data-parallel index changes every `stride` ranks (runtime/boot.py), and a node's ranks
  // are numbered consecutively (torchrun): rank g is data-parallel replica (g / stride) % copies
  // and the (g % in_node)-th of its tensor-parallel group in its node, and stood in for by the
  // rank where both are 0.
  const uint64_t stride = static_cast<uint64_t>(env_int("MIRAGE_STAND_INS_STRIDE", static_cast<int>(running)));
  const uint64_t in_node = static_cast<uint64_t>(env_int("MIRAGE_STAND_INS_IN_NODE", 1));
  const auto global = [&](int member) {
    return global_ranks.empty() ? static_cast<uint64_t>(member) : global_ranks[static_cast<size_t>(member)];
  };
  const auto node_replica = [&](uint64_t g) { return (g / stride) % copies; };
  StandInMap map;
  map.rank = rank;
  std::vector<int> running_index(static_cast<size_t>(size), -1);
  std::vector<int> copies_of;
  for (int member = 0; member < size; ++member) {
    if (node_replica(global(member)) == 0 && global(member) % in_node == 0) {
      running_index[static_cast<size_t>(member)] = static_cast<int>(copies_of.size());
      copies_of.push_back(0);
    }
  }
  if (static_cast<int>(copies_of.size()) == size) return std::nullopt;  // every member runs: a plain group
  for (int member = 0; member < size; ++member) {
    const uint64_t g = global(member);
    const uint64_t stand_in = g - node_replica(g) * stride - g % in_node;
    int index = -1;
    for (int other = 0; other < size && index < 0; ++other) {
      if (global(other) == stand_in) index = running_index[static_cast<size_t>(other)];
    }
    TORCH_CHECK(index >= 0, "mirage --stand-ins: rank ", g, " of a group is stood in for by rank ", stand_in,
                ", which is not in the group: the group's members are not whole data-parallel replicas (the "
                "data-parallel index must change every --stand-ins-stride ranks) or, with --stand-ins-in-node, whole "
                "tensor-parallel groups of consecutive ranks; run without them");
    map.stand_in.push_back(index);
    map.node_replica.push_back(static_cast<int>(node_replica(g)));
    map.local_offset.push_back(static_cast<int>(g % in_node));
    map.runs.push_back(stand_in == g);
    ++copies_of[static_cast<size_t>(index)];
  }
  for (int count : copies_of) {
    TORCH_CHECK(count == copies_of[0], "mirage --stand-ins: the running members of a group stand for unequal numbers "
                "of ranks; the group's members are not whole data-parallel replicas or tensor-parallel groups; run "
                "without --stand-ins and --stand-ins-in-node");
  }
  map.running_rank = running_index[static_cast<size_t>(rank)];
  map.running_size = static_cast<int>(copies_of.size());
  return map;
}

std::unique_ptr<Communicator> with_stand_ins(Communicator& running, StandInMap map) {
  return std::make_unique<WithStandIns>(running, std::move(map));
}

}  // namespace mirage::nccl
