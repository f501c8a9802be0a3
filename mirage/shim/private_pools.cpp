// Private memory pools: torch.cuda.MemPool / use_mem_pool, and what cudagraph trees do with a
// CUDA graph's pool (checkpoint its blocks, restore them, free them by pointer, swap storages'
// deleters), over the caching-allocator model's private pools (caching_allocator.h).
#include "device_memory.h"
#include "unobserved_ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace mirage {

static c10::StorageImpl* storage_at(int64_t address) {
  return reinterpret_cast<c10::StorageImpl*>(static_cast<uintptr_t>(address));  // a storage's _cdata
}

// torch._C._cuda_setCheckpointPoolState: the pool back to a checkpoint (DeviceCache::restore_pool),
// then, as CUDA's binding does, the stale storages whose blocks were freed stop owning them (their
// deleter becomes a no-op) and the live storages handed over own their blocks again.
static void restore_pool_checkpoint(int64_t device, int64_t id0, int64_t id1, std::vector<int64_t> flat,
                                    std::vector<int64_t> stale_storages, std::vector<int64_t> storages_to_add_deleters_to) {
  check_index(static_cast<DeviceIndex>(device));
  const auto dev = static_cast<DeviceIndex>(device);
  std::vector<SegmentView> checkpoint;
  for (size_t i = 0; i < flat.size();) {
    SegmentView segment{static_cast<uint64_t>(flat[i]), 0, 0, flat[i + 1] != 0, false,
                        {static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)}, {}};
    const int64_t count = flat[i + 2];
    i += 3;
    for (int64_t b = 0; b < count; ++b, i += 3) {
      segment.blocks.push_back({0, static_cast<size_t>(flat[i]), static_cast<size_t>(flat[i + 1]), flat[i + 2] != 0});
      segment.total_size += static_cast<size_t>(flat[i]);
    }
    checkpoint.push_back(std::move(segment));
  }
  std::vector<c10::StorageImpl*> stale;
  std::unordered_set<c10::StorageImpl*> stale_set;
  for (int64_t s : stale_storages) {
    if (stale_set.insert(storage_at(s)).second) stale.push_back(storage_at(s));
  }
  DeviceCache::Restored delta = g_caches[dev].restore_pool({static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)}, checkpoint);
  {  // the freed blocks leave the pool-block table (their pointers may come back as allocated below)
    std::lock_guard<std::mutex> g(g_pool_blocks.mu);
    for (char* p : delta.freed) g_pool_blocks.by_data.erase(p);
  }
  std::unordered_set<const void*> allocated, freed(delta.freed.begin(), delta.freed.end());
  for (const auto& [host, block] : delta.allocated) allocated.insert(host);
  size_t definitely_freed = 0;
  for (const char* p : delta.freed) definitely_freed += allocated.count(p) == 0 ? 1 : 0;
  TORCH_CHECK(stale_set.size() >= definitely_freed,
              "Any stale tensors which are being manually freed must be passed to set checkpoint");
  for (c10::StorageImpl* storage : stale) {
    TORCH_CHECK(freed.count(storage->data_ptr().get()) != 0);
    TORCH_CHECK(storage->mutable_data_ptr().compare_exchange_deleter(&free_pool_block, &c10::detail::deleteNothing),
                "Unexpected deleter function on storage, could not swap function");
  }
  std::unordered_map<const void*, c10::StorageImpl*> owners;
  for (int64_t s : storages_to_add_deleters_to) owners[storage_at(s)->data_ptr().get()] = storage_at(s);
  for (const auto& [host, block] : delta.allocated) {
    c10::DataPtr data = pool_block_data(dev, block);
    auto owner = owners.find(host);
    if (owner != owners.end()) {
      TORCH_CHECK(owner->second->data_ptr().get_context() == nullptr, " Not expecting deleter function");
      owner->second->set_data_ptr_noswap(std::move(data));
    } else {
      data.release_context();  // allocated, owned by no storage: the caller frees it by pointer (raw_delete)
    }
  }
}

}  // namespace mirage

