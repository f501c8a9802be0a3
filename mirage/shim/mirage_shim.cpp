// mirage device shim: gives a CPU-only PyTorch build a `cuda` device whose memory is host
// memory and whose kernels are PyTorch's own CPU kernels.
//
// Loaded with RTLD_GLOBAL before `import torch` (see mirage/runtime/boot.py), because torch
// creates its CUDA hooks object once, during import. Pieces:
//   * MirageHooks      - at::CUDAHooksInterface: makes hasCUDA()/isAvailable() true, owns the
//                        per-device random generators and the pinned-memory allocator.
//   * MirageGuard      - c10::impl::DeviceGuardImplInterface for CUDA: current device, streams,
//                        events (all work is synchronous, so events just record host time).
//   * DeviceAllocator  - host memory labelled Device(CUDA, i), counted against the profile's
//                        capacity; over capacity raises torch.cuda.OutOfMemoryError.
//   * DDP timer        - the reducer's per-device timer (host clock).
//   * boxed fallback   - every other CUDA op: CPU tensors that alias the same memory are handed
//                        to the CPU kernel (no copies), and the results are re-labelled as CUDA.
// The fallback is on every tensor operation: keep it lean.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/copy.h>
#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/llvmMathExtras.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/library.h>

#include "caching_allocator.h"
#include "shared_device_memory.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <deque>
#include <chrono>
#include <string>
#include <map>
#include <functional>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace mirage {

using c10::DeviceIndex;
using c10::DeviceType;

constexpr int kMaxDevices = 64;
constexpr size_t kHeader = 64;  // keeps user pointers 64-byte aligned, like c10::alloc_cpu

// ---------------------------------------------------------------- configuration (from env)

struct Config {
  DeviceIndex num_devices = 0;  // the GPUs this process sees
  std::array<DeviceIndex, kMaxDevices> node_gpu{};  // cuda:i is the node's GPU node_gpu[i]
  int64_t capacity = 0;      // bytes per device
  int64_t context_bytes = 0; // a process's GPU context on a device (its non-PyTorch memory)
  bool amd = true;           // message wording: "HIP out of memory" vs "CUDA out of memory"
  Config() {
    // MIRAGE_VISIBLE_GPUS: the node's GPUs after *_VISIBLE_DEVICES, in order, set by
    // mirage/runtime/boot.py before it loads the shim (torch.cuda reads the same list).
    const char* visible = std::getenv("MIRAGE_VISIBLE_GPUS");
    for (const char* p = visible ? visible : ""; *p && num_devices < kMaxDevices; ++p) {
      char* end = nullptr;
      long gpu = std::strtol(p, &end, 10);
      if (end == p || gpu < 0 || gpu >= kMaxDevices) break;
      node_gpu[num_devices++] = static_cast<DeviceIndex>(gpu);
      p = end;
      if (*p != ',') break;
    }
    if (const char* c = std::getenv("MIRAGE_GPU_MEMORY_BYTES")) capacity = std::strtoll(c, nullptr, 10);
    if (const char* c = std::getenv("MIRAGE_CONTEXT_BYTES")) context_bytes = std::strtoll(c, nullptr, 10);
    if (const char* v = std::getenv("MIRAGE_VENDOR")) amd = std::strcmp(v, "nvidia") != 0;
  }
};
static const Config& config() {
  static Config cfg;
  return cfg;
}

// ---------------------------------------------------------------- memory accounting

// What one device holds for this process: its context and the caching allocator's segments
// (what nvidia-smi / amd-smi count), and the work it ran. Lock-free: read by other threads.
struct DeviceCounters {
  std::atomic<int64_t> in_use{0};
  std::atomic<bool> has_context{false};
  std::atomic<int64_t> busy_ns{0};  // time spent running this device's work (utilization)
};
static std::array<DeviceCounters, kMaxDevices> g_counters;
static std::array<DeviceCache, kMaxDevices> g_caches;

static void add_busy(DeviceIndex device, int64_t ns);

// Measures one piece of device work into the device's busy time; work inside work (an op a
// timed op or a compiled graph runs) is counted once, by the outermost timer.
static thread_local int tl_busy_depth = 0;

class BusyTimer {
 public:
  explicit BusyTimer(DeviceIndex device)
      : device_(device), outermost_(tl_busy_depth++ == 0), start_(std::chrono::steady_clock::now()) {}
  ~BusyTimer() {
    --tl_busy_depth;
    if (!outermost_ || device_ < 0 || device_ >= kMaxDevices) return;
    const auto spent = std::chrono::steady_clock::now() - start_;
    add_busy(device_, std::chrono::duration_cast<std::chrono::nanoseconds>(spent).count());
  }
  BusyTimer(const BusyTimer&) = delete;
  BusyTimer& operator=(const BusyTimer&) = delete;

 private:
  DeviceIndex device_;
  bool outermost_;
  std::chrono::steady_clock::time_point start_;
};

// Device work that does not pass the op path (a torch.compile'd graph's host kernels), timed
// between busy_region_enter and busy_region_exit on the calling thread.
static thread_local std::vector<std::unique_ptr<BusyTimer>> tl_busy_regions;

static std::string format_size(int64_t bytes) {
  char buf[64];
  if (bytes <= 1024) std::snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(bytes));
  else if (bytes <= (1 << 20)) std::snprintf(buf, sizeof buf, "%.2f KiB", bytes / 1024.0);
  else if (bytes <= (1 << 30)) std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / 1048576.0);
  else std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / 1073741824.0);
  return buf;
}

// ---------------------------------------------------------------- session-wide accounting

// With a session service, every process on an emulated GPU draws on one capacity: the run
// process creates a shared table (MIRAGE_SHM; layout in mirage/daemon/shared_table.py) that
// every process maps. Each process adds to its own slot (no round trip to the service, no
// writer but the owner); a GPU's use is the sum over the slots on its node.
struct SharedTable {
  int64_t* words = nullptr;
  int64_t gpus_per_node = 0, max_slots = 0, node = 0;
  int64_t* slot = nullptr;  // this process's slot: [pid, node, rank, reserved, bytes per GPU...]

  static constexpr int64_t kMagic = 0x6d6972616765;  // "mirage"
  static constexpr int64_t kHeader = 8, kSlotHead = 4, kHighWater = 6;
  int64_t* gpu_peak(DeviceIndex dev) const { return words + kHeader + node * gpus_per_node + dev; }
  int64_t* gpu_busy(DeviceIndex dev) const {  // after the slots (shared_table.py)
    return slot_at(max_slots) + node * gpus_per_node + dev;
  }
  int64_t* slot_at(int64_t i) const {
    return words + kHeader + words[2] * gpus_per_node + i * (kSlotHead + gpus_per_node);
  }
  static std::atomic_ref<int64_t> at(int64_t* p) { return std::atomic_ref<int64_t>(*p); }
};
static SharedTable g_shared;

