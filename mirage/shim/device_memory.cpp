// Device memory (device_memory.h): capacity and accounting per device and session, the
// out-of-memory error, device blocks and private-pool blocks, the CUDA allocator, and the
// operators torch.cuda's memory functions reach (memory fraction, allocator config, segments).
#include "device_memory.h"
#include "gpu_trace.h"
#include "faults.h"

#include "memory_history.h"
#include "race_checker.h"
#include "host_views.h"
#include "cpu_allocator.h"
#include "session_table.h"
#include "shared_device_memory.h"
#include "device_guard.h"
#include "unobserved_ops.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <torch/library.h>

#include <cstdio>

namespace mirage {

constexpr size_t kHeader = 64;  // keeps user pointers 64-byte aligned, like c10::alloc_cpu

std::string format_size(int64_t bytes) {
  char buf[64];
  if (bytes <= 1024) std::snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(bytes));
  else if (bytes <= (1 << 20)) std::snprintf(buf, sizeof buf, "%.2f KiB", bytes / 1024.0);
  else if (bytes <= (1 << 30)) std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / 1048576.0);
  else std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / 1073741824.0);
  return buf;
}

// What one device holds for this process: its context and the caching allocator's segments
// (what nvidia-smi / amd-smi count). Lock-free: read by other threads.
struct DeviceCounters {
  std::atomic<int64_t> in_use{0};
  std::atomic<bool> has_context{false};
};
static std::array<DeviceCounters, kMaxDevices> g_counters;
std::array<DeviceCache, kMaxDevices> g_caches;

// Bytes of device `dev` in use by every process of the session (or by this one alone).
static int64_t device_in_use(DeviceIndex dev) {
  if (!g_shared.words) return g_counters[dev].in_use.load(std::memory_order_relaxed);
  int64_t total = 0, slots = SharedTable::at(g_shared.words + SharedTable::kHighWater).load(std::memory_order_relaxed);
  for (int64_t i = 0; i < slots; ++i) {
    int64_t* other = g_shared.slot_at(i);
    if (other[1] == g_shared.node) total += SharedTable::at(other + SharedTable::kSlotHead + node_gpu(dev)).load(std::memory_order_relaxed);
  }
  return total;
}

// torch.cuda.set_per_process_memory_fraction: this process may hold at most fraction x
// capacity on the device (1.0 until set). Stored as parts per billion of the capacity NOT
// allowed (so zero-initialised means everything allowed), to stay lock-free.
static std::array<std::atomic<int64_t>, kMaxDevices> g_withheld_ppb;

static int64_t fraction_ppb(DeviceIndex dev) {
  return 1000000000 - g_withheld_ppb[dev].load(std::memory_order_relaxed);
}

static int64_t allowed_bytes(DeviceIndex dev) {
  const int64_t ppb = fraction_ppb(dev);
  return static_cast<int64_t>(static_cast<long double>(config().capacity) * ppb / 1000000000);
}

// The caching allocator's out-of-memory error, with its figures: "in use" includes the context,
// "allocated" and "reserved but unallocated" are the allocator's.
[[noreturn]] static void raise_oom(DeviceIndex dev, int64_t requested) {
  const Config& cfg = config();
  const char* api = cfg.amd ? "HIP" : "CUDA";
  const int64_t mine = g_counters[dev].in_use.load();
  const int64_t allocated = g_caches[dev].allocated(), reserved = g_caches[dev].reserved();
  int64_t free_bytes = std::max<int64_t>(cfg.capacity - device_in_use(dev), 0);
  std::string others;
  if (g_shared.words) {
    int64_t slots = SharedTable::at(g_shared.words + SharedTable::kHighWater).load();
    for (int64_t i = 0; i < slots; ++i) {
      int64_t* other = g_shared.slot_at(i);
      int64_t pid = SharedTable::at(other).load();
      int64_t bytes = SharedTable::at(other + SharedTable::kSlotHead + node_gpu(dev)).load();
      if (pid == 0 || other == g_shared.slot || other[1] != g_shared.node || bytes == 0) continue;
      others += "Process " + std::to_string(pid) + " has " + format_size(bytes) + " memory in use. ";
    }
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false,
      api, " out of memory. Tried to allocate ", format_size(requested), ". GPU ", static_cast<int>(dev),
      " has a total capacity of ", format_size(cfg.capacity), " of which ", format_size(free_bytes),
      " is free. ", others, "Including non-PyTorch memory, this process has ", format_size(mine),
      " memory in use. ", fraction_ppb(dev) < 1000000000 ? format_size(allowed_bytes(dev)) + " allowed; " : "",
      "Of the allocated memory ", format_size(allocated), " is allocated by PyTorch, and ",
      format_size(reserved - allocated), " is reserved by PyTorch but unallocated. If reserved but "
      "unallocated memory is large try setting PYTORCH_", api,
      "_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
      "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)");
}

