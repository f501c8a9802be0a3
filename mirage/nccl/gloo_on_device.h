// Gloo for device tensors (implementation and the reason: gloo_on_device.cpp).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace mirage::nccl {

class GlooOnDevice final : public c10d::Backend {
 public:
  explicit GlooOnDevice(c10::intrusive_ptr<c10d::Backend> gloo);
  using Work = c10::intrusive_ptr<c10d::Work>;

  const std::string getBackendName() const override { return gloo_->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return gloo_->getBackendOptions(); }
  bool supportsCoalescing() const override { return gloo_->supportsCoalescing(); }
  void startCoalescing() override { gloo_->startCoalescing(); }
  Work endCoalescing() override { return gloo_->endCoalescing(); }
  void setSequenceNumberForGroup() override { gloo_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return gloo_->getSequenceNumberForGroup(); }
  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }
  void abort() override { gloo_->abort(); }
  void shutdown() override { gloo_->shutdown(); }
  Work barrier(const c10d::BarrierOptions& o) override { return gloo_->barrier(o); }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    gloo_->monitoredBarrier(o, wait_all_ranks);
  }

  Work broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override;
  Work allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override;
  Work allreduce_coalesced(std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) override;
  Work allreduce_sparse(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override;
  Work reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override;
  Work allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                 const c10d::AllgatherOptions& o) override;
  Work _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override;
  Work allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                           const c10d::AllgatherOptions& o) override;
  Work allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                       const c10d::AllgatherOptions& o) override;
  Work gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
              const c10d::GatherOptions& o) override;
  Work scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
               const c10d::ScatterOptions& o) override;
  Work reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                      const c10d::ReduceScatterOptions& o) override;
  Work _reduce_scatter_base(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override;
  Work reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                       const c10d::ReduceScatterOptions& o) override;
  Work alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                     std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override;
  Work alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllToAllOptions& o) override;
  Work send(std::vector<at::Tensor>& t, int dst, int tag) override;
  Work recv(std::vector<at::Tensor>& t, int src, int tag) override;
  Work recvAnysource(std::vector<at::Tensor>& t, int tag) override;

 private:
  c10::intrusive_ptr<c10d::Backend> gloo_;
};

}  // namespace mirage::nccl