// Claims a free slot (pid 0 -> ours). Also run in a forked child, which must not share its
// parent's slot.
static void claim_slot() {
  if (!g_shared.words) return;
  int64_t pid = static_cast<int64_t>(getpid());
  g_shared.slot = nullptr;
  for (int64_t i = 0; i < g_shared.max_slots; ++i) {
    int64_t* candidate = g_shared.slot_at(i);
    int64_t expected = 0;
    if (SharedTable::at(candidate).compare_exchange_strong(expected, pid)) {
      for (int64_t d = 0; d < g_shared.gpus_per_node; ++d) SharedTable::at(candidate + SharedTable::kSlotHead + d).store(0);
      candidate[1] = g_shared.node;
      const char* rank = std::getenv("RANK");
      candidate[2] = rank ? std::atoll(rank) : -1;
      auto high_water = SharedTable::at(g_shared.words + SharedTable::kHighWater);
      int64_t seen = high_water.load();
      while (i + 1 > seen && !high_water.compare_exchange_weak(seen, i + 1)) {
      }
      g_shared.slot = candidate;
      return;
    }
  }
}

static void attach_shared_table() {
  const char* path = std::getenv("MIRAGE_SHM");
  if (!path || !*path) return;
  int fd = open(path, O_RDWR);
  if (fd < 0) return;  // the session is gone: keep private counters
  struct stat st {};
  fstat(fd, &st);
  void* base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return;
  auto* words = static_cast<int64_t*>(base);
  if (words[0] != SharedTable::kMagic) return;
  g_shared.words = words;
  g_shared.gpus_per_node = words[3];
  g_shared.max_slots = words[4];
  const char* node = std::getenv("MIRAGE_NODE_RANK");
  g_shared.node = node ? std::atoll(node) : 0;
  claim_slot();
  pthread_atfork(nullptr, nullptr, &claim_slot);
}

// The node's GPU behind this process's device `dev` (they differ under CUDA_VISIBLE_DEVICES):
// the shared table has a column per node GPU.
static DeviceIndex node_gpu(DeviceIndex dev) { return config().node_gpu[dev]; }

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

static void release_segment_bytes(DeviceIndex dev, size_t bytes) { add_in_use(dev, -static_cast<int64_t>(bytes)); }


static void add_busy(DeviceIndex device, int64_t ns) {
  g_counters[device].busy_ns.fetch_add(ns, std::memory_order_relaxed);
  if (g_shared.words) SharedTable::at(g_shared.gpu_busy(node_gpu(device))).fetch_add(ns, std::memory_order_relaxed);
}

// The device's busy time: all processes of the session on that GPU, or this one without a service.
static int64_t busy_time(DeviceIndex device) {
  if (g_shared.words) return SharedTable::at(g_shared.gpu_busy(node_gpu(device))).load(std::memory_order_relaxed);
  return g_counters[device].busy_ns.load(std::memory_order_relaxed);
}

static const int g_attached = (attach_shared_table(), 0);

// ---------------------------------------------------------------- current device and streams

static thread_local DeviceIndex tl_device = 0;
static thread_local std::array<c10::StreamId, kMaxDevices> tl_stream{};
static std::atomic<c10::StreamId> g_next_stream_id{1};

static void check_index(DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < config().num_devices, "Invalid device ordinal: cuda:",
      static_cast<int>(index), " (this emulated node has ", static_cast<int>(config().num_devices),
      " GPUs)");
}

// ---------------------------------------------------------------- allocator

// torch.cuda.memory._record_memory_history: while enabled, every action of a device's allocator,
// with the Python stack of the call that caused it (gathered before the allocator's lock is taken:
// gathering may wait for the GIL), and each live block's allocation stack for snapshots.
struct HistoryEntry {
  TraceAction action;
  uint64_t address;
  size_t size;
  int64_t stream;
  int64_t time_us;
  std::shared_ptr<torch::CapturedTraceback> frames;
};
struct MemoryHistory {
  std::atomic<bool> enabled{false};
  std::atomic<bool> stacks{true};
  std::mutex mu;
  size_t max_entries = SIZE_MAX;
  std::array<std::deque<HistoryEntry>, kMaxDevices> traces;
  std::array<std::unordered_map<uint64_t, std::shared_ptr<torch::CapturedTraceback>>, kMaxDevices> block_frames;
};
static MemoryHistory g_history;

static std::shared_ptr<torch::CapturedTraceback> gather_stack() {
  if (!g_history.stacks.load(std::memory_order_relaxed)) return nullptr;
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
}

static Observer history_observer(DeviceIndex dev, std::shared_ptr<torch::CapturedTraceback> frames) {
  return [dev, frames = std::move(frames)](TraceAction action, uint64_t address, size_t size, int64_t stream) {
    const int64_t now = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::system_clock::now().time_since_epoch()).count();
    std::lock_guard<std::mutex> g(g_history.mu);
    auto& trace = g_history.traces[dev];
    trace.push_back({action, address, size, stream, now, frames});
    while (trace.size() > g_history.max_entries) trace.pop_front();
    if (action == TraceAction::alloc) g_history.block_frames[dev][address] = frames;
    if (action == TraceAction::free_completed) g_history.block_frames[dev].erase(address);
  };
}

// torch.cuda.use_mem_pool: the MemPools this thread allocates into, per device (innermost last).
static thread_local std::array<std::vector<PoolId>, kMaxDevices> tl_pools;

// The private pool of the CUDA graph being captured, and its device (-1: none). A capture is
// process-wide (autograd's device threads issue a captured backward pass), so is its pool.
static PoolId g_capture_pool{0, 0};
static std::atomic<int> g_capture_device{-1};

static PoolId current_pool(DeviceIndex dev) {
  if (!tl_pools[dev].empty()) return tl_pools[dev].back();
  if (C10_UNLIKELY(g_capture_device.load(std::memory_order_acquire) == dev)) return g_capture_pool;
  return PoolId{0, 0};
}

// A block of the device's caching allocator for `nbytes`; raises the allocator's OOM error.
static CachedBlock* allocate_block(DeviceIndex dev, size_t nbytes) {
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
  return block;
}

static void free_device_block(DeviceIndex dev, CachedBlock* block) {
  if (C10_UNLIKELY(g_history.enabled.load(std::memory_order_relaxed))) {
    const Observer observe = history_observer(dev, gather_stack());
    g_caches[dev].free(block, &observe);
  } else {
    g_caches[dev].free(block);
  }
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
  free_device_block(h->device, h->block);
  free_device_bytes(base);
}

// A private pool's blocks live in their segment's memory (caching_allocator.h), so they have no
// header: their data pointer is their context, as on CUDA, and this table finds their block.
// free_pool_block is the allocator's raw deleter (the one cudagraph trees look for and swap).
struct PoolBlocks {
  std::mutex mu;
  std::unordered_map<const void*, std::pair<DeviceIndex, CachedBlock*>> by_data;
};
static PoolBlocks g_pool_blocks;

static c10::DataPtr pool_block_data(DeviceIndex dev, CachedBlock* block);