static void raise_peak(std::atomic_ref<int64_t> peak, int64_t now) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

// Adds `n` (negative: takes away) to this process's use of `dev`, here and in the session table.
static void add_in_use(DeviceIndex dev, int64_t n) {
  g_counters[dev].in_use.fetch_add(n, std::memory_order_relaxed);
  if (g_shared.slot) SharedTable::at(g_shared.slot + SharedTable::kSlotHead + node_gpu(dev)).fetch_add(n, std::memory_order_relaxed);
}

// The process's context on a device: created by the first call that needs one there (an
// allocation, a memory query), as the driver creates a primary context.
static void ensure_context(DeviceIndex dev) {
  if (!g_counters[dev].has_context.exchange(true)) add_in_use(dev, config().context_bytes);
}

// cudaMalloc of a segment: room on the device (all processes of the session, contexts included)
// and within this process's memory fraction, or false.
static bool reserve_segment(DeviceIndex dev, size_t bytes, int64_t reserved_now) {
  const int64_t capacity = config().capacity;
  const int64_t n = static_cast<int64_t>(bytes);
  ensure_context(dev);
  if (capacity > 0 && reserved_now + n > allowed_bytes(dev)) return false;
  add_in_use(dev, n);
  const int64_t now = device_in_use(dev);
  if (capacity > 0 && now > capacity) {
    add_in_use(dev, -n);
    return false;
  }
  if (g_shared.words) raise_peak(SharedTable::at(g_shared.gpu_peak(node_gpu(dev))), now);
  return true;
}

void release_segment_bytes(DeviceIndex dev, size_t bytes) { add_in_use(dev, -static_cast<int64_t>(bytes)); }

PoolId g_capture_pool{0, 0};
std::atomic<int> g_capture_device{-1};

static PoolId current_pool(DeviceIndex dev) {
  if (!tl_pools[dev].empty()) return tl_pools[dev].back();
  if (C10_UNLIKELY(g_capture_device.load(std::memory_order_acquire) == dev)) return g_capture_pool;
  return PoolId{0, 0};
}

// torch.profiler(profile_memory=True): each allocation (+) and free (-) of a block at its
// modelled device address, with the device's allocated and reserved bytes after it, as CUDA's
// caching allocator reports them (whatever holds the bytes: a DataPtr, an adopted result).
static void report_to_profiler(uint64_t address, int64_t delta, DeviceIndex dev) {
  if (C10_LIKELY(!c10::memoryProfilingEnabled())) return;
  c10::reportMemoryUsageToProfiler(reinterpret_cast<void*>(address), delta, g_caches[dev].allocated(),
                                   g_caches[dev].reserved(), c10::Device(DeviceType::CUDA, dev));
}

// A block of the device's caching allocator for `nbytes`; raises the allocator's OOM error.
CachedBlock* allocate_block(DeviceIndex dev, size_t nbytes) {
  if (C10_UNLIKELY(g_fault_allocs.load(std::memory_order_relaxed))) fault_at_alloc(dev, nbytes, raise_oom);
  auto reserve = [dev](size_t bytes, int64_t reserved_now) { return reserve_segment(dev, bytes, reserved_now); };
  auto release = [dev](size_t bytes) { release_segment_bytes(dev, bytes); };
  CachedBlock* block = nullptr;
  g_caches[dev].set_limits(static_cast<size_t>(std::max<int64_t>(config().capacity, 0)),
                           fraction_ppb(dev) < 1000000000 ? static_cast<size_t>(allowed_bytes(dev)) : 0);
  if (C10_UNLIKELY(g_history.enabled.load(std::memory_order_relaxed))) {
    const Observer observe = history_observer(dev, gather_stack());
    block = g_caches[dev].allocate(nbytes, tl_stream[dev], reserve, release, &observe, current_pool(dev));
  } else {
    block = g_caches[dev].allocate(nbytes, tl_stream[dev], reserve, release, nullptr, current_pool(dev));
  }
  if (!block) raise_oom(dev, static_cast<int64_t>(DeviceCache::segment_size_for(nbytes)));
  static std::atomic<uint64_t> allocations{0};
  block->serial = ++allocations;
  report_to_profiler(block->address, static_cast<int64_t>(block->size), dev);
  return block;
}

