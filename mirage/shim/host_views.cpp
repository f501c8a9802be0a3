// CPU views of device memory and the adoption of CPU results as device memory (host_views.h),
// and the host views torch.compile's host code runs on (mirage/runtime/inductor.py).
#include "host_views.h"

#include "device_memory.h"
#include "unobserved_ops.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace mirage {

// A CPU tensor over the same bytes as `t` (same geometry, same offset), for CPU kernels.
// Its storage is resizable with the CPU allocator so that out= kernels may grow it; the
// fallback notices and moves the grown bytes back into device memory.
//
// An alias costs three heap objects (TensorImpl, StorageImpl, version counter) and most ops
// take two or three tensors, so aliases nobody kept are recycled per thread: the next alias
// re-points one at other bytes instead of allocating.
static thread_local std::vector<c10::intrusive_ptr<c10::TensorImpl>> tl_spare_aliases;
constexpr size_t kMaxSpareAliases = 16;

at::Tensor cpu_alias(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  c10::DataPtr bytes(const_cast<void*>(s->data()), c10::Device(DeviceType::CPU));
  c10::intrusive_ptr<c10::TensorImpl> impl;
  if (!tl_spare_aliases.empty()) {
    impl = std::move(tl_spare_aliases.back());
    tl_spare_aliases.pop_back();
    c10::StorageImpl* own = impl->storage().unsafeGetStorageImpl();
    own->set_data_ptr_noswap(std::move(bytes));
    own->set_nbytes(s->nbytes());
    if (impl->dtype() != t.dtype()) impl->set_storage_and_dtype(impl->storage(), t.dtype());
  } else {
    auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), s->nbytes(),
        std::move(bytes), c10::GetCPUAllocator(), true);
    impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(std::move(storage)), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  }
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (impl->is_conj() != t.is_conj()) impl->_set_conj(t.is_conj());
  if (impl->is_neg() != t.is_neg()) impl->_set_neg(t.is_neg());
  return at::Tensor(std::move(impl));
}

// Keeps `alias` for the next cpu_alias if nothing but the caller holds it (not a kernel, not Python)
// and it owns no bytes (an out= kernel that grew it gave it a CPU allocation, which goes with it).
void recycle_alias(at::Tensor&& alias) {
  c10::TensorImpl* impl = alias.unsafeGetTensorImpl();
  const c10::StorageImpl* storage = impl->storage().unsafeGetStorageImpl();
  if (tl_spare_aliases.size() >= kMaxSpareAliases || alias.use_count() != 1 || alias.weak_use_count() != 1 ||
      impl->storage().use_count() != 1 || storage->data_ptr().get_context() != nullptr ||
      impl->pyobj_slot()->load_pyobj() != nullptr ||
      storage->pyobj_slot()->load_pyobj() != nullptr || !impl->allow_tensor_metadata_change()) {
    return;
  }
  tl_spare_aliases.push_back(c10::intrusive_ptr<c10::TensorImpl>::reclaim(alias.unsafeReleaseTensorImpl()));
}

