// The emulated device's caching allocator: the bookkeeping of PyTorch's CUDA caching allocator
// (c10/cuda/CUDACachingAllocator.cpp), run on every device allocation and free so that
// memory_allocated / memory_reserved / memory_stats, and the point at which a program runs out of
// memory, are those of a real GPU. Its rules: requests round up to 512 bytes (or to a power-of-two
// division with roundup_power2_divisions); requests of up to 1 MiB come from the small pool,
// whose segments are 2 MiB; larger ones from the large pool, whose segments are 20 MiB for
// requests under 10 MiB and the request rounded up to 2 MiB otherwise; the best-fitting cached
// block of the same stream is reused and split when the rest is worth keeping (>= 512 bytes in
// the small pool, > 1 MiB in the large one, never blocks of max_split_size or more); freed blocks
// merge with free neighbours; a failed segment reservation frees cached segments and retries.
//
// Only the bookkeeping is modelled: a block's bytes are host memory the shim holds elsewhere (the
// CPU kernels' own allocations, kept zero-copy). Segment "addresses" are a per-device counter.
// A torch.cuda.MemPool is a private pair of pools: what a thread allocates inside use_mem_pool
// comes from (and is cached in) its own segments, which empty_cache leaves alone until the pool
// is released. With expandable_segments:True a pool's segment per stream is one address range
// (9/8 of the device) mapped page by page as it grows (2 MiB pages in the small pool, the large
// segment size in the large one); empty_cache and the retry before an OOM unmap its wholly free
// pages. garbage_collection_threshold frees the oldest unused cached segments once this process's
// reserved memory passes that fraction of its allowed memory (a memory fraction must be set, as on
// CUDA).
//
// A private pool (a MemPool's, or the one a CUDA graph captures into) holds its bytes as the real
// one does: each of its segments is one host allocation, and a block's memory is its segment's at
// the block's offset, so a freed block's bytes stay the pool's until the segment goes, and the
// same address is handed out again. Captured graphs replay into that memory and cudagraph trees
// checkpoint and restore a pool's blocks (pool_segments / restore_pool), so private pools never
// use expandable segments (CUDA's rule: its checkpoints do not support them).
#pragma once

#include <algorithm>
#include <c10/core/CachingDeviceAllocator.h>

#include <cstdint>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <set>
#include <string>
#include <vector>

namespace mirage {

struct CachedBlock;

// The cache's lock. It is held for well under a microsecond on the common path, by threads that
// seldom meet (the Python thread, autograd's device thread, the emulated NCCL's), where a
// futex-backed mutex's lock and unlock cost more than the bookkeeping they guard; a waiter yields.
class SpinLock {
 public:
  void lock() {
    while (held_.exchange(true, std::memory_order_acquire)) {
      while (held_.load(std::memory_order_relaxed)) std::this_thread::yield();
    }
  }
  void unlock() { held_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> held_{false};
};

// Nodes of one size kept for reuse: every split and merge makes and drops a block and the free-
// block sets' tree nodes, which from the heap cost a malloc and a free each (a small op allocates
// and frees a block or two). Used under the owning cache's lock, like everything it serves.
class NodePool {
 public:
  void* take(size_t bytes) {
    if (!head_) return ::operator new(bytes);
    void* node = head_;
    head_ = *static_cast<void**>(node);
    return node;
  }
  void give(void* node) {
    *static_cast<void**>(node) = head_;
    head_ = node;
  }