void free_device_block(DeviceIndex dev, CachedBlock* block) {
  const uint64_t address = block->address;  // the block may merge with its neighbours once free
  const auto size = static_cast<int64_t>(block->size);
  if (C10_UNLIKELY(races::on())) races::block_freed(dev, address, block->size, block->stream);
  if (C10_UNLIKELY(g_history.enabled.load(std::memory_order_relaxed))) {
    const Observer observe = history_observer(dev, gather_stack());
    g_caches[dev].free(block, &observe);
  } else {
    g_caches[dev].free(block);
  }
  report_to_profiler(address, -size, dev);
}

static void release_cached_segments(DeviceIndex dev) {
  auto release = [dev](size_t bytes) { release_segment_bytes(dev, bytes); };
  if (g_history.enabled.load(std::memory_order_relaxed)) {
    const Observer observe = history_observer(dev, gather_stack());
    g_caches[dev].release_cached(release, &observe);
  } else {
    g_caches[dev].release_cached(release);
  }
}

// Block layout: [header: the allocator's block, device][user data...]. The header lets the
// deleter return the right block without a side table or an extra allocation.
struct BlockHeader {
  CachedBlock* block;
  DeviceIndex device;
};

static void free_block(void* base) {
  auto* h = static_cast<BlockHeader*>(base);
  if (auto* trace = gpu_trace()) {
    (*trace)->trace_gpu_memory_deallocation(DeviceType::CUDA, trace_handle(static_cast<char*>(base) + kHeader));
  }
  free_device_block(h->device, h->block);
  free_device_bytes(base);
}

PoolBlocks g_pool_blocks;

bool release_pool_block(void* data) {
  std::pair<DeviceIndex, CachedBlock*> found{-1, nullptr};
  {
    std::lock_guard<std::mutex> g(g_pool_blocks.mu);
    auto it = g_pool_blocks.by_data.find(data);
    if (it == g_pool_blocks.by_data.end()) return false;
    found = it->second;
    g_pool_blocks.by_data.erase(it);
  }
  if (auto* trace = gpu_trace()) (*trace)->trace_gpu_memory_deallocation(DeviceType::CUDA, trace_handle(data));
  free_device_block(found.first, found.second);
  return true;
}

void free_pool_block(void* data) {
  if (!release_pool_block(data)) {
    TORCH_WARN("mirage: freeing ", data, ", which is no live block of a private memory pool (freed twice?)");
  }
}

c10::DataPtr pool_block_data(DeviceIndex dev, CachedBlock* block) {
  {
    std::lock_guard<std::mutex> g(g_pool_blocks.mu);
    g_pool_blocks.by_data[block->host] = {dev, block};
  }
  if (auto* trace = gpu_trace()) (*trace)->trace_gpu_memory_allocation(DeviceType::CUDA, trace_handle(block->host));
  return {block->host, block->host, &free_pool_block, c10::Device(DeviceType::CUDA, dev)};
}

const CachedBlock* device_block_of(const c10::DataPtr& data) {
  if (data.get_deleter() == &free_block) return static_cast<const BlockHeader*>(data.get_context())->block;
  if (data.get_deleter() == &free_pool_block) {
    std::lock_guard<std::mutex> g(g_pool_blocks.mu);
    auto it = g_pool_blocks.by_data.find(data.get());
    return it == g_pool_blocks.by_data.end() ? nullptr : it->second.second;
  }
  return adopted_block(data);
}

struct DeviceMemoryAllocator final : c10::DeviceAllocator {
  DeviceIndex fixed_device = -1;  // -1: the calling thread's current device

