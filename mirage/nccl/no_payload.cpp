// Collectives without payload (--timing --predict-only). Kernels compute nothing under
// --predict-only, so what a floating-point collective would carry is data nobody computed:
// moving it costs the host time and, on every rank, pages of the tensors it reads and writes.
// Here such a collective's ranks only meet, as NCCL's would, through the group's own transport:
// each compares its call with every peer's (a desync fails as in a full run) and carries its
// stream's ready time, so the collective starts, on the predicted timeline, when its last rank
// reaches it. Its outputs keep what they held. Collectives of integers and bools still move
// their bytes: they carry what steers the program rather than the model's data (the pickles and
// sizes of all_gather_object and broadcast_object_list, token counts), and are small.
// Point-to-point transfers of floating-point data (pipeline stages' activations) send their
// size instead of their bytes (point_to_point.cpp): the header still carries the sender's clock,
// and a send and receive of different sizes still fail at the receiver.

#include "transport.h"

namespace mirage::nccl {

bool moves_bytes(at::ScalarType dtype) { return !at::isFloatingType(dtype) && !at::isComplexType(dtype); }

namespace {

class WithoutPayload final : public Communicator {
 public:
  explicit WithoutPayload(Communicator& transport)
      : Communicator(transport.rank(), transport.size(), transport.instance()), transport_(transport) {}

  const char* transport() const override { return transport_.transport(); }
  std::string peer_path(int peer) const override { return transport_.peer_path(peer); }

  void all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                  const Timing& timing) override {
    if (moves_bytes(dtype)) return transport_.all_reduce(data, numel, dtype, reduction, timing);
    agree(Call{Kind::kAllReduce, static_cast<int32_t>(dtype), static_cast<int32_t>(reduction.op), 0, numel}, timing);
  }
  void reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
              const Timing& timing) override {
    if (moves_bytes(dtype)) return transport_.reduce(data, numel, dtype, reduction, root, timing);
    agree(Call{Kind::kReduce, static_cast<int32_t>(dtype), (root << 8) | static_cast<int32_t>(reduction.op), 0, numel},
          timing);
  }
  void all_gather(const std::vector<char*>& outs, const char* in, int64_t numel, at::ScalarType dtype,
                  const Timing& timing) override {
    if (moves_bytes(dtype)) return transport_.all_gather(outs, in, numel, dtype, timing);
    agree(Call{Kind::kAllGather, static_cast<int32_t>(dtype), 0, 0, numel}, timing);
  }
  void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                      const Timing& timing) override {
    if (moves_bytes(dtype)) return transport_.reduce_scatter(out, in, numel, dtype, reduction, timing);
    agree(Call{Kind::kReduceScatter, static_cast<int32_t>(dtype), static_cast<int32_t>(reduction.op), 0, numel},
          timing);
  }
  void broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) override {
    if (moves_bytes(dtype)) return transport_.broadcast(data, numel, dtype, root, timing);
    agree(Call{Kind::kBroadcast, static_cast<int32_t>(dtype), root, 0, numel}, timing);
  }
  // gather, scatter, all_to_all: the calls are compared; no piece of floating-point data moves.
  void exchange_pieces(const Call& asked, const std::vector<Piece>& send, const std::vector<Piece>& recv,
                       const Timing& timing) override {
    if (moves_bytes(static_cast<at::ScalarType>(asked.dtype))) {
      return transport_.exchange_pieces(asked, send, recv, timing);
    }
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