// A device tensor with `geometry`'s sizes/strides/offset/dtype on `storage`.
// ZeroTensor (autograd's storage-less zeros) must stay one: its memory is a null pointer.
at::Tensor on_storage(c10::Storage storage, const at::Tensor& geometry) {
  c10::DispatchKeySet keys(c10::DispatchKey::CUDA);
  if (geometry._is_zerotensor()) keys = keys.add(c10::DispatchKey::ZeroTensor);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), keys, geometry.dtype());
  impl->set_sizes_and_strides(geometry.sizes(), geometry.strides(), geometry.storage_offset());
  if (geometry.is_conj()) impl->_set_conj(true);
  if (geometry.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

// Keeps a CPU kernel's result alive as device memory, with its block of the device's allocator.
struct AdoptedBytes {
  c10::DataPtr cpu;    // the CPU allocation
  c10::Storage owner;  // or the CPU storage holding it, when the result could not be re-labelled in place
  DeviceIndex device;
  CachedBlock* block;  // null for an empty result
};
static void release_adopted(void* ctx) {
  auto* a = static_cast<AdoptedBytes*>(ctx);
  if (a->block) free_device_block(a->device, a->block);
  delete a;
}

const CachedBlock* adopted_block(const c10::DataPtr& data) {
  return data.get_deleter() == &release_adopted ? static_cast<const AdoptedBytes*>(data.get_context())->block : nullptr;
}

// The device memory a fresh CPU result of `nbytes` at `data` becomes: the same bytes with a block
// of the device's allocator (no copy), or, inside a private pool (use_mem_pool, a cudagraph
// tree's warm-up), the pool block's bytes, where the result is copied so that its address is
// the block's, as a GPU kernel's output would be. `keep` receives what must outlive the bytes.
template <class Keep>
static c10::DataPtr adopted_bytes(void* data, int64_t nbytes, DeviceIndex dev, Keep&& keep) {
  CachedBlock* block = nbytes > 0 ? allocate_block(dev, static_cast<size_t>(nbytes)) : nullptr;
  if (block && block->host) {
    std::memcpy(block->host, data, static_cast<size_t>(nbytes));
    return pool_block_data(dev, block);
  }
  auto* adopted = new AdoptedBytes{{}, {}, dev, block};
  keep(*adopted);
  return c10::DataPtr(data, adopted, &release_adopted, c10::Device(DeviceType::CUDA, dev));
}

// A device storage over a fresh CPU result's bytes, the CPU storage kept alive inside it.
c10::Storage adopt_storage(const c10::Storage& cpu, DeviceIndex dev) {
  const int64_t nbytes = static_cast<int64_t>(cpu.nbytes());
  c10::DataPtr dp = adopted_bytes(const_cast<void*>(cpu.data()), nbytes, dev, [&](AdoptedBytes& a) { a.owner = cpu; });
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, std::move(dp), device_allocator(dev), true));
}

// The key sets a TensorImpl's constructor gives a plain dense tensor on CPU and on CUDA (with
// their autograd and autocast keys), outside inference mode.
struct PlainKeys {
  c10::DispatchKeySet cpu, cuda;
  PlainKeys() {
    c10::InferenceMode outside(false);
    cpu = c10::TensorImpl(c10::DispatchKeySet(c10::DispatchKey::CPU), caffe2::TypeMeta::Make<float>(),
                          c10::Device(DeviceType::CPU)).key_set();
    cuda = c10::TensorImpl(c10::DispatchKeySet(c10::DispatchKey::CUDA), caffe2::TypeMeta::Make<float>(),
                           c10::Device(DeviceType::CUDA, 0)).key_set();
  }
};
static const PlainKeys& plain_keys() {
  static const PlainKeys keys;
  return keys;
}

// A TensorImpl's key set is protected; a derived class may name it (and only ever reads or
// writes it through this member pointer, on TensorImpls that are not of this type).
struct KeySetOf : c10::TensorImpl {
  static constexpr c10::DispatchKeySet c10::TensorImpl::*member = &KeySetOf::key_set_;
};

// The weak references to `s` (1 while a strong one exists): borrowed without touching the counts.
static uint32_t weak_references(c10::StorageImpl* s) {
  auto borrowed = c10::intrusive_ptr<c10::StorageImpl>::reclaim(s);
  const uint32_t weak = borrowed.weak_use_count();
  borrowed.release();
  return weak;
}

// Re-labels a kernel's fresh CPU result as a device tensor in place: its storage's DataPtr
// becomes device memory and its keys the device's, with no new TensorImpl or StorageImpl. Only
// when the result alone holds its storage and nothing else (Python, the kernel) holds either;
// false leaves it untouched for the general path.
bool relabel_in_place(at::Tensor& out, DeviceIndex dev) {
  c10::TensorImpl* impl = out.unsafeGetTensorImpl();
  c10::StorageImpl* s = impl->storage().unsafeGetStorageImpl();
  if (impl->key_set() != plain_keys().cpu || out.use_count() != 1 || out.weak_use_count() != 1 ||
      impl->storage().use_count() != 1 || weak_references(s) != 1 ||
      impl->pyobj_slot()->load_pyobj() != nullptr || s->pyobj_slot()->load_pyobj() != nullptr ||
      !impl->allow_tensor_metadata_change() || s->data_ptr().device().type() != DeviceType::CPU) {
    return false;
  }
  // The CPU allocation moves into the device bytes' context; copied into a pool block, it goes.
  c10::DataPtr device_bytes = adopted_bytes(s->mutable_data(), static_cast<int64_t>(s->nbytes()), dev,
                                            [s](AdoptedBytes& a) { a.cpu = s->set_data_ptr(c10::DataPtr()); });
  s->set_data_ptr_noswap(std::move(device_bytes));
  s->set_allocator(device_allocator(dev));
  impl->set_storage_keep_dtype(impl->storage());  // the tensor's device follows its storage's
  impl->*KeySetOf::member = plain_keys().cuda;
  return true;
}