  c10::DataPtr allocate(size_t n) override {
    DeviceIndex dev = fixed_device >= 0 ? fixed_device : tl_device;
    if (n == 0) return c10::DataPtr(nullptr, c10::Device(DeviceType::CUDA, dev));
    CachedBlock* block = allocate_block(dev, n);
    if (block->host) return pool_block_data(dev, block);
    void* base = nullptr;
    try {
      base = allocate_device_bytes(n + kHeader);
    } catch (const c10::Error&) {
      free_device_block(dev, block);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "mirage: the host could not back ", format_size(static_cast<int64_t>(n)),
          " of emulated GPU ", static_cast<int>(dev), " memory (host RAM exhausted; the emulated GPU had room). "
          "Fix: use smaller tensors, fewer ranks, or a machine with more RAM.");
    }
    auto* h = static_cast<BlockHeader*>(base);
    h->block = block;
    h->device = dev;
    if (auto* trace = gpu_trace()) {
      (*trace)->trace_gpu_memory_allocation(DeviceType::CUDA, trace_handle(static_cast<char*>(base) + kHeader));
    }
    return {static_cast<char*>(base) + kHeader, base, &free_block, c10::Device(DeviceType::CUDA, dev)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pool_block; }
  bool initialized() override { return true; }
  // torch.cuda.empty_cache: every device's cached segments go back (the MemPool id is not modelled).
  void emptyCache(c10::MempoolId_t) override {
    for (DeviceIndex dev = 0; dev < config().num_devices; ++dev) release_cached_segments(dev);
    host_bytes_release();
  }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex dev) override {
    check_index(dev);
    return g_caches[dev].stats();
  }
  void resetAccumulatedStats(DeviceIndex dev) override {
    check_index(dev);
    g_caches[dev].reset_accumulated();
  }
  void resetPeakStats(DeviceIndex dev) override {
    check_index(dev);
    g_caches[dev].reset_peak();
  }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex dev) override {
    check_index(dev);
    ensure_context(dev);
    int64_t cap = config().capacity;
    return {static_cast<size_t>(std::max<int64_t>(cap - device_in_use(dev), 0)),
            static_cast<size_t>(cap)};
  }
};

static DeviceMemoryAllocator g_current_device_allocator;
static std::array<DeviceMemoryAllocator, kMaxDevices>& device_allocators() {
  static std::array<DeviceMemoryAllocator, kMaxDevices> arr = [] {
    std::array<DeviceMemoryAllocator, kMaxDevices> a;
    for (int i = 0; i < kMaxDevices; ++i) a[i].fixed_device = static_cast<DeviceIndex>(i);
    return a;
  }();
  return arr;
}

c10::Allocator* device_allocator(DeviceIndex dev) { return &device_allocators()[dev]; }
c10::Allocator* current_device_allocator() { return &g_current_device_allocator; }
REGISTER_ALLOCATOR(DeviceType::CUDA, &g_current_device_allocator);

}  // namespace mirage

MIRAGE_LIBRARY(m) {
  m.def("set_memory_fraction(int device, float fraction) -> ()", [](int64_t device, double fraction) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    mirage::g_withheld_ppb[device].store(1000000000 - static_cast<int64_t>(fraction * 1e9 + 0.5));
  });
  m.def("memory_fraction(int device) -> float", [](int64_t device) -> double {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    return mirage::fraction_ppb(static_cast<c10::DeviceIndex>(device)) / 1e9;
  });
  // PYTORCH_CUDA_ALLOC_CONF and its relatives, checked at CUDA initialisation as a real build does.
  m.def("apply_allocator_config() -> ()", []() {
    const double fraction = mirage::apply_allocator_config(mirage::config().amd);
    if (fraction < 0) return;
    for (c10::DeviceIndex dev = 0; dev < mirage::config().num_devices; ++dev) {
      mirage::g_withheld_ppb[dev].store(1000000000 - static_cast<int64_t>(fraction * 1e9 + 0.5));
    }
  });
  // The caching allocator's segments of a device (torch.cuda.memory_snapshot), one row per block:
  // [segment address, segment size, stream, is_small, block address, size, requested, allocated,
  //  pool id (2 ints), is_expandable].
  m.def("memory_segments(int device) -> int[][]", [](int64_t device) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    std::vector<std::vector<int64_t>> rows;
    for (const auto& segment : mirage::g_caches[device].segments()) {
      for (const auto& block : segment.blocks) {
        rows.push_back({static_cast<int64_t>(segment.address), static_cast<int64_t>(segment.total_size), segment.stream,
                        segment.is_small, static_cast<int64_t>(block.address), static_cast<int64_t>(block.size),
                        static_cast<int64_t>(block.requested), block.allocated,
                        static_cast<int64_t>(segment.pool.first), static_cast<int64_t>(segment.pool.second),
                        segment.is_expandable});
      }
    }
    return rows;
  });
}
