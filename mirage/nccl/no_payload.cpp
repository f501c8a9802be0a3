// Collectives without payload (--timing --predict-only). Kernels compute nothing under
// --predict-only, so what a collective would carry is data nobody computed: moving it costs the
// host time and, on every rank, pages of the tensors it reads and writes. Here a collective's
// ranks only meet, as NCCL's would, through the group's own transport: each compares its call
// with every peer's (a desync fails as in a full run) and carries its stream's ready time, so
// the collective starts, on the predicted timeline, when its last rank reaches it. Its outputs
// keep what they held. Point-to-point transfers still move their bytes (their header carries the
// sender's clock, and a send and receive of different sizes fail at the receiver).

#include "transport.h"

namespace mirage::nccl {
namespace {

class WithoutPayload final : public Communicator {
 public:
  explicit WithoutPayload(Communicator& transport)
      : Communicator(transport.rank(), transport.size(), transport.instance()), transport_(transport) {}

  const char* transport() const override { return transport_.transport(); }
  std::string peer_path(int peer) const override { return transport_.peer_path(peer); }

  void all_reduce(char*, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                  const Timing& timing) override {
    agree(Call{Kind::kAllReduce, static_cast<int32_t>(dtype), static_cast<int32_t>(reduction.op), 0, numel}, timing);
  }
  void reduce(char*, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
              const Timing& timing) override {
    agree(Call{Kind::kReduce, static_cast<int32_t>(dtype), (root << 8) | static_cast<int32_t>(reduction.op), 0, numel},
          timing);
  }
  void all_gather(const std::vector<char*>&, const char*, int64_t numel, at::ScalarType dtype,
                  const Timing& timing) override {
    agree(Call{Kind::kAllGather, static_cast<int32_t>(dtype), 0, 0, numel}, timing);
  }
  void reduce_scatter(char*, const char*, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                      const Timing& timing) override {
    agree(Call{Kind::kReduceScatter, static_cast<int32_t>(dtype), static_cast<int32_t>(reduction.op), 0, numel},
          timing);
  }
  void broadcast(char*, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) override {
    agree(Call{Kind::kBroadcast, static_cast<int32_t>(dtype), root, 0, numel}, timing);
  }
  // gather, scatter, all_to_all: the calls are compared; no piece moves.
  void exchange_pieces(const Call& asked, const std::vector<Piece>&, const std::vector<Piece>&,
                       const Timing& timing) override {
    agree(asked, timing);
  }
  void agree(const Call& call, const Timing& timing) override { transport_.agree(call, timing); }
  void transfer(std::vector<Transfer>& transfers, int channel, const std::string& what,
                const std::function<void(std::vector<Transfer>&)>& poll,
                const std::function<void(size_t)>& finished) override {
    transport_.transfer(transfers, channel, what, poll, finished);
  }
  void interrupt_transfer() override { transport_.interrupt_transfer(); }

 private:
  Communicator& transport_;  // the group's own (ProcessGroupNCCL's comm_): its state is the group's
};

}  // namespace

std::unique_ptr<Communicator> without_payload(Communicator& transport) {
  return std::make_unique<WithoutPayload>(transport);
}

}  // namespace mirage::nccl
