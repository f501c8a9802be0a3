// Sparse tensors on the emulated device (sparse_tensors.h): their SparseCUDA and SparseCsrCUDA
// kernels, which are the op path's, and the conversions between device sparse tensors and their
// host views.
#include "sparse_tensors.h"

#include "op_path.h"

#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

namespace mirage {

static at::SparseTensorImpl* coo_impl(const at::Tensor& t) {
  return static_cast<at::SparseTensorImpl*>(t.unsafeGetTensorImpl());
}
static at::SparseCsrTensorImpl* compressed_impl(const at::Tensor& t) {
  return static_cast<at::SparseCsrTensorImpl*>(t.unsafeGetTensorImpl());
}

SparseMembers sparse_members(const at::Tensor& sparse) {
  if (sparse.layout() == c10::kSparse) return {coo_impl(sparse)->indices(), coo_impl(sparse)->values()};
  const at::SparseCsrTensorImpl* impl = compressed_impl(sparse);
  return {impl->compressed_indices(), impl->plain_indices(), impl->values()};
}

at::Tensor sparse_over(const at::Tensor& like, const SparseMembers& members) {
  const at::Tensor& values = members.back();
  const c10::Device device = values.device();
  const bool on_device = device.is_cuda();
  if (like.layout() != c10::kSparse) {
    const c10::DispatchKey key = on_device ? c10::DispatchKey::SparseCsrCUDA : c10::DispatchKey::SparseCsrCPU;
    at::Tensor sparse = at::detail::make_tensor<at::SparseCsrTensorImpl>(c10::DispatchKeySet(key), device,
                                                                         like.layout(), values.dtype());
    compressed_impl(sparse)->set_member_tensors(members[0], members[1], values, like.sizes());
    return sparse;
  }
  // The new tensor's placeholder indices and values are made on its device: the guard names it.
  const c10::OptionalDeviceGuard guard(on_device ? std::optional<c10::Device>(device) : std::nullopt);
  const c10::DispatchKey key = on_device ? c10::DispatchKey::SparseCUDA : c10::DispatchKey::SparseCPU;
  at::Tensor sparse = at::detail::make_tensor<at::SparseTensorImpl>(c10::DispatchKeySet(key), values.dtype());
  at::SparseTensorImpl* impl = coo_impl(sparse);
  const at::SparseTensorImpl* source = coo_impl(like);
  impl->raw_resize_(source->sparse_dim(), source->dense_dim(), like.sizes());
  impl->set_indices_and_values_unsafe(members[0], values);
  impl->set_coalesced(source->coalesced());
  return sparse;
}

static bool coalesced_flag(const at::Tensor& sparse) {
  return sparse.layout() == c10::kSparse && coo_impl(sparse)->coalesced();
}

SparseSnapshot snapshot(const at::Tensor& sparse) {
  return {sparse_members(sparse), sparse.sizes().vec(), coalesced_flag(sparse)};
}

bool written_since(const at::Tensor& sparse, const SparseSnapshot& before) {
  const SparseMembers now = sparse_members(sparse);
  if (sparse.sizes() != c10::IntArrayRef(before.sizes) || coalesced_flag(sparse) != before.coalesced) return true;
  for (size_t i = 0; i < now.size(); ++i) {
    if (!now[i].is_same(before.members[i])) return true;
  }
  return false;
}

void sparse_sync_back(const at::Tensor& orig, const at::Tensor& written, const SparseMembers& members) {
  const SparseMembers held = sparse_members(orig);
  bool same = orig.sizes() == written.sizes() && held.size() == members.size();
  for (size_t i = 0; same && i < held.size(); ++i) same = held[i].is_same(members[i]);
  if (orig.layout() != c10::kSparse) {
    if (!same) compressed_impl(orig)->set_member_tensors(members[0], members[1], members[2], written.sizes());
    return;
  }
  at::SparseTensorImpl* target = coo_impl(orig);
  const at::SparseTensorImpl* source = coo_impl(written);
  if (!same || target->sparse_dim() != source->sparse_dim() || target->dense_dim() != source->dense_dim()) {
    target->raw_resize_(source->sparse_dim(), source->dense_dim(), written.sizes());
    target->set_indices_and_values_unsafe(members[0], members[1]);
  }
  if (target->coalesced() != source->coalesced()) target->set_coalesced(source->coalesced());
}

c10::DispatchKey host_key(c10::DispatchKeySet keys) {
  // (SparseCsr outranks Sparse: a call with both layouts dispatched to the SparseCsrCUDA kernel)
  if (keys.has(c10::DispatchKey::SparseCsrCUDA)) return c10::DispatchKey::SparseCsrCPU;
  if (keys.has(c10::DispatchKey::SparseCUDA)) return c10::DispatchKey::SparseCPU;
  return c10::DispatchKey::CPU;
}

// A CUDA build has a SparseCUDA (SparseCsrCUDA) kernel for every op with a SparseCPU (SparseCsrCPU)
// one but those below (native_functions.yaml, which torchgen ships in the wheel); a CPU build has
// none. Each such op gets the op path as its device kernel, which runs the CPU twin's kernel on
// host views (op_path.cpp). An op without one raises the dispatcher's own "Could not run ...
// 'SparseCUDA' backend", as on a CUDA build. tests/emulated/test_sparse.py checks the set
// against the yaml of the installed torch.
static bool cpu_only(const std::string& name, c10::DispatchKey host) {
  // pinning is of host memory; sparse.mm's reductions have a CPU kernel only
  if (name == "aten::is_pinned" || name == "aten::_pin_memory") return true;
  return host == c10::DispatchKey::SparseCsrCPU &&
         (name == "aten::_sparse_mm_reduce_impl" || name == "aten::_sparse_mm_reduce_impl_backward");
}

static void register_twins(torch::Library& library, c10::DispatchKey device, c10::DispatchKey host) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0 || cpu_only(name.name, host)) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(host) || op->hasKernelForDispatchKey(device)) continue;
    const std::string qualified = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    library.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

static const int g_register_sparse_kernels = [] {
  static torch::Library coo(torch::Library::IMPL, "aten", c10::DispatchKey::SparseCUDA, __FILE__, __LINE__);
  static torch::Library compressed(torch::Library::IMPL, "aten", c10::DispatchKey::SparseCsrCUDA, __FILE__, __LINE__);
  register_twins(coo, c10::DispatchKey::SparseCUDA, c10::DispatchKey::SparseCPU);
  register_twins(compressed, c10::DispatchKey::SparseCsrCUDA, c10::DispatchKey::SparseCsrCPU);
  return 0;
}();

}  // namespace mirage