static bool release_pool_block(void* data) {
  std::pair<DeviceIndex, CachedBlock*> found{-1, nullptr};
  {
    std::lock_guard<std::mutex> g(g_pool_blocks.mu);
    auto it = g_pool_blocks.by_data.find(data);
    if (it == g_pool_blocks.by_data.end()) return false;
    found = it->second;
    g_pool_blocks.by_data.erase(it);
  }
  free_device_block(found.first, found.second);
  return true;
}

static void free_pool_block(void* data) {
  if (!release_pool_block(data)) {
    TORCH_WARN("mirage: freeing ", data, ", which is no live block of a private memory pool (freed twice?)");
  }
}

static c10::DataPtr pool_block_data(DeviceIndex dev, CachedBlock* block) {
  {
    std::lock_guard<std::mutex> g(g_pool_blocks.mu);
    g_pool_blocks.by_data[block->host] = {dev, block};
  }
  return {block->host, block->host, &free_pool_block, c10::Device(DeviceType::CUDA, dev)};
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
REGISTER_ALLOCATOR(DeviceType::CUDA, &g_current_device_allocator);

// Pinned host memory is ordinary host memory; we only remember which pointers were pinned, and
// keep torch.cuda.host_memory_stats' counts (blocks are counted at the next power of two, as the
// caching host allocator rounds them; nothing is cached, so every block is an active request).
struct PinnedMemoryAllocator final : c10::Allocator {
  std::mutex mu;
  std::unordered_map<const void*, int64_t> live;  // pointer -> counted (rounded) bytes
  // current, peak, allocated, freed: blocks, then bytes
  int64_t blocks[4] = {0, 0, 0, 0}, bytes[4] = {0, 0, 0, 0};
  static void release(void* p);
  c10::DataPtr allocate(size_t n) override {
    void* p = c10::alloc_cpu(n == 0 ? 1 : n);
    const int64_t counted = static_cast<int64_t>(c10::llvm::PowerOf2Ceil(n == 0 ? 1 : n));
    {
      std::lock_guard<std::mutex> g(mu);
      live.emplace(p, counted);
      blocks[0] += 1, blocks[2] += 1, blocks[1] = std::max(blocks[1], blocks[0]);
      bytes[0] += counted, bytes[2] += counted, bytes[1] = std::max(bytes[1], bytes[0]);
    }
    return {p, p, &PinnedMemoryAllocator::release, c10::Device(DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool is_pinned(const void* p) {
    std::lock_guard<std::mutex> g(mu);
    return live.count(p) != 0;
  }
};
static PinnedMemoryAllocator g_pinned;
void PinnedMemoryAllocator::release(void* p) {
  {
    std::lock_guard<std::mutex> g(g_pinned.mu);
    auto it = g_pinned.live.find(p);
    if (it != g_pinned.live.end()) {
      g_pinned.blocks[0] -= 1, g_pinned.blocks[3] += 1;
      g_pinned.bytes[0] -= it->second, g_pinned.bytes[3] += it->second;
      g_pinned.live.erase(it);
    }
  }
  c10::free_cpu(p);
}

// ---------------------------------------------------------------- random generators

// One CPU-kind generator per device: the CPU kernels that do the work insist on a CPU
// generator, and each device must still have a stream of numbers of its own.
static std::mutex g_gen_mu;
static std::array<at::Generator, kMaxDevices> g_generators;

static const at::Generator& default_generator(DeviceIndex dev) {
  check_index(dev);
  std::lock_guard<std::mutex> g(g_gen_mu);
  if (!g_generators[dev].defined()) {
    g_generators[dev] = at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val);
  }
  return g_generators[dev];
}

// ---------------------------------------------------------------- hooks

struct MirageHooks final : at::CUDAHooksInterface {
  explicit MirageHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return config().num_devices > 0; }
  bool hasCUDA() const override { return config().num_devices > 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return config().num_devices; }
  int getNumGPUs() const override { return config().num_devices; }
  DeviceIndex current_device() const override { return tl_device; }
  DeviceIndex getCurrentDevice() const override { return tl_device; }
  void setCurrentDevice(DeviceIndex d) const override {
    check_index(d);
    tl_device = d;
  }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    DeviceIndex old = tl_device;
    setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(DeviceIndex d) const override {
    return default_generator(d < 0 ? tl_device : d);
  }
  at::Generator getNewGenerator(DeviceIndex) const override {
    return at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val);
  }
  bool isPinnedPtr(const void* data) const override { return g_pinned.is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned; }
  c10::Allocator* getCUDADeviceAllocator() const override { return &g_current_device_allocator; }
  c10::Device getDeviceFromPtr(void*) const override { return c10::Device(DeviceType::CUDA, tl_device); }
  void deviceSynchronize(DeviceIndex) const override {}
};
}  // namespace mirage

// C10_REGISTER_TYPED_CLASS must name the registry in namespace at.
namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", mirage::MirageHooks)
}

namespace mirage {

// ---------------------------------------------------------------- device guard

struct MirageGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {DeviceType::CUDA, tl_device}; }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    tl_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { tl_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, tl_stream[d.index()]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, g_next_stream_id++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    tl_stream[s.device_index()] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return config().num_devices; }
  // Work is synchronous, so an event is just the host time at which it was recorded (ms).
  void record(void** event, const c10::Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new double(0);
    *static_cast<double*>(*event) =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override { delete static_cast<double*>(event); }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start && end, "Both events must be recorded before calculating elapsed time.");
    return *static_cast<double*>(end) - *static_cast<double*>(start);
  }
};
C10_REGISTER_GUARD_IMPL(CUDA, MirageGuard);

// ---------------------------------------------------------------- CPU views of device memory

// A CPU tensor over the same bytes as `t` (same geometry, same offset), for CPU kernels.
// Its storage is resizable with the CPU allocator so that out= kernels may grow it; the
// fallback notices and moves the grown bytes back into device memory.
//
// An alias costs three heap objects (TensorImpl, StorageImpl, version counter) and most ops
// take two or three tensors, so aliases nobody kept are recycled per thread: the next alias
// re-points one at other bytes instead of allocating.
static thread_local std::vector<c10::intrusive_ptr<c10::TensorImpl>> tl_spare_aliases;
constexpr size_t kMaxSpareAliases = 16;

