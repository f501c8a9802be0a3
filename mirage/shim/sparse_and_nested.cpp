// Sparse and nested tensors on the emulated device (sparse_and_nested.h): their SparseCUDA,
// SparseCsrCUDA and NestedTensorCUDA kernels, which are the op path's, and the conversions between
// device tensors of these kinds and their host views.
#include "sparse_and_nested.h"

#include "op_path.h"

#include <ATen/NestedTensorImpl.h>
#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <string_view>

namespace mirage {

static at::SparseTensorImpl* coo_impl(const at::Tensor& t) {
  return static_cast<at::SparseTensorImpl*>(t.unsafeGetTensorImpl());
}
static at::SparseCsrTensorImpl* compressed_impl(const at::Tensor& t) {
  return static_cast<at::SparseCsrTensorImpl*>(t.unsafeGetTensorImpl());
}

Members members_of(const at::Tensor& t) {
  if (t.is_nested()) return {at::native::get_nested_tensor_impl(t)->get_unsafe_storage_as_tensor()};
  if (t.layout() == c10::kSparse) return {coo_impl(t)->indices(), coo_impl(t)->values()};
  const at::SparseCsrTensorImpl* impl = compressed_impl(t);
  return {impl->compressed_indices(), impl->plain_indices(), impl->values()};
}

at::Tensor over_members(const at::Tensor& like, const Members& members) {
  if (like.is_nested()) {  // its metadata is host tensors, shared
    const at::native::NestedTensorImpl* source = at::native::get_nested_tensor_impl(like);
    return at::detail::make_tensor<at::native::NestedTensorImpl>(members[0], source->get_nested_sizes(),
                                                                  source->get_nested_strides(),
                                                                  source->get_storage_offsets());
  }
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

static bool coalesced_flag(const at::Tensor& t) { return t.layout() == c10::kSparse && coo_impl(t)->coalesced(); }

Snapshot snapshot(const at::Tensor& t) {
  if (t.is_nested()) return {};
  return {members_of(t), t.sizes().vec(), coalesced_flag(t)};
}

bool written_since(const at::Tensor& t, const Snapshot& before) {
  if (t.is_nested()) return false;
  if (t.sizes() != c10::IntArrayRef(before.sizes) || coalesced_flag(t) != before.coalesced) return true;
  const Members now = members_of(t);
  for (size_t i = 0; i < now.size(); ++i) {
    if (!now[i].is_same(before.members[i])) return true;
  }
  return false;
}

void sync_members_back(const at::Tensor& orig, const at::Tensor& written, const Members& members) {
  const Members held = members_of(orig);
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

// The device key of each kind and its CPU twin, with the ops whose CPU kernel a CUDA build has no
// device kernel for (native_functions.yaml, which torchgen ships in the wheel; pinning is of host
// memory). tests/emulated/test_sparse_and_nested.py checks them against the installed torch's yaml.
struct Twins {
  c10::DispatchKey device, host;
  std::array<std::string_view, 4> cpu_only;
};
constexpr std::array<Twins, 3> kTwins{{
    {c10::DispatchKey::SparseCUDA, c10::DispatchKey::SparseCPU, {"is_pinned", "_pin_memory"}},
    {c10::DispatchKey::SparseCsrCUDA, c10::DispatchKey::SparseCsrCPU,
     {"is_pinned", "_pin_memory", "_sparse_mm_reduce_impl", "_sparse_mm_reduce_impl_backward"}},
    {c10::DispatchKey::NestedTensorCUDA, c10::DispatchKey::NestedTensorCPU,
     {"is_pinned", "_pin_memory", "sum.dim_IntList", "_nested_sum_backward"}},
}};

c10::DispatchKey host_key(c10::DispatchKeySet keys) {
  // Every boxed op asks, so no copies: kTwins in reverse, as a call with arguments of two kinds
  // dispatched to the higher key's kernel (SparseCsr outranks Sparse).
  for (auto twins = kTwins.rbegin(); twins != kTwins.rend(); ++twins) {
    if (keys.has(twins->device)) return twins->host;
  }
  return c10::DispatchKey::CPU;
}

// A CPU build has none of these device kernels. Each op with the CPU twin's kernel that a CUDA
// build has a device kernel for gets the op path as that kernel, which runs the CPU twin's kernel
// on host views (op_path.cpp). An op without one raises the dispatcher's own "Could not run ...
// 'SparseCUDA' backend", as on a CUDA build.
static const int g_register_twins = [] {
  static std::vector<torch::Library> libraries;
  libraries.reserve(kTwins.size());
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const Twins& twins : kTwins) {
    torch::Library& library = libraries.emplace_back(torch::Library::IMPL, "aten", twins.device, __FILE__, __LINE__);
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      const std::string qualified = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
      if (std::find(twins.cpu_only.begin(), twins.cpu_only.end(), qualified) != twins.cpu_only.end()) continue;
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasKernelForDispatchKey(twins.host) || op->hasKernelForDispatchKey(twins.device)) continue;
      library.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    }
  }
  return 0;
}();

}  // namespace mirage