// After a CPU kernel wrote into `alias` (in-place or out=), make `orig` reflect any resize.
void sync_back(const at::Tensor& orig, const at::Tensor& alias) {
  c10::StorageImpl* os = orig.storage().unsafeGetStorageImpl();
  c10::StorageImpl* as = alias.storage().unsafeGetStorageImpl();
  if (as->data() != os->data() || as->nbytes() != os->nbytes()) {
    c10::DataPtr dp = device_allocator(orig.device().index())->allocate(as->nbytes());
    if (as->nbytes()) std::memcpy(dp.get(), as->data(), as->nbytes());
    os->set_data_ptr_noswap(std::move(dp));
    os->set_nbytes(as->nbytes());
  }
  if (alias.sizes() != orig.sizes() || alias.strides() != orig.strides() ||
      alias.storage_offset() != orig.storage_offset()) {
    orig.unsafeGetTensorImpl()->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
  }
}

// Storage resize (UntypedStorage.resize_, which FSDP uses to free and re-grow parameters) is
// compiled out of a CPU build for CUDA storages; Python reaches this instead.
static void resize_storage_bytes(const at::Tensor& self, int64_t nbytes) {
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  c10::DataPtr fresh = device_allocator(self.device().index())->allocate(static_cast<size_t>(nbytes));
  size_t keep = std::min<size_t>(storage->nbytes(), static_cast<size_t>(nbytes));
  if (keep) std::memcpy(fresh.get(), storage->data(), keep);
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(static_cast<size_t>(nbytes));
}

// Host views for code compiled for the host (torch.compile, mirage/runtime/inductor.py): a CPU
// tensor over a device tensor's bytes that keeps the device storage alive, and back: a device
// tensor for a host-view (the same device storage) or for a fresh CPU result (adopted, counted as
// device memory like any kernel's result).
static void release_host_view(void* ctx) { delete static_cast<c10::Storage*>(ctx); }

static at::Tensor host_view(const at::Tensor& t) {
  if (!t.is_cuda()) return t;
  const c10::Storage& device = t.storage();
  c10::DataPtr dp(const_cast<void*>(device.data()), new c10::Storage(device), &release_host_view,
                  c10::Device(DeviceType::CPU));
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), device.nbytes(),
                                                       std::move(dp), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(std::move(storage)),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

static std::vector<at::Tensor> device_views(const std::vector<at::Tensor>& host, const std::vector<int64_t>& devices) {
  TORCH_CHECK(host.size() == devices.size(), "device_views: one device per tensor");
  std::vector<at::Tensor> out;
  std::vector<std::pair<c10::StorageImpl*, c10::Storage>> adopted;  // results sharing a buffer share its adoption
  for (size_t i = 0; i < host.size(); ++i) {
    const at::Tensor& t = host[i];
    if (t.is_cuda() || devices[i] < 0) {
      out.push_back(t);
      continue;
    }
    c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    if (s->data_ptr().get_deleter() == &release_host_view) {
      out.push_back(on_storage(*static_cast<c10::Storage*>(s->data_ptr().get_context()), t));
      continue;
    }
    auto it = std::find_if(adopted.begin(), adopted.end(), [s](const auto& p) { return p.first == s; });
    if (it == adopted.end()) {
      adopted.emplace_back(s, adopt_storage(t.storage(), static_cast<DeviceIndex>(devices[i])));
      it = std::prev(adopted.end());
    }
    out.push_back(on_storage(it->second, t));
  }
  return out;
}
}  // namespace mirage

MIRAGE_LIBRARY(m) {
  m.def("host_view(Tensor t) -> Tensor", &mirage::host_view);
  m.def("device_views(Tensor[] host, int[] devices) -> Tensor[]", &mirage::device_views);
  m.def("resize_storage_bytes_(Tensor(a!) self, int nbytes) -> ()", &mirage::resize_storage_bytes);
}