static at::Tensor cpu_alias(const at::Tensor& t) {
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
static void recycle_alias(at::Tensor&& alias) {
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
static at::Tensor on_storage(c10::Storage storage, const at::Tensor& geometry) {
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
static c10::Storage adopt_storage(const c10::Storage& cpu, DeviceIndex dev) {
  const int64_t nbytes = static_cast<int64_t>(cpu.nbytes());
  c10::DataPtr dp = adopted_bytes(const_cast<void*>(cpu.data()), nbytes, dev, [&](AdoptedBytes& a) { a.owner = cpu; });
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, std::move(dp), &device_allocators()[dev], true));
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
static bool relabel_in_place(at::Tensor& out, DeviceIndex dev) {
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
  s->set_allocator(&device_allocators()[dev]);
  impl->set_storage_keep_dtype(impl->storage());  // the tensor's device follows its storage's
  impl->*KeySetOf::member = plain_keys().cuda;
  return true;
}

// After a CPU kernel wrote into `alias` (in-place or out=), make `orig` reflect any resize.
static void sync_back(const at::Tensor& orig, const at::Tensor& alias) {
  c10::StorageImpl* os = orig.storage().unsafeGetStorageImpl();
  c10::StorageImpl* as = alias.storage().unsafeGetStorageImpl();
  if (as->data() != os->data() || as->nbytes() != os->nbytes()) {
    c10::DataPtr dp = device_allocators()[orig.device().index()].allocate(as->nbytes());
    if (as->nbytes()) std::memcpy(dp.get(), as->data(), as->nbytes());
    os->set_data_ptr_noswap(std::move(dp));
    os->set_nbytes(as->nbytes());
  }
  if (alias.sizes() != orig.sizes() || alias.strides() != orig.strides() ||
      alias.storage_offset() != orig.storage_offset()) {
    orig.unsafeGetTensorImpl()->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
  }
}

// ---------------------------------------------------------------- the boxed fallback

// Applies `fn` to every tensor of a Tensor[] or Tensor[][] value, in place.
template <class Fn>
static void map_tensor_lists(c10::IValue& iv, Fn&& fn) {
  if (iv.isTensorList()) {
    auto list = iv.toTensorList();
    for (size_t j = 0; j < list.size(); ++j) list[j] = fn(list[j]);
    iv = std::move(list);
  } else if (iv.isList()) {
    auto outer = iv.toList();
    for (size_t j = 0; j < outer.size(); ++j) {
      c10::IValue inner = outer.get(j);
      if (!inner.isTensorList()) return;
      map_tensor_lists(inner, fn);
      outer.set(j, std::move(inner));
    }
  }
}

struct Aliased {
  at::Tensor orig;
  at::Tensor alias;
};

[[noreturn]] static void device_mismatch(const c10::Device& a, const c10::Device& b, const c10::OperatorHandle& op) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a,
      " and ", b, "! (when checking argument for ", op.schema().name(), ")");
}

// ---------------------------------------------------------------- CUDA IPC
//
// A device tensor sent to another process of the session (torch.multiprocessing) shares its
// memory, as CUDA IPC does. On first share, the storage's bytes move into a named shared-memory
// segment (/mirage-<uid>-<session>.ipc-<pid>-<n>) that replaces its memory in place, so every
// tensor on that storage keeps working; the receiver maps the segment. The sender's process
// owns (and is charged for) the memory; the segment's name goes when the sender frees it, and a
// receiver's mapping stays valid until it lets go, as CUDA IPC memory outlives neither.

struct SharedSegment {
  std::string name;
  void* base;
  size_t nbytes;
  DeviceIndex device;
  CachedBlock* block;  // the sending process's: it unlinks the name and holds the memory
};

static void release_segment(void* ctx) {
  auto* seg = static_cast<SharedSegment*>(ctx);
  munmap(seg->base, seg->nbytes);
  if (seg->block) {
    shm_unlink(seg->name.c_str());
    free_device_block(seg->device, seg->block);
  }
  delete seg;
}

static std::string ipc_prefix() {
  const char* session = std::getenv("MIRAGE_SESSION");
  return "/mirage-" + std::to_string(getuid()) + "-" + (session && *session ? session : "nosession") + ".ipc-" +
         std::to_string(getpid()) + "-";
}

static void* map_segment(const std::string& name, size_t nbytes, bool create) {
  const int fd = shm_open(name.c_str(), O_RDWR | (create ? O_CREAT | O_EXCL : 0), 0600);
  if (fd < 0) return nullptr;
  const bool sized = !create || posix_fallocate(fd, 0, static_cast<off_t>(nbytes)) == 0;
  void* base = sized ? mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  if (base == MAP_FAILED && create) shm_unlink(name.c_str());
  return base == MAP_FAILED ? nullptr : base;
}

// The segment name of `t`'s storage, moving the storage into a segment on first share.
static std::string share_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const c10::DataPtr& current = storage->data_ptr();
  if (current.get_deleter() == &release_segment) {
    return static_cast<SharedSegment*>(current.get_context())->name;
  }
  static std::atomic<int64_t> next{0};
  const size_t nbytes = storage->nbytes();
  const DeviceIndex dev = t.device().index();
  const std::string name = ipc_prefix() + std::to_string(next++);
  void* base = map_segment(name, nbytes, true);
  TORCH_CHECK_WITH(OutOfMemoryError, base, "mirage: could not place ", format_size(static_cast<int64_t>(nbytes)),
      " of shared GPU memory in /dev/shm for CUDA IPC (is it full? `df -h /dev/shm`)");
  std::memcpy(base, storage->data(), nbytes);
  CachedBlock* block = allocate_block(dev, nbytes);  // the old block is freed as it is released below
  auto* seg = new SharedSegment{name, base, nbytes, dev, block};
  storage->set_data_ptr_noswap(c10::DataPtr(base, seg, &release_segment, c10::Device(DeviceType::CUDA, dev)));
  return name;
}

// A device tensor (uint8, nbytes) over a segment another process of the session shared.
static at::Tensor open_shared(const std::string& name, int64_t nbytes, DeviceIndex dev) {
  check_index(dev);
  void* base = map_segment(name, static_cast<size_t>(nbytes), false);
  TORCH_CHECK(base, "mirage: the CUDA tensor's memory is gone: the sending process freed it (or exited) before "
      "this one received it. Keep a CUDA tensor alive in the sender until the receiver has it, as CUDA IPC requires.");
  auto* seg = new SharedSegment{name, base, static_cast<size_t>(nbytes), dev, nullptr};
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
      c10::DataPtr(base, seg, &release_segment, c10::Device(DeviceType::CUDA, dev)), &device_allocators()[dev], false));
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA),
      caffe2::TypeMeta::Make<uint8_t>());
  impl->set_sizes_contiguous({nbytes});
  return at::Tensor(std::move(impl));
}

// ---------------------------------------------------------------- CUDA graph capture
//
// As on a GPU, work issued while a graph is being captured is recorded, not run: each op's
// results are allocated with the shapes its Meta kernel computes (their contents undefined until
// a replay, as CUDA's), and the op, its arguments (the same device tensors) and its results are
// kept. A replay runs the recorded ops again in order, writing into the same result tensors, so
// new values in the captured inputs give new outputs. Capture is process-wide (autograd's device
// threads issue a captured backward pass). What a GPU refuses while capturing (copies to or
// from the host, synchronisation, data-dependent shapes) raises CUDA's error.

struct CapturedGraph {
  std::vector<std::function<void()>> steps;
};
static std::mutex g_graphs_mu;
static std::map<int64_t, CapturedGraph> g_graphs;
static int64_t g_next_graph = 1;
static std::atomic<int64_t> g_capturing{0};   // the graph being captured, 0 if none
static std::atomic<bool> g_capture_failed{false};

static bool capturing() { return g_capturing.load(std::memory_order_relaxed) != 0; }