 private:
  void* head_ = nullptr;
};

// The free-block sets' allocator: their tree nodes (all of one type) from a NodePool.
template <class T>
struct PooledAllocator {
  using value_type = T;
  NodePool* pool;
  explicit PooledAllocator(NodePool* p) : pool(p) {}
  template <class U>
  PooledAllocator(const PooledAllocator<U>& other) : pool(other.pool) {}
  T* allocate(size_t n) {
    return static_cast<T*>(n == 1 ? pool->take(sizeof(T)) : ::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) {
    if (n == 1) {
      pool->give(p);
    } else {
      ::operator delete(p);
    }
  }
  template <class U>
  bool operator==(const PooledAllocator<U>& other) const { return pool == other.pool; }
};

struct BlockOrder {  // as the real allocator's BlockComparatorSize: stream, size, address
  bool operator()(const CachedBlock* a, const CachedBlock* b) const;
};

struct AddressOrder {  // as BlockComparatorAddress: stream, address (the unmapped ranges)
  bool operator()(const CachedBlock* a, const CachedBlock* b) const;
};

// An expandable segment: an address range whose pages are mapped as its blocks need them.
struct ExpandableSpace {
  uint64_t base;
  size_t size;
  size_t page;
};

using PoolId = std::pair<uint64_t, uint64_t>;  // a MemPool's id; {0, 0}: the default pools

struct BlockPool {
  BlockPool(bool small, NodePool* nodes)
      : blocks(BlockOrder(), PooledAllocator<CachedBlock*>(nodes)),
        unmapped(AddressOrder(), PooledAllocator<CachedBlock*>(nodes)), is_small(small) {}
  std::set<CachedBlock*, BlockOrder, PooledAllocator<CachedBlock*>> blocks;       // free mapped blocks
  std::set<CachedBlock*, AddressOrder, PooledAllocator<CachedBlock*>> unmapped;   // unmapped ranges of expandable segments
  bool is_small;
  PoolId owner{0, 0};
  int64_t free_block_searches = 0;  // garbage collection's clock (the real get_free_blocks_call_count)
};

struct PoolPair {
  explicit PoolPair(NodePool* nodes) : small(true, nodes), large(false, nodes) {}
  BlockPool small, large;
  bool released = false;  // its MemPool is gone: empty_cache may free its segments
};

struct CachedBlock {
  int64_t stream;
  size_t size;            // bytes of the block (rounded)
  size_t requested = 0;   // bytes the caller asked for
  uint64_t address;       // modelled device address
  BlockPool* pool;
  bool allocated = false;
  CachedBlock* prev = nullptr;  // neighbours within the segment
  CachedBlock* next = nullptr;
  bool mapped = true;                    // false: an unmapped range of an expandable segment
  ExpandableSpace* space = nullptr;      // the expandable segment it belongs to, if any
  int64_t free_since = 0;                // its pool's free_block_searches when it was cached
  char* host = nullptr;                  // private pools: the block's bytes (its segment's at its offset)
  CachedBlock* active_prev = nullptr;    // the allocated blocks' list (ActiveBlocks)
  CachedBlock* active_next = nullptr;
  uint64_t serial = 0;                   // which allocation holds it (--check-races tells a reuse by it)
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

// The allocated blocks, as an intrusive list: every allocation and free inserts and erases one,
// with no heap node and no tree walk (a std::set here was the op path's costliest line).
class ActiveBlocks {
 public:
  void insert(CachedBlock* block) {
    block->active_prev = nullptr;
    block->active_next = head_;
    if (head_) head_->active_prev = block;
    head_ = block;
  }
  void erase(CachedBlock* block) {
    if (block->active_prev == nullptr && head_ != block) return;  // not in the list
    (block->active_prev ? block->active_prev->active_next : head_) = block->active_next;
    if (block->active_next) block->active_next->active_prev = block->active_prev;
    block->active_prev = block->active_next = nullptr;
  }
  struct iterator {
    CachedBlock* block;
    CachedBlock* operator*() const { return block; }
    iterator& operator++() {
      block = block->active_next;
      return *this;
    }
    bool operator!=(const iterator& other) const { return block != other.block; }
  };
  iterator begin() const { return {head_}; }
  iterator end() const { return {nullptr}; }

 private:
  CachedBlock* head_ = nullptr;
};

// One segment as a snapshot shows it: its blocks in address order.
struct SegmentView {
  uint64_t address;
  size_t total_size;
  int64_t stream;
  bool is_small;
  bool is_expandable;
  PoolId pool;
  struct Block {
    uint64_t address;
    size_t size, requested;
    bool allocated;
  };
  std::vector<Block> blocks;
};

// What the allocator did, for torch.cuda.memory._record_memory_history (its TraceEntry actions; the
// size of an alloc or free is the caller's request, of a segment action the segment's).
enum class TraceAction { alloc, free_requested, free_completed, segment_alloc, segment_free, oom, segment_map,
                         segment_unmap };
using Observer = std::function<void(TraceAction action, uint64_t address, size_t size, int64_t stream)>;

class DeviceCache {
 public:
  // Reserves `bytes` of device memory for a new segment (or pages of an expandable one), given the
  // bytes already reserved; false when the device (or this process's memory fraction) has no room.
  // Called with the lock held.
  using Reserve = std::function<bool(size_t bytes, int64_t reserved_now)>;
  using Release = std::function<void(size_t bytes)>;

  // The block for a request of `requested` bytes on `stream`, or nullptr when even after freeing
  // every cached segment there is no room (num_ooms counts it; the caller raises).
  // `observe`, when given, hears every action of the call (with the cache's lock held).
  CachedBlock* allocate(size_t requested, int64_t stream, const Reserve& reserve, const Release& release,
                        const Observer* observe = nullptr, PoolId pool = {0, 0});
  void free(CachedBlock* block, const Observer* observe = nullptr);
  // Releases every cached segment with no allocated block (torch.cuda.empty_cache).
  void release_cached(const Release& release, const Observer* observe = nullptr);
  // A MemPool is gone (torch._C._cuda_releasePool): its cached segments go, the rest when freed.
  void release_pool(PoolId pool, const Release& release, const Observer* observe = nullptr);