MIRAGE_LIBRARY(m) {
  // torch.cuda.use_mem_pool and the end of a MemPool (torch._C's beginAllocateCurrentThreadToPool,
  // endAllocateToPool, releasePool).
  m.def("begin_pool(int device, int id0, int id1) -> ()", [](int64_t device, int64_t id0, int64_t id1) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    mirage::tl_pools[device].push_back({static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)});
  });
  m.def("end_pool(int device, int id0, int id1) -> ()", [](int64_t device, int64_t id0, int64_t id1) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    auto& pools = mirage::tl_pools[device];
    const mirage::PoolId id{static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)};
    for (auto it = pools.rbegin(); it != pools.rend(); ++it) {
      if (*it == id) {
        pools.erase(std::next(it).base());
        break;
      }
    }
  });
  // Whether this thread routes its allocations on some device to a private pool (use_mem_pool).
  m.def("thread_allocates_to_pool() -> bool", []() {
    for (c10::DeviceIndex dev = 0; dev < mirage::config().num_devices; ++dev) {
      if (!mirage::tl_pools[dev].empty()) return true;
    }
    return false;
  });
  m.def("release_pool(int device, int id0, int id1) -> ()", [](int64_t device, int64_t id0, int64_t id1) {
    const auto dev = static_cast<c10::DeviceIndex>(device);
    mirage::check_index(dev);
    mirage::g_caches[dev].release_pool({static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)},
                                       [dev](size_t bytes) { mirage::release_segment_bytes(dev, bytes); });
  });
  // cudagraph trees' view of a private pool (torch._C._cuda_getCheckpointState and friends). A
  // checkpoint travels as ints: per segment its address, small (0/1), block count, then per block
  // size, requested size, allocated (0/1).
  m.def("pool_checkpoint(int device, int id0, int id1) -> int[]", [](int64_t device, int64_t id0, int64_t id1) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    std::vector<int64_t> out;
    for (const auto& segment : mirage::g_caches[device].pool_segments({static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)})) {
      out.insert(out.end(), {static_cast<int64_t>(segment.address), segment.is_small ? 1 : 0,
                             static_cast<int64_t>(segment.blocks.size())});
      for (const auto& b : segment.blocks) {
        out.insert(out.end(), {static_cast<int64_t>(b.size), static_cast<int64_t>(b.requested), b.allocated ? 1 : 0});
      }
    }
    return out;
  });
  m.def("pool_restore(int device, int id0, int id1, int[] checkpoint, int[] stale_storages, int[] storages_to_add_deleters_to) -> ()",
        &mirage::restore_pool_checkpoint);
  m.def("pool_live_allocations(int device, int id0, int id1) -> int[]", [](int64_t device, int64_t id0, int64_t id1) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    std::vector<int64_t> out;
    for (char* p : mirage::g_caches[device].pool_live_blocks({static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)})) {
      out.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)));
    }
    return out;
  });
  m.def("raw_delete(int data) -> ()", [](int64_t data) {
    TORCH_CHECK(mirage::release_pool_block(reinterpret_cast<void*>(static_cast<uintptr_t>(data))), "invalid device pointer: ",
                reinterpret_cast<void*>(static_cast<uintptr_t>(data)));
  });
  m.def("storage_has_standard_deleter(int storage) -> bool", [](int64_t storage) {
    return mirage::storage_at(storage)->data_ptr().get_deleter() == &mirage::free_pool_block;
  });
  m.def("storage_free_and_remove_deleter(int storage) -> ()", [](int64_t storage) {
    c10::StorageImpl* impl = mirage::storage_at(storage);
    void* data = impl->data_ptr().get();
    TORCH_CHECK(impl->mutable_data_ptr().compare_exchange_deleter(&mirage::free_pool_block, &c10::detail::deleteNothing),
                "Expected standard deleter");
    mirage::free_pool_block(data);
  });
  m.def("set_storage_access_error_msg(Tensor t, str msg) -> ()", [](const at::Tensor& t, std::string msg) {
    t.unsafeGetTensorImpl()->release_storage_and_set_meta_custom_data_ptr_error_msg_(std::move(msg));
  });
  m.def("set_storage_data_ptr_access_error_msg(int storage, str msg) -> ()", [](int64_t storage, std::string msg) {
    mirage::storage_at(storage)->release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(msg));
  });
}