[[noreturn]] static void refuse_during_capture() {
  g_capture_failed = true;
  const bool amd = config().amd;
  const char* api = amd ? "HIP" : "CUDA";
  TORCH_CHECK(false, api, " error: operation not permitted when stream is capturing\n", api,
      " kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
      "incorrect.\nFor debugging consider passing ", api, "_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_", amd ? "HIP" : "CUDA",
      "_DSA` to enable device-side assertions.\n");
}

// Whether `p` is memory of a private pool (what a graph captures into).
static bool in_private_pool(const void* p) {
  for (DeviceIndex d = 0; d < config().num_devices; ++d) {
    if (g_caches[d].in_private_segment(p)) return true;
  }
  return false;
}

// What a captured graph keeps of a tensor. Memory of a private pool is referred to, not owned (a
// CUDA graph holds addresses): the pool keeps the bytes while the graph holds the pool, and the
// tensor itself may die, as cudagraph trees expect of a graph's outputs. Other memory (parameters,
// inputs allocated before the capture) is kept alive with the graph, which on a GPU would be the
// caller's duty.
static at::Tensor graph_reference(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return t;
  const c10::Storage& storage = t.storage();
  void* data = const_cast<void*>(storage.data());
  if (data == nullptr || !in_private_pool(data)) return t;
  c10::Storage alias(c10::Storage::use_byte_size_t(), storage.nbytes(), c10::DataPtr(data, storage.device()),
                     nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(alias), c10::DispatchKeySet(t.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

// A recorded op's argument as the graph keeps it (new lists: the caller's are left alone).
static c10::IValue graph_reference(const c10::IValue& iv) {
  if (iv.isTensor()) return graph_reference(iv.toTensor());
  if (iv.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : iv.toTensorList().vec()) out.push_back(graph_reference(t));
    return out;
  }
  if (iv.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    for (const std::optional<at::Tensor>& t : iv.toOptionalTensorList().vec()) {
      out.push_back(t.has_value() ? std::optional<at::Tensor>(graph_reference(*t)) : std::nullopt);
    }
    return out;
  }
  return iv;
}

static void record_step(std::function<void()> step) {
  std::lock_guard<std::mutex> g(g_graphs_mu);
  g_graphs[g_capturing.load()].steps.push_back(std::move(step));
}

// Records one op issued during capture and leaves its (not yet computed) results on the stack.
static void capture_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t num_args = op.schema().arguments().size();
  const size_t base = stack->size() - num_args;
  // what the graph keeps of the arguments, taken before they are swapped for meta stand-ins below
  std::vector<c10::IValue> inputs;
  for (size_t i = base; i < stack->size(); ++i) inputs.push_back(graph_reference((*stack)[i]));
  std::vector<std::pair<at::Tensor, at::Tensor>> metas;  // (meta stand-in, device tensor)
  DeviceIndex target = tl_device;
  auto to_meta = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.is_cuda()) {
      if (t.defined() && t.dim() > 0) refuse_during_capture();  // a host tensor in device work
      return t;
    }
    target = t.device().index();
    at::Tensor m = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
    metas.emplace_back(m, t);
    return m;
  };
  for (size_t i = base; i < stack->size(); ++i) {
    c10::IValue& iv = (*stack)[i];
    if (iv.isTensor()) {
      iv = to_meta(iv.toTensor());
    } else if (iv.isTensorList() || iv.isList()) {
      map_tensor_lists(iv, to_meta);
    } else if (iv.isOptionalTensorList()) {
      auto list = iv.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> e = list[j];
        if (e.has_value()) list[j] = to_meta(*e);
      }
      iv = std::move(list);
    } else if (iv.isDevice() && iv.toDevice().is_cuda()) {
      iv = c10::IValue(c10::Device(c10::kMeta));
    }
  }
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  } catch (...) {  // c10::Error, or a Python meta function's exception
    refuse_during_capture();  // no shape without the data (nonzero, item, ...): the GPU syncs
  }
  std::vector<std::pair<at::Tensor, size_t>> fresh;  // results the replay copies in, by position
  const size_t num_returns = op.schema().returns().size();
  const size_t ret_base = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    c10::IValue& iv = (*stack)[ret_base + i];
    if (!iv.isTensor()) refuse_during_capture();  // a host value from device data
    const at::Tensor m = iv.toTensor();
    at::Tensor result;
    for (auto& [meta, device] : metas) {
      if (meta.unsafeGetTensorImpl() == m.unsafeGetTensorImpl()) result = device;
    }
    if (!result.defined()) {
      for (auto& [meta, device] : metas) {
        if (meta.storage().is_alias_of(m.storage())) result = on_storage(device.storage(), m);
      }
    }
    if (!result.defined()) {
      result = at::empty_strided(m.sizes(), m.strides(), m.options().device(c10::Device(DeviceType::CUDA, target)));
      fresh.emplace_back(result, i);
    }
    iv = result;
  }
  for (auto& [captured, position] : fresh) captured = graph_reference(captured);
  record_step([op, inputs, fresh] {
    torch::jit::Stack replay(inputs.begin(), inputs.end());
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CUDA), &replay);
    for (const auto& [captured, position] : fresh) {
      at::Tensor into = captured;
      into.copy_(replay[position].toTensor());
    }
  });
}

// An operator with a CUDA kernel in a CUDA build but no CPU kernel (and no shim kernel): the
// dispatcher's own message would name the CPU backend, which the caller never asked for.
[[noreturn]] static void not_emulated(const c10::OperatorHandle& op) {
  const auto& name = op.schema().operator_name();
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mirage: ", name.name, name.overload_name.empty() ? "" : ".", name.overload_name,
      " has a CUDA kernel in a CUDA build of torch but no CPU kernel the emulated device could run, and mirage does "
      "not emulate it (README: 'CUDA-only operators'). Fix: use the operation it implements through its public "
      "API (e.g. torch.nn.functional), which takes an emulated path.");
}

// What the fallback reads of an operator's schema, read once per thread and operator: walking
// the schema (argument types, alias annotations) on every call cost more than the lookup.
struct OpTraits {
  const c10::Argument* arguments = nullptr;  // tells a schema re-registered at the same address
  uint32_t num_args = 0;
  uint32_t num_returns = 0;
  bool is_mutable = false;
  c10::SmallVector<uint32_t, 2> generator_args;  // Generator? arguments, which the CPU kernel must get
};

static const OpTraits& traits_of(const c10::FunctionSchema& schema) {
  static thread_local std::unordered_map<const c10::FunctionSchema*, OpTraits> known;
  OpTraits& traits = known[&schema];
  const auto& args = schema.arguments();
  if (traits.arguments != args.data() || traits.num_args != args.size()) {
    traits = OpTraits{args.data(), static_cast<uint32_t>(args.size()),
                      static_cast<uint32_t>(schema.returns().size()), schema.is_mutable(), {}};
    for (uint32_t i = 0; i < args.size(); ++i) {
      const auto& type = args[i].type();
      if (type->kind() == c10::TypeKind::OptionalType &&
          type->containedType(0)->kind() == c10::TypeKind::GeneratorType) {
        traits.generator_args.push_back(i);
      }
    }
  }
  return traits;
}