  // A private pool's segments (a cudagraph tree's checkpoint of it, torch._C._cuda_getCheckpointState).
  std::vector<SegmentView> pool_segments(PoolId pool);
  // torch._C._cuda_setCheckpointPoolState: every allocated block of the pool is freed, then each
  // checkpointed segment is split into its checkpointed blocks again and those that were allocated
  // are allocated again. Raises when the pool or a segment is gone or a segment still has a live
  // block outside the checkpoint (CUDA's checks).
  struct Restored {
    std::vector<char*> freed;                                // host memory of the blocks freed
    std::vector<std::pair<char*, CachedBlock*>> allocated;   // the blocks allocated again
  };
  Restored restore_pool(PoolId pool, const std::vector<SegmentView>& checkpoint);
  // Host memory of the pool's allocated blocks (torch._C._cuda_checkPoolLiveAllocations).
  std::vector<char*> pool_live_blocks(PoolId pool);
  // Whether `p` lies in a private pool's segment (memory a captured graph replays into).
  bool in_private_segment(const void* p);

  // The device's capacity (expandable segments reserve 9/8 of it as address space) and the bytes
  // this process may hold there (garbage_collection_threshold is a fraction of them; 0: no
  // memory fraction set, no garbage collection).
  void set_limits(size_t capacity, size_t allowed_by_fraction);

  c10::CachingDeviceAllocator::DeviceStats stats();
  void reset_peak();
  void reset_accumulated();
  int64_t reserved();
  int64_t allocated();
  // Size of the segment a request of `requested` bytes would need (the OOM message's figure).
  static size_t segment_size_for(size_t requested);
  std::vector<SegmentView> segments();

 private:
  bool take_free_block(BlockPool& pool, size_t size, int64_t stream, CachedBlock*& out);
  bool new_segment(BlockPool& pool, size_t size, int64_t stream, bool retry, const Reserve& reserve, CachedBlock*& out);
  bool grow_expandable(BlockPool& pool, size_t size, int64_t stream, bool retry, const Reserve& reserve,
                       CachedBlock*& out);
  CachedBlock* find_expandable(BlockPool& pool, size_t size, int64_t stream);
  CachedBlock* use_block(CachedBlock* block, size_t size, size_t requested, bool split);
  void free_locked(CachedBlock* block);
  bool map(CachedBlock* block, size_t size, const Reserve& reserve);
  void unmap(CachedBlock* block, const Release& release);
  void release_space(CachedBlock* block);
  void collect_garbage(const Release& release);
  bool release_oversize(BlockPool& pool, size_t size, int64_t stream, const Release& release);
  void release_segments_locked(const Release& release);
  void release_free_segments(BlockPool& pool, const Release& release);
  void release_segment(CachedBlock* block, const Release& release);
  size_t merge(CachedBlock* dst, CachedBlock* src);
  void cache(CachedBlock* block);
  // Inline: a dozen statistics move on every allocation and free (the op path's hottest part).
  static void update(c10::CachingDeviceAllocator::Stat& stat, int64_t delta) {
    stat.current += delta;
    stat.peak = std::max(stat.peak, stat.current);
    (delta > 0 ? stat.allocated : stat.freed) += delta > 0 ? delta : -delta;
  }
  static void update(c10::CachingDeviceAllocator::StatArray& stat, bool small, int64_t delta) {
    update(stat[0], delta);
    update(stat[small ? 1 : 2], delta);
  }
  void tell(TraceAction action, const CachedBlock* block) const;

  // A block from the block pool, and back (all under the lock).
  CachedBlock* make_block(const CachedBlock& init) { return new (blocks_.take(sizeof(CachedBlock))) CachedBlock(init); }
  void drop_block(CachedBlock* block) {
    block->~CachedBlock();
    blocks_.give(block);
  }

  SpinLock mu_;
  NodePool nodes_;   // the free-block sets' tree nodes
  NodePool blocks_;  // CachedBlocks
  PoolPair default_{&nodes_};
  std::map<PoolId, PoolPair> private_;
  ActiveBlocks active_;
  std::map<uintptr_t, size_t> private_segments_;  // host memory of private pools' segments: base -> bytes
  std::vector<std::unique_ptr<ExpandableSpace>> spaces_;
  std::atomic<size_t> capacity_{0}, allowed_by_fraction_{0};
  uint64_t next_address_ = 0x7f0000000000ULL;
  int64_t reserved_total_ = 0;
  const Observer* observe_ = nullptr;  // the current call's, while it holds the lock
  c10::CachingDeviceAllocator::DeviceStats stats_;
};

// PYTORCH_CUDA_ALLOC_CONF (then PYTORCH_HIP_ALLOC_CONF on AMD, then PYTORCH_ALLOC_CONF), checked as
// the real CUDA allocator checks it when CUDA initialises: an unknown key raises PyTorch's
// "Unrecognized key 'x' in CUDA allocator config." ValueError. Returns the fraction set by the
// per_process_memory_fraction key, or a negative number when it is not set.
double apply_allocator_config(bool amd);

}  // namespace mirage
