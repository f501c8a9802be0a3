// Gloo for device tensors. A CUDA build's gloo takes cuda tensors (it stages them through host
// memory); a CPU build's gloo has no CUDA path and crashes on them. Emulated device memory is
// host memory, so this adapter, registered as a gloo group's cuda backend, hands gloo CPU
// tensors that alias the device tensors' memory (zero copy; each alias keeps its device tensor
// alive) and otherwise forwards every call unchanged.

#include "gloo_on_device.h"

namespace mirage::nccl {
namespace {

at::Tensor on_host(const at::Tensor& t) {
  if (!t.defined() || !t.is_cuda()) return t;
  at::Tensor keep = t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [keep](void*) mutable { keep.reset(); },
                       t.options().device(at::kCPU));
}

std::vector<at::Tensor> on_host(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const auto& t : list) out.push_back(on_host(t));
  return out;
}

std::vector<std::vector<at::Tensor>> on_host(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(lists.size());
  for (const auto& list : lists) out.push_back(on_host(list));
  return out;
}

}  // namespace

using Work = c10::intrusive_ptr<c10d::Work>;

GlooOnDevice::GlooOnDevice(c10::intrusive_ptr<c10d::Backend> gloo)
    : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)) {}

Work GlooOnDevice::broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) {
  auto h = on_host(t);
  return gloo_->broadcast(h, o);
}
Work GlooOnDevice::allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) {
  auto h = on_host(t);
  return gloo_->allreduce(h, o);
}
Work GlooOnDevice::allreduce_coalesced(std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) {
  auto h = on_host(t);
  return gloo_->allreduce_coalesced(h, o);
}
// Sparse tensors: as a CUDA build's gloo does (AsyncSparseAllreduceCUDAWork), each is coalesced
// and copied to the host, reduced there by gloo's sparse all_reduce, and copied back into the
// device tensor (new indices and values). Here the copy back waits for the reduction.
Work GlooOnDevice::allreduce_sparse(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) {
  std::vector<at::Tensor> host;
  host.reserve(t.size());
  for (const auto& sparse : t) host.push_back(sparse.coalesce().to(at::kCPU));
  Work work = gloo_->allreduce_sparse(host, o);
  work->wait();
  for (size_t i = 0; i < t.size(); ++i) t[i].copy_(host[i]);
  return work;
}

Work GlooOnDevice::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) {
  auto h = on_host(t);
  return gloo_->reduce(h, o);
}
Work GlooOnDevice::allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                             const c10d::AllgatherOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->allgather(ho, hi, o);
}
Work GlooOnDevice::_allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->_allgather_base(ho, hi, o);
}
Work GlooOnDevice::allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                       const c10d::AllgatherOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->allgather_coalesced(ho, hi, o);
}
Work GlooOnDevice::allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                   const c10d::AllgatherOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->allgather_into_tensor_coalesced(ho, hi, o);
}
Work GlooOnDevice::gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                          const c10d::GatherOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->gather(ho, hi, o);
}
Work GlooOnDevice::scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                           const c10d::ScatterOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->scatter(ho, hi, o);
}
Work GlooOnDevice::reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                  const c10d::ReduceScatterOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->reduce_scatter(ho, hi, o);
}
Work GlooOnDevice::_reduce_scatter_base(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->_reduce_scatter_base(ho, hi, o);
}
Work GlooOnDevice::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                                   const c10d::ReduceScatterOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->reduce_scatter_tensor_coalesced(ho, hi, o);
}
Work GlooOnDevice::alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                 std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->alltoall_base(ho, hi, out_splits, in_splits, o);
}
Work GlooOnDevice::alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllToAllOptions& o) {
  auto ho = on_host(out);
  auto hi = on_host(in);
  return gloo_->alltoall(ho, hi, o);
}
Work GlooOnDevice::send(std::vector<at::Tensor>& t, int dst, int tag) {
  auto h = on_host(t);
  return gloo_->send(h, dst, tag);
}
Work GlooOnDevice::recv(std::vector<at::Tensor>& t, int src, int tag) {
  auto h = on_host(t);
  return gloo_->recv(h, src, tag);
}
Work GlooOnDevice::recvAnysource(std::vector<at::Tensor>& t, int tag) {
  auto h = on_host(t);
  return gloo_->recvAnysource(h, tag);
}

}  // namespace mirage::nccl