static void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  if (capturing()) return capture_op(op, stack);
  const OpTraits& traits = traits_of(op.schema());
  const size_t num_args = traits.num_args;
  const size_t base = stack->size() - num_args;
  c10::SmallVector<Aliased, 8> aliased;
  DeviceIndex target = -1;
  bool has_cpu_tensor = false;
  c10::Device cpu_device(DeviceType::CPU);

  // Replaces a device tensor with its CPU alias; checks device agreement as PyTorch does.
  auto convert = [&](const at::Tensor& t, bool allow_cpu) -> at::Tensor {
    if (!t.defined()) return t;
    if (t.device().type() != DeviceType::CUDA) {
      if (!allow_cpu && t.dim() > 0) {
        if (target >= 0) device_mismatch(c10::Device(DeviceType::CUDA, target), t.device(), op);
        has_cpu_tensor = true;
      }
      return t;
    }
    DeviceIndex d = t.device().index();
    if (target < 0) {
      if (has_cpu_tensor) device_mismatch(t.device(), cpu_device, op);
      target = d;
    } else if (d != target) {
      device_mismatch(c10::Device(DeviceType::CUDA, target), t.device(), op);
    }
    at::Tensor a = cpu_alias(t);
    aliased.push_back({t, a});
    return a;
  };

  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& iv = (*stack)[base + i];
    if (iv.isTensor()) {
      iv = convert(iv.toTensor(), false);
    } else if (iv.isTensorList()) {
      map_tensor_lists(iv, [&](const at::Tensor& t) { return convert(t, false); });
    } else if (iv.isOptionalTensorList()) {
      // Index lists: real CUDA accepts CPU index tensors here.
      auto list = iv.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> e = list[j];
        if (e.has_value()) list[j] = convert(*e, true);
      }
      iv = std::move(list);
    } else if (iv.isList()) {  // Tensor[][] (c10d's allgather / reduce_scatter outputs)
      map_tensor_lists(iv, [&](const at::Tensor& t) { return convert(t, false); });
    } else if (iv.isDevice()) {
      c10::Device d = iv.toDevice();
      if (d.is_cuda()) {
        if (target < 0) target = d.has_index() ? d.index() : tl_device;
        iv = c10::IValue(cpu_device);
      }
    }
  }
  if (target < 0) target = tl_device;
  for (uint32_t i : traits.generator_args) {
    c10::IValue& iv = (*stack)[base + i];
    if (iv.isNone()) iv = c10::IValue(default_generator(target));
  }

  {
    BusyTimer busy(target);
    try {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    } catch (const c10::NotImplementedError&) {
      if (op.hasKernelForDispatchKey(c10::DispatchKey::CPU)) throw;
      not_emulated(op);
    }
  }

  // Writes (in-place / out=) may have resized an alias: carry that back to the device tensor.
  if (!aliased.empty() && traits.is_mutable) {
    for (auto& a : aliased) sync_back(a.orig, a.alias);
  }

  // Map results: an alias itself -> the original; a view of an alias -> a view of the original
  // storage; anything else is fresh CPU memory, re-labelled as memory of the target device (in
  // place where the result alone holds it, else on a new device storage shared by its views).
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 2> adopted;
  auto map_back = [&](const at::Tensor& out) -> at::Tensor {
    if (!out.defined() || out.device().type() != DeviceType::CPU || out.layout() != c10::kStrided) return out;
    c10::StorageImpl* s = out.storage().unsafeGetStorageImpl();
    for (auto& a : aliased) {
      if (a.alias.unsafeGetTensorImpl() == out.unsafeGetTensorImpl()) return a.orig;
    }
    for (auto& a : aliased) {
      if (a.alias.storage().unsafeGetStorageImpl() == s) return on_storage(a.orig.storage(), out);
    }
    for (auto& p : adopted) {
      if (p.first == s) return on_storage(p.second, out);
    }
    adopted.emplace_back(s, adopt_storage(out.storage(), target));
    return on_storage(adopted.back().second, out);
  };
  const size_t num_returns = traits.num_returns;
  const size_t ret_base = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    c10::IValue& iv = (*stack)[ret_base + i];
    if (iv.isTensor()) {
      // The common case, one fresh tensor that nothing else holds: take it out of the IValue so
      // that the IValue's reference does not count, re-label it, put it back.
      at::Tensor out = std::move(iv).toTensor();
      if (out.defined() && out.device().type() == DeviceType::CPU && out.layout() == c10::kStrided &&
          relabel_in_place(out, target)) {
        iv = std::move(out);
        continue;
      }
      iv = map_back(out);
    } else {
      map_tensor_lists(iv, map_back);
    }
  }
  for (auto& a : aliased) {
    a.orig.reset();
    recycle_alias(std::move(a.alias));
  }
}

// ---------------------------------------------------------------- explicit kernels

static DeviceIndex index_of(std::optional<c10::Device> device) {
  DeviceIndex d = (device && device->has_index()) ? device->index() : tl_device;
  check_index(d);
  return d;
}

static at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>, std::optional<c10::Device> device, std::optional<bool>,
    std::optional<at::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, &device_allocators()[index_of(device)],
      c10::DispatchKeySet(c10::DispatchKey::CUDA), c10::dtype_or_default(dtype), memory_format);
}

static at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
    std::optional<at::ScalarType> dtype, std::optional<at::Layout>, std::optional<c10::Device> device,
    std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &device_allocators()[index_of(device)],
      c10::DispatchKeySet(c10::DispatchKey::CUDA), c10::dtype_or_default(dtype));
}

// Any direction between host and device, or between devices: the bytes are all host memory.
static at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool) {
  if (capturing()) {
    if (!self.is_cuda() || !src.is_cuda()) refuse_during_capture();  // a host copy syncs the stream
    record_step([into = graph_reference(self), from = graph_reference(src)]() mutable { into.copy_(from); });
    return self;
  }
  at::Tensor dst_cpu = self.is_cuda() ? cpu_alias(self) : self;
  at::Tensor src_cpu = src.is_cuda() ? cpu_alias(src) : src;
  BusyTimer busy(self.is_cuda() ? self.device().index() : src.is_cuda() ? src.device().index() : -1);
  at::_ops::copy_::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), dst_cpu, src_cpu, false);
  return self;
}

static at::Tensor& set_storage(at::Tensor& self, c10::Storage source, c10::SymInt offset,
    c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  if (!impl->storage().is_alias_of(source)) impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
      offset.expect_int());
  return self;
}

static at::Tensor& set_whole_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(0);
  impl->set_sizes_contiguous({numel});
  return self;
}

static at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  auto* impl = self.unsafeGetTensorImpl();
  if (self.unsafeGetTensorImpl() != source.unsafeGetTensorImpl()) {
    impl->set_storage_keep_dtype(source.storage());
    impl->set_sizes_and_strides(source.sizes(), source.strides(), source.storage_offset());
  }
  return self;
}

static at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, &device_allocators()[self.device().index()], true);
  self.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(empty));
  self.unsafeGetTensorImpl()->set_sizes_contiguous({0});
  return self;
}

// Bernoulli dropout with the device's own generator (the CPU kernel would draw from the CPU's).
static std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0 || (train.has_value() && !*train) || p == 0) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  if (p == 1) return {at::zeros_like(input), at::zeros_like(input, input.options().dtype(at::kBool))};
  at::Tensor mask = at::empty_like(input).bernoulli_(1 - p, default_generator(input.device().index()));
  at::Tensor out = input.mul(mask).mul_(1.0 / (1 - p));
  return {out, mask.to(at::kBool)};
}

static bool no_cudnn_ctc_loss(const at::Tensor&, const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef, int64_t) {
  return false;
}
static bool no_cudnn_ctc_loss_tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  return false;
}

// _softmax / _log_softmax with half_to_float=True (autocast's way: half in, float out) have
// only a CUDA kernel; the CPU kernel refuses the conversion. As CUDA computes them (in float),
// the input is widened first; the backward, given float gradients for a half input
// (input_dtype), returns the half gradient as CUDA does. Everything else: the CPU kernel.
static void softmax_half_to_float(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t num_args = op.schema().arguments().size();
  c10::IValue* arg = &(*stack)[stack->size() - num_args];
  const bool backward = op.schema().name().find("backward") != std::string::npos;
  if (!backward) {  // (self, dim, half_to_float)
    if (arg[2].toBool()) {
      const at::Tensor& self = arg[0].toTensor();
      TORCH_CHECK(self.scalar_type() == at::kHalf || self.scalar_type() == at::kBFloat16,
                  "conversion is supported for Half type only");
      arg[0] = self.to(at::kFloat);
      arg[2] = false;
    }
    fallback(op, ks, stack);
    return;
  }
  // (grad_output, output, dim, input_dtype)
  const at::ScalarType input_dtype = static_cast<at::ScalarType>(arg[3].toInt());
  const at::ScalarType grad_dtype = arg[0].toTensor().scalar_type();
  if (grad_dtype == input_dtype) {
    fallback(op, ks, stack);
    return;
  }
  TORCH_CHECK(grad_dtype == at::kFloat && (input_dtype == at::kHalf || input_dtype == at::kBFloat16),
              "expected input and grad types to match, or input to be at::Half and grad to be at::Float");
  arg[3] = static_cast<int64_t>(grad_dtype);
  fallback(op, ks, stack);
  c10::IValue& result = stack->back();
  result = result.toTensor().to(input_dtype);
}

}  // namespace mirage

TORCH_LIBRARY_IMPL(_, CUDA, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&mirage::fallback>());
}

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("empty.memory_format", TORCH_FN(mirage::empty_memory_format));
  m.impl("empty_strided", TORCH_FN(mirage::empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", TORCH_FN(at::native::resize_));
  m.impl("copy_", TORCH_FN(mirage::copy_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(mirage::set_storage));
  m.impl("set_.source_Storage", TORCH_FN(mirage::set_whole_storage));
  m.impl("set_.source_Tensor", TORCH_FN(mirage::set_source_tensor));
  m.impl("set_", TORCH_FN(mirage::set_empty));
  m.impl("native_dropout", TORCH_FN(mirage::native_dropout));
  for (const char* name : {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&mirage::softmax_half_to_float>());
  }
  // Composites that pick a CUDA-only backend for device tensors (depthwise, slow 3d and
  // transposed convolutions, whose CUDA kernels a CPU build lacks): run the CPU composite on
  // CPU views instead, so the CPU's own algorithm choice (and numbers) apply.
  for (const char* name : {"convolution", "_convolution", "convolution_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&mirage::fallback>());
  }
  // There is no cuDNN/MIOpen behind the emulated device: ctc_loss takes its native path.
  m.impl("_use_cudnn_ctc_loss", TORCH_FN(mirage::no_cudnn_ctc_loss));
  m.impl("_use_cudnn_ctc_loss.Tensor", TORCH_FN(mirage::no_cudnn_ctc_loss_tensor));
  m.impl("_use_miopen_ctc_loss", TORCH_FN(mirage::no_cudnn_ctc_loss));
  m.impl("_use_miopen_ctc_loss.Tensor", TORCH_FN(mirage::no_cudnn_ctc_loss_tensor));
}

// DDP's reducer asks for a timer for its device type; work is synchronous, so host time it is.
namespace c10d {
struct MirageHostTimer final : Timer {
  explicit MirageHostTimer(c10::Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto from = getTimestamp(start), to = getTimestamp(end);
    if (!from || !to || *to < *from) return std::nullopt;
    return *to - *from;
  }
};
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kCUDA, MirageHostTimer);
}  // namespace c10d

namespace mirage {
// Aten ops with a CPU kernel but no CUDA kernel would otherwise reach CUDA through a
// CompositeExplicitAutogradNonFunctional "default backend kernel" (a functional wrapper around
// the out= variant), which behaves differently from the CPU path (extra out= resizes, warnings).
// Give every such aten op the fallback explicitly, so CUDA runs exactly the CPU kernel.
static const int g_register_cpu_twins = [] {
  static torch::Library aten(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  // (c10d's ops keep torch's own CUDA kernels: they hand device tensors to the group's cuda
  // backend, the emulated NCCL of mirage/nccl.)
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) continue;
    std::string qualified = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    aten.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  return 0;
}();
}  // namespace mirage

// The Python side asks for each device's default generator (torch.cuda.default_generators).
// Storage resize (UntypedStorage.resize_, which FSDP uses to free and re-grow parameters) is
// compiled out of a CPU build for CUDA storages; Python reaches this instead.
namespace mirage {
static void resize_storage_bytes(const at::Tensor& self, int64_t nbytes) {
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  c10::DataPtr fresh = device_allocators()[self.device().index()].allocate(static_cast<size_t>(nbytes));
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

TORCH_LIBRARY(mirage, m) {
  m.def("host_view(Tensor t) -> Tensor", &mirage::host_view);
  m.def("device_views(Tensor[] host, int[] devices) -> Tensor[]", &mirage::device_views);
  m.def("resize_storage_bytes_(Tensor(a!) self, int nbytes) -> ()", &mirage::resize_storage_bytes);
  m.def("default_generator(int device) -> Generator?", [](int64_t device) {
    return mirage::default_generator(static_cast<c10::DeviceIndex>(device));
  });
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
  m.def("record_memory_history(bool enabled, bool stacks, int max_entries, bool clear) -> ()",
        [](bool enabled, bool stacks, int64_t max_entries, bool clear) {
          std::lock_guard<std::mutex> g(mirage::g_history.mu);
          mirage::g_history.stacks = stacks;
          mirage::g_history.max_entries = static_cast<size_t>(std::max<int64_t>(max_entries, 0));  // 0: no trace
          mirage::g_history.enabled = enabled;
          if (clear || !enabled) {
            for (auto& trace : mirage::g_history.traces) trace.clear();
          }
          if (!enabled) {
            for (auto& frames : mirage::g_history.block_frames) frames.clear();
          }
        });
  // A device's recorded history: entries [action, address, size, stream, time_us, stack], live
  // blocks [address, stack], the stacks as lists of frame indices, and the frames (file, function,
  // line). A stack of -1: none was gathered.
  m.def("memory_history(int device) -> (int[][], int[][], int[][], str[], str[], int[])", [](int64_t device) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    std::vector<std::vector<int64_t>> entries, blocks;
    std::vector<torch::CapturedTraceback*> stacks;
    std::unordered_map<const torch::CapturedTraceback*, int64_t> index;
    auto stack_of = [&](const std::shared_ptr<torch::CapturedTraceback>& tb) -> int64_t {
      if (!tb) return -1;
      auto [it, fresh] = index.emplace(tb.get(), static_cast<int64_t>(stacks.size()));
      if (fresh) stacks.push_back(tb.get());
      return it->second;
    };
    std::lock_guard<std::mutex> g(mirage::g_history.mu);
    for (const auto& e : mirage::g_history.traces[device]) {
      entries.push_back({static_cast<int64_t>(e.action), static_cast<int64_t>(e.address), static_cast<int64_t>(e.size),
                         e.stream, e.time_us, stack_of(e.frames)});
    }
    for (const auto& [address, tb] : mirage::g_history.block_frames[device]) {
      blocks.push_back({static_cast<int64_t>(address), stack_of(tb)});
    }
    const torch::SymbolizedTracebacks symbolized = torch::symbolize(stacks);
    std::vector<std::vector<int64_t>> frame_lists;
    for (const auto& tb : symbolized.tracebacks) frame_lists.emplace_back(tb.begin(), tb.end());
    std::vector<std::string> files, names;
    std::vector<int64_t> lines;
    for (const auto& frame : symbolized.all_frames) {
      files.push_back(frame.filename);
      names.push_back(frame.funcname);
      lines.push_back(static_cast<int64_t>(frame.lineno));
    }
    return std::make_tuple(entries, blocks, frame_lists, files, names, lines);
  });
  m.def("share_storage_memory(Tensor t) -> str", [](const at::Tensor& t) { return mirage::share_storage(t); });
  m.def("open_shared_storage(str name, int nbytes, int device) -> Tensor",
        [](const std::string& name, int64_t nbytes, int64_t device) {
          return mirage::open_shared(name, nbytes, static_cast<c10::DeviceIndex>(device));
        });
  // A capture on `device` whose allocations come from private pool (id0, id1).
  m.def("graph_capture_begin(int device, int id0, int id1) -> int", [](int64_t device, int64_t id0, int64_t id1) -> int64_t {
    std::lock_guard<std::mutex> g(mirage::g_graphs_mu);
    TORCH_CHECK(!mirage::capturing(), "Cannot capture a new graph while another one is being captured");
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    const int64_t id = mirage::g_next_graph++;
    mirage::g_graphs[id];
    mirage::g_capture_failed = false;
    mirage::g_capture_pool = {static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)};
    mirage::g_capture_device.store(static_cast<int>(device), std::memory_order_release);
    mirage::g_capturing = id;
    return id;
  });
  m.def("graph_capture_end(int graph) -> ()", [](int64_t graph) {
    TORCH_CHECK(mirage::g_capturing.load() == graph, "graph ", graph, " is not being captured");
    mirage::g_capture_device.store(-1, std::memory_order_release);
    mirage::g_capturing = 0;
    if (mirage::g_capture_failed.exchange(false)) {
      const char* api = mirage::config().amd ? "HIP" : "CUDA";
      TORCH_CHECK(false, api, " error: operation failed due to a previous error during capture");
    }
  });
  m.def("graph_reference(Tensor t) -> Tensor", [](const at::Tensor& t) { return mirage::graph_reference(t); });
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
  m.def("memory_history_enabled() -> bool", []() { return mirage::g_history.enabled.load(); });
  m.def("graph_capturing() -> bool", []() { return mirage::capturing(); });
  m.def("graph_capture_id() -> int", []() -> int64_t { return mirage::g_capturing.load(); });
  // Work that does not pass the op path (a torch.compile'd graph's host kernels) joins the graph
  // being captured as a call of operator `op` (schema `(int handle) -> ()`) on each replay.
  m.def("graph_record_call(str op, int handle) -> ()", [](const std::string& name, int64_t handle) {
    TORCH_CHECK(mirage::capturing(), "graph_record_call: no CUDA graph is being captured");
    const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
    mirage::record_step([op, handle] {
      torch::jit::Stack stack{c10::IValue(handle)};
      op.callBoxed(&stack);
    });
  });
  m.def("graph_check_not_capturing() -> ()", []() {
    if (mirage::capturing()) mirage::refuse_during_capture();
  });
  m.def("graph_replay(int graph) -> ()", [](int64_t graph) {
    std::vector<std::function<void()>> steps;
    {
      std::lock_guard<std::mutex> g(mirage::g_graphs_mu);
      auto it = mirage::g_graphs.find(graph);
      TORCH_CHECK(it != mirage::g_graphs.end(), "Called CUDAGraph::replay without a preceding successful capture.");
      steps = it->second.steps;
    }
    for (auto& step : steps) step();
  });
  m.def("graph_reset(int graph) -> ()", [](int64_t graph) {
    std::lock_guard<std::mutex> g(mirage::g_graphs_mu);
    mirage::g_graphs.erase(graph);
  });
  m.def("host_memory_counts() -> int[]", []() {
    std::lock_guard<std::mutex> g(mirage::g_pinned.mu);
    const auto& p = mirage::g_pinned;
    return std::vector<int64_t>{p.blocks[0], p.blocks[1], p.blocks[2], p.blocks[3],
                                p.bytes[0], p.bytes[1], p.bytes[2], p.bytes[3]};
  });
  m.def("reset_host_memory_counts(bool peak) -> ()", [](bool peak) {
    std::lock_guard<std::mutex> g(mirage::g_pinned.mu);
    auto& p = mirage::g_pinned;
    if (peak) {
      p.blocks[1] = p.blocks[0], p.bytes[1] = p.bytes[0];
    } else {
      p.blocks[2] = p.blocks[3] = p.bytes[2] = p.bytes[3] = 0;
    }
  });
  m.def("busy_region_enter(int device) -> ()", [](int64_t device) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    mirage::tl_busy_regions.push_back(std::make_unique<mirage::BusyTimer>(static_cast<c10::DeviceIndex>(device)));
  });
  m.def("busy_region_exit() -> ()", []() {
    TORCH_CHECK(!mirage::tl_busy_regions.empty(), "busy_region_exit without busy_region_enter");
    mirage::tl_busy_regions.pop_back();
  });
  m.def("busy_time_ns(int device) -> int", [](int64_t device) -> int64_t {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    return mirage::busy_time(static_cast<c10::DeviceIndex>(device));
  });
}
