// The caching allocator's bookkeeping (see caching_allocator.h for the rules and what is modelled).

#include "caching_allocator.h"
#include "shared_device_memory.h"

#include <c10/core/AllocatorConfig.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>
#include <c10/util/llvmMathExtras.h>

#include <algorithm>
#include <unordered_set>

namespace mirage {

namespace cfg = c10::CachingAllocator;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::StatArray;

bool BlockOrder::operator()(const CachedBlock* a, const CachedBlock* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->address < b->address;
}

bool AddressOrder::operator()(const CachedBlock* a, const CachedBlock* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  return a->address < b->address;
}

namespace {

bool expandable_segments() { return cfg::AcceleratorAllocatorConfig::use_expandable_segments(); }

size_t round_up(size_t n, size_t step) { return (n + step - 1) / step * step; }

size_t max_split_size() { return cfg::AcceleratorAllocatorConfig::max_split_size(); }

// A power-of-two division at or above `size` (roundup_power2_divisions).
size_t next_power2_division(size_t size, size_t divisions) {
  if (c10::llvm::isPowerOf2_64(size)) return size;
  const size_t floor = c10::llvm::PowerOf2Floor(size);
  const size_t step = floor >> (63 - c10::llvm::countLeadingZeros(static_cast<uint64_t>(divisions)));
  if (step == 0) return floor << 1;
  const size_t rounded_down = size & ~(step - 1);
  return rounded_down == size ? size : rounded_down + step;
}

size_t round_size(size_t size) {
  if (size < cfg::kMinBlockSize) return cfg::kMinBlockSize;
  const size_t divisions = cfg::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
  if (divisions > 1 && size > cfg::kMinBlockSize * divisions) return next_power2_division(size, divisions);
  return cfg::kMinBlockSize * ((size + cfg::kMinBlockSize - 1) / cfg::kMinBlockSize);
}

}  // namespace

size_t DeviceCache::segment_size_for(size_t requested) {
  const size_t size = round_size(requested);
  if (size <= cfg::kSmallSize) return cfg::kSmallBuffer;
  if (size < cfg::kMinLargeAlloc) return cfg::AcceleratorAllocatorConfig::large_segment_size();
  return cfg::kRoundLarge * ((size + cfg::kRoundLarge - 1) / cfg::kRoundLarge);
}

void DeviceCache::tell(TraceAction action, const CachedBlock* block) const {
  if (observe_) (*observe_)(action, block->address, block->size, block->stream);
}

bool DeviceCache::take_free_block(BlockPool& pool, size_t size, int64_t stream, CachedBlock*& out) {
  CachedBlock key{stream, size, 0, 0, &pool};
  if (allowed_by_fraction_.load(std::memory_order_relaxed) > 0 &&
      cfg::AcceleratorAllocatorConfig::garbage_collection_threshold() > 0.0) {
    pool.free_block_searches += 1;
  }
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != stream) return false;
  if ((*it)->space) {
    if (expandable_segments()) {
      // A free block followed by unmapped pages fits as the size it can grow to.
      auto growable = [](const CachedBlock* b) { return b->size + (b->next && !b->next->mapped ? b->next->size : 0); };
      for (auto next = std::next(it); (*it)->space && next != pool.blocks.end() && (*next)->stream == stream &&
                                      growable(*next) < growable(*it);) {
        it = next++;
      }
    } else {  // turned off since: only ordinary segments serve requests
      do {
        ++it;
      } while (it != pool.blocks.end() && (*it)->space && (*it)->stream == stream);
      if (it == pool.blocks.end() || (*it)->stream != stream) return false;
    }
  }
  // An oversize block never serves a smaller request, nor a much smaller oversize one.
  if (size < max_split_size() && (*it)->size >= max_split_size()) return false;
  if (size >= max_split_size() && (*it)->size >= size + cfg::AcceleratorAllocatorConfig::max_non_split_rounding_size()) {
    return false;
  }
  out = *it;
  pool.blocks.erase(it);
  return true;
}

bool DeviceCache::new_segment(BlockPool& pool, size_t size, int64_t stream, bool retry, const Reserve& reserve,
                              CachedBlock*& out) {
  const bool is_private = pool.owner != PoolId{0, 0};
  if (expandable_segments() && !is_private) return grow_expandable(pool, size, stream, retry, reserve, out);
  const size_t bytes = segment_size_for(size);
  if (retry) stats_.num_alloc_retries += 1;
  // a private segment's bytes are taken first: a host that cannot back them raises, nothing counted
  char* host = is_private ? static_cast<char*>(allocate_device_bytes(bytes)) : nullptr;
  if (!reserve(bytes, reserved_total_)) {
    if (host) free_device_bytes(host);
    return false;
  }
  if (host) private_segments_[reinterpret_cast<uintptr_t>(host)] = bytes;
  out = make_block(CachedBlock{stream, bytes, 0, next_address_, &pool});
  out->host = host;
  next_address_ += bytes;
  reserved_total_ += static_cast<int64_t>(bytes);
  update(stats_.segment, pool.is_small, 1);
  update(stats_.reserved_bytes, pool.is_small, static_cast<int64_t>(bytes));
  if (bytes >= max_split_size()) update(stats_.oversize_segments, 1);
  stats_.num_device_alloc += 1;
  tell(TraceAction::segment_alloc, out);
  return true;
}

// The lowest-addressed free-and-unmapped run of `size` bytes in the stream's expandable segments,
// or a new segment's whole (unmapped) range.
CachedBlock* DeviceCache::find_expandable(BlockPool& pool, size_t size, int64_t stream) {
  auto free = [](const CachedBlock* b) { return b && !b->allocated; };
  auto has_room = [&](const CachedBlock* b) {
    size_t bytes = 0;
    for (; bytes < size && free(b); b = b->next) bytes += b->size;
    return bytes >= size;
  };
  CachedBlock key{stream, 0, 0, 0, &pool};
  for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
    CachedBlock* candidate = free((*it)->prev) ? (*it)->prev : *it;
    if (has_room(candidate)) return candidate;
  }
  const size_t page = pool.is_small ? cfg::kSmallBuffer : cfg::AcceleratorAllocatorConfig::large_segment_size();
  const size_t capacity = capacity_.load(std::memory_order_relaxed);
  const size_t span = round_up(std::max<size_t>(capacity + capacity / 8, size), page);
  spaces_.push_back(std::make_unique<ExpandableSpace>(ExpandableSpace{next_address_, span, page}));
  next_address_ += span;
  auto* whole = make_block(CachedBlock{stream, span, 0, spaces_.back()->base, &pool});
  whole->mapped = false;
  whole->space = spaces_.back().get();
  pool.unmapped.insert(whole);
  return whole;
}

// Maps the pages that cover the first `size` bytes of an unmapped range (all or none of them).
bool DeviceCache::map(CachedBlock* block, size_t size, const Reserve& reserve) {
  BlockPool& pool = *block->pool;
  const size_t bytes = round_up(size, block->space->page);
  if (!reserve(bytes, reserved_total_)) return false;
  pool.unmapped.erase(block);
  block->mapped = true;
  if (bytes < block->size) {
    auto* rest = make_block(CachedBlock{block->stream, block->size - bytes, 0, block->address + bytes, &pool});
    rest->mapped = false;
    rest->space = block->space;
    rest->prev = block;
    rest->next = block->next;
    if (rest->next) rest->next->prev = rest;
    block->next = rest;
    block->size = bytes;
    pool.unmapped.insert(rest);
  }
  merge(block, block->prev);
  merge(block, block->next);
  cache(block);
  reserved_total_ += static_cast<int64_t>(bytes);
  update(stats_.reserved_bytes, pool.is_small, static_cast<int64_t>(bytes));
  stats_.num_device_alloc += 1;
  if (observe_) (*observe_)(TraceAction::segment_map, block->address, bytes, block->stream);
  return true;
}

// A block of `size` bytes from the stream's expandable segment, mapping what it lacks.
bool DeviceCache::grow_expandable(BlockPool& pool, size_t size, int64_t stream, bool retry, const Reserve& reserve,
                                  CachedBlock*& out) {
  if (retry) stats_.num_alloc_retries += 1;
  CachedBlock* candidate = find_expandable(pool, size, stream);
  if (!candidate->mapped && !map(candidate, std::min(candidate->size, size), reserve)) return false;
  while (candidate->size < size) {  // free -> unmapped: map the pages it lacks, which merge into it
    CachedBlock* grown = candidate->next;
    if (!map(grown, std::min(size - candidate->size, grown->size), reserve)) return false;
    candidate = grown;
  }
  pool.blocks.erase(candidate);
  out = candidate;
  return true;
}

// Unmaps the wholly free pages of a free block of an expandable segment; the parts of pages
// still shared with allocated neighbours stay mapped as free blocks of their own.
void DeviceCache::unmap(CachedBlock* block, const Release& release) {
  BlockPool& pool = *block->pool;
  const ExpandableSpace& space = *block->space;
  const uint64_t first = space.base + round_up(block->address - space.base, space.page);
  const uint64_t last = space.base + (block->address + block->size - space.base) / space.page * space.page;
  if (first >= last) return;
  pool.blocks.erase(block);
  if (first > block->address) {
    auto* before = make_block(CachedBlock{block->stream, first - block->address, 0, block->address, &pool});
    before->space = block->space;
    before->prev = block->prev;
    if (before->prev) before->prev->next = before;
    before->next = block;
    block->prev = before;
    cache(before);
  }
  if (block->address + block->size > last) {
    auto* after = make_block(CachedBlock{block->stream, block->address + block->size - last, 0, last, &pool});
    after->space = block->space;
    after->next = block->next;
    if (after->next) after->next->prev = after;
    after->prev = block;
    block->next = after;
    cache(after);
  }
  const size_t bytes = last - first;
  block->address = first;
  block->size = bytes;
  block->mapped = false;
  merge(block, block->prev);
  merge(block, block->next);
  pool.unmapped.insert(block);
  release(bytes);
  reserved_total_ -= static_cast<int64_t>(bytes);
  update(stats_.reserved_bytes, pool.is_small, -static_cast<int64_t>(bytes));
  stats_.num_device_free += 1;
  if (observe_) (*observe_)(TraceAction::segment_unmap, first, bytes, block->stream);
}

// A wholly unmapped expandable segment goes, address range and all.
void DeviceCache::release_space(CachedBlock* block) {
  block->pool->unmapped.erase(block);
  spaces_.erase(std::remove_if(spaces_.begin(), spaces_.end(),
                               [block](const std::unique_ptr<ExpandableSpace>& s) { return s.get() == block->space; }),
                spaces_.end());
  drop_block(block);
}

// garbage_collection_threshold: once reserved memory passes the threshold of the allowed memory,
// frees unsplit cached large blocks, those unused the longest (above the average age) first.
void DeviceCache::collect_garbage(const Release& release) {
  const size_t allowed = allowed_by_fraction_.load(std::memory_order_relaxed);
  const double threshold = cfg::AcceleratorAllocatorConfig::garbage_collection_threshold();
  if (allowed == 0 || threshold <= 0.0) return;
  const auto limit = static_cast<int64_t>(threshold * static_cast<double>(allowed));
  if (reserved_total_ <= limit) return;
  const int64_t target = reserved_total_ - limit;
  BlockPool& pool = default_.large;
  auto age = [&pool](const CachedBlock* b) { return pool.free_block_searches - b->free_since; };
  int64_t total_age = 0, freeable = 0, reclaimed = 0;
  for (const CachedBlock* b : pool.blocks) {
    if (!b->is_split() && !b->space) total_age += age(b), freeable += 1;
  }
  for (bool freed = true; reclaimed < target && freed && freeable > 0;) {
    const double average = static_cast<double>(total_age) / static_cast<double>(freeable);
    freed = false;
    for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
      CachedBlock* b = *it++;
      if (b->is_split() || b->space || static_cast<double>(age(b)) < average) continue;
      freed = true;
      reclaimed += static_cast<int64_t>(b->size);
      total_age -= age(b);
      freeable -= 1;
      release_segment(b, release);
    }
  }
}

void DeviceCache::release_segment(CachedBlock* block, const Release& release) {
  tell(TraceAction::segment_free, block);
  release(block->size);
  reserved_total_ -= static_cast<int64_t>(block->size);
  block->pool->blocks.erase(block);
  update(stats_.segment, block->pool->is_small, -1);
  update(stats_.reserved_bytes, block->pool->is_small, -static_cast<int64_t>(block->size));
  if (block->size >= max_split_size()) update(stats_.oversize_segments, -1);
  stats_.num_device_free += 1;
  if (block->host) {
    private_segments_.erase(reinterpret_cast<uintptr_t>(block->host));
    free_device_bytes(block->host);
  }
  drop_block(block);
}

// With max_split_size set: frees cached oversize segments (largest first) until `size` fits.
bool DeviceCache::release_oversize(BlockPool& pool, size_t size, int64_t stream, const Release& release) {
  if (max_split_size() == SIZE_MAX) return false;
  CachedBlock key{stream, std::max(size, max_split_size()), 0, 0, &pool};
  auto it = pool.blocks.lower_bound(&key);
  if (it != pool.blocks.end() && (*it)->stream == stream && !(*it)->space) {
    release_segment(*it, release);
    return true;
  }
  if (it == pool.blocks.begin()) return false;
  size_t released = 0;
  --it;
  while (released < key.size && (*it)->size >= max_split_size() && (*it)->stream == stream && !(*it)->space) {
    auto current = it;
    const bool first = current == pool.blocks.begin();
    if (!first) --it;
    released += (*current)->size;
    release_segment(*current, release);
    if (first) break;
  }
  return released >= key.size;
}

void DeviceCache::release_free_segments(BlockPool& pool, const Release& release) {
  std::vector<CachedBlock*> to_unmap;  // unmapping changes the pool: gathered first
  for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
    CachedBlock* block = *it++;
    if (block->space) {
      to_unmap.push_back(block);
    } else if (!block->is_split()) {
      release_segment(block, release);
    }
  }
  for (CachedBlock* block : to_unmap) {
    unmap(block, release);
    if (!block->mapped && !block->is_split()) release_space(block);
  }
}

// The default pools' whole free segments, and those of released MemPools (dropped once empty).
void DeviceCache::release_segments_locked(const Release& release) {
  stats_.num_sync_all_streams += 1;
  release_free_segments(default_.large, release);
  release_free_segments(default_.small, release);
  for (auto it = private_.begin(); it != private_.end();) {
    PoolPair& pair = it->second;
    if (pair.released) {
      release_free_segments(pair.large, release);
      release_free_segments(pair.small, release);
    }
    const bool empty = pair.large.blocks.empty() && pair.small.blocks.empty() && pair.large.unmapped.empty() &&
                       pair.small.unmapped.empty();
    bool in_use = false;
    for (const CachedBlock* b : active_) {
      if (b->pool->owner == it->first) {
        in_use = true;
        break;
      }
    }
    it = pair.released && empty && !in_use ? private_.erase(it) : std::next(it);
  }
}

void DeviceCache::release_pool(PoolId pool, const Release& release, const Observer* observe) {
  std::lock_guard<SpinLock> lock(mu_);
  auto it = private_.find(pool);
  if (it == private_.end()) return;
  observe_ = observe;
  it->second.released = true;
  release_segments_locked(release);
  observe_ = nullptr;
}

CachedBlock* DeviceCache::allocate(size_t requested, int64_t stream, const Reserve& reserve, const Release& release,
                                   const Observer* observe, PoolId pool_id) {
  std::lock_guard<SpinLock> lock(mu_);
  observe_ = observe;
  const size_t size = round_size(requested);
  PoolPair* pair = &default_;
  if (pool_id != PoolId{0, 0}) {
    auto [it, fresh] = private_.try_emplace(pool_id, &nodes_);
    if (fresh) it->second.small.owner = it->second.large.owner = pool_id;
    pair = &it->second;
  }
  BlockPool& pool = size <= cfg::kSmallSize ? pair->small : pair->large;
  CachedBlock* block = nullptr;
  bool found = take_free_block(pool, size, stream, block);
  if (!found) collect_garbage(release);
  found = found || new_segment(pool, size, stream, false, reserve, block) ||
      (release_oversize(pool, size, stream, release) && new_segment(pool, size, stream, false, reserve, block)) ||
      ((release_segments_locked(release), true) && new_segment(pool, size, stream, true, reserve, block));
  if (!found) {
    stats_.num_ooms += 1;
    if (observe) (*observe)(TraceAction::oom, 0, size, stream);
    observe_ = nullptr;
    return nullptr;
  }
  const size_t remaining_bytes = block->size - size;
  const bool split = pool.is_small || expandable_segments()
                         ? remaining_bytes >= cfg::kMinBlockSize
                         : size < max_split_size() && remaining_bytes > cfg::kSmallSize;
  block = use_block(block, size, requested, split);
  observe_ = nullptr;
  return block;
}

// Allocates `size` bytes at the start of a free block taken out of its pool's cache, the rest
// (when `split`) cached as a free block of its own.
CachedBlock* DeviceCache::use_block(CachedBlock* block, size_t size, size_t requested, bool split) {
  BlockPool& pool = *block->pool;
  const int64_t stream = block->stream;
  const bool already_split = block->is_split();
  if (split) {
    auto* rest = block;
    block = make_block(CachedBlock{stream, size, 0, rest->address, &pool});
    block->prev = rest->prev;
    if (block->prev) block->prev->next = block;
    block->next = rest;
    rest->prev = block;
    rest->address += size;
    rest->size -= size;
    block->host = rest->host;
    if (rest->host) rest->host += size;
    block->space = rest->space;
    cache(rest);
    if (block->space) {
      // expandable segments are left out of the inactive_split statistics, as CUDA does
    } else if (already_split) {
      update(stats_.inactive_split_bytes, pool.is_small, -static_cast<int64_t>(block->size));
    } else {
      update(stats_.inactive_split_bytes, pool.is_small, static_cast<int64_t>(rest->size));
      update(stats_.inactive_split, pool.is_small, 1);
    }
  } else if (already_split && !block->space) {
    update(stats_.inactive_split_bytes, pool.is_small, -static_cast<int64_t>(block->size));
    update(stats_.inactive_split, pool.is_small, -1);
  }
  block->allocated = true;
  block->requested = requested;
  active_.insert(block);
  update(stats_.allocation, pool.is_small, 1);
  update(stats_.allocated_bytes, pool.is_small, static_cast<int64_t>(block->size));
  update(stats_.active, pool.is_small, 1);
  update(stats_.active_bytes, pool.is_small, static_cast<int64_t>(block->size));
  update(stats_.requested_bytes, pool.is_small, static_cast<int64_t>(requested));
  if (block->size >= max_split_size()) update(stats_.oversize_allocations, 1);
  if (observe_) (*observe_)(TraceAction::alloc, block->address, requested, stream);  // the request, as CUDA's
  return block;
}

size_t DeviceCache::merge(CachedBlock* dst, CachedBlock* src) {
  if (!src || src->allocated || src->mapped != dst->mapped) return 0;
  if (dst->prev == src) {
    dst->address = src->address;
    dst->host = src->host;
    dst->prev = src->prev;
    if (dst->prev) dst->prev->next = dst;
  } else {
    dst->next = src->next;
    if (dst->next) dst->next->prev = dst;
  }
  const size_t subsumed = src->size;
  dst->size += subsumed;
  if (src->mapped) {
    dst->pool->blocks.erase(src);
  } else {
    dst->pool->unmapped.erase(src);
  }
  drop_block(src);
  return subsumed;
}

// A free block goes (back) into its pool's cache; its age for garbage collection starts now.
void DeviceCache::cache(CachedBlock* block) {
  block->free_since = block->pool->free_block_searches;
  block->pool->blocks.insert(block);
}

void DeviceCache::free(CachedBlock* block, const Observer* observe) {
  std::lock_guard<SpinLock> lock(mu_);
  if (observe) {  // work is synchronous: the free completes as it is requested
    (*observe)(TraceAction::free_requested, block->address, block->requested, block->stream);
    (*observe)(TraceAction::free_completed, block->address, block->requested, block->stream);
  }
  free_locked(block);
}

void DeviceCache::free_locked(CachedBlock* block) {
  const bool small = block->pool->is_small;
  const int64_t size = static_cast<int64_t>(block->size);
  const int64_t requested = static_cast<int64_t>(block->requested);
  block->allocated = false;
  update(stats_.allocation, small, -1);
  update(stats_.allocated_bytes, small, -size);
  if (block->size >= max_split_size()) update(stats_.oversize_allocations, -1);
  int64_t split_blocks = 0, split_bytes = 0;
  for (CachedBlock* neighbour : {block->prev, block->next}) {
    const size_t subsumed = merge(block, neighbour);
    if (subsumed > 0) split_blocks -= 1, split_bytes -= static_cast<int64_t>(subsumed);
  }
  active_.erase(block);
  cache(block);
  if (block->is_split()) split_blocks += 1, split_bytes += static_cast<int64_t>(block->size);
  if (!block->space) {
    update(stats_.inactive_split, small, split_blocks);
    update(stats_.inactive_split_bytes, small, split_bytes);
  }
  update(stats_.active, small, -1);
  update(stats_.active_bytes, small, -size);
  update(stats_.requested_bytes, small, -requested);
}

void DeviceCache::release_cached(const Release& release, const Observer* observe) {
  std::lock_guard<SpinLock> lock(mu_);
  observe_ = observe;
  release_segments_locked(release);
  observe_ = nullptr;
}

void DeviceCache::set_limits(size_t capacity, size_t allowed_by_fraction) {
  capacity_.store(capacity, std::memory_order_relaxed);
  allowed_by_fraction_.store(allowed_by_fraction, std::memory_order_relaxed);
}

c10::CachingDeviceAllocator::DeviceStats DeviceCache::stats() {
  std::lock_guard<SpinLock> lock(mu_);
  c10::CachingDeviceAllocator::DeviceStats copy = stats_;
  copy.max_split_size = static_cast<int64_t>(max_split_size());
  return copy;
}

void DeviceCache::reset_peak() {
  std::lock_guard<SpinLock> lock(mu_);
  for (StatArray* array : {&stats_.allocation, &stats_.segment, &stats_.active, &stats_.inactive_split,
                           &stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes,
                           &stats_.inactive_split_bytes, &stats_.requested_bytes}) {
    for (Stat& stat : *array) stat.peak = stat.current;
  }
  stats_.oversize_allocations.peak = stats_.oversize_allocations.current;
  stats_.oversize_segments.peak = stats_.oversize_segments.current;
}

void DeviceCache::reset_accumulated() {
  std::lock_guard<SpinLock> lock(mu_);
  for (StatArray* array : {&stats_.allocation, &stats_.segment, &stats_.active, &stats_.inactive_split,
                           &stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes,
                           &stats_.inactive_split_bytes, &stats_.requested_bytes}) {
    for (Stat& stat : *array) stat.allocated = stat.freed = 0;
  }
  for (Stat* stat : {&stats_.oversize_allocations, &stats_.oversize_segments}) stat->allocated = stat->freed = 0;
  stats_.num_alloc_retries = stats_.num_ooms = stats_.num_sync_all_streams = 0;
  stats_.num_device_alloc = stats_.num_device_free = 0;
}

int64_t DeviceCache::reserved() {
  std::lock_guard<SpinLock> lock(mu_);
  return reserved_total_;
}

int64_t DeviceCache::allocated() {
  std::lock_guard<SpinLock> lock(mu_);
  return stats_.allocated_bytes[0].current;
}

std::vector<SegmentView> DeviceCache::segments() {
  std::lock_guard<SpinLock> lock(mu_);
  std::vector<SegmentView> out;
  std::vector<const CachedBlock*> heads;
  auto add_heads = [&heads](const auto& blocks) {  // each contiguous mapped range is a segment
    for (const CachedBlock* b : blocks) {
      if (!b->prev || !b->prev->mapped) heads.push_back(b);
    }
  };
  add_heads(active_);
  add_heads(default_.small.blocks);
  add_heads(default_.large.blocks);
  for (const auto& [id, pair] : private_) {
    add_heads(pair.small.blocks);
    add_heads(pair.large.blocks);
  }
  for (const CachedBlock* head : heads) {
    SegmentView view{head->address, 0, head->stream, head->pool->is_small, head->space != nullptr, head->pool->owner, {}};
    for (const CachedBlock* b = head; b && b->mapped; b = b->next) {
      view.total_size += b->size;
      view.blocks.push_back({b->address, b->size, b->requested, b->allocated});
    }
    out.push_back(std::move(view));
  }
  std::sort(out.begin(), out.end(), [](const SegmentView& a, const SegmentView& b) { return a.address < b.address; });
  return out;
}

std::vector<SegmentView> DeviceCache::pool_segments(PoolId pool) {
  std::vector<SegmentView> all = segments();
  std::vector<SegmentView> out;
  for (SegmentView& view : all) {
    if (view.pool == pool) out.push_back(std::move(view));
  }
  return out;
}

DeviceCache::Restored DeviceCache::restore_pool(PoolId pool_id, const std::vector<SegmentView>& checkpoint) {
  std::lock_guard<SpinLock> lock(mu_);
  observe_ = nullptr;
  auto it = private_.find(pool_id);
  TORCH_CHECK(it != private_.end(), "Could not find pool of id");
  PoolPair& pair = it->second;
  Restored out;
  std::vector<CachedBlock*> live;
  for (CachedBlock* b : active_) {
    if (b->pool->owner == pool_id) live.push_back(b);
  }
  for (CachedBlock* b : live) {
    out.freed.push_back(b->host);
    free_locked(b);
  }
  for (const SegmentView& segment : checkpoint) {
    BlockPool& pool = segment.is_small ? pair.small : pair.large;
    auto head = std::find_if(pool.blocks.begin(), pool.blocks.end(),
                             [&](const CachedBlock* b) { return b->address == segment.address; });
    TORCH_CHECK(head != pool.blocks.end(), "could not find ", segment.address);
    CachedBlock* rest = *head;
    TORCH_CHECK(rest->prev == nullptr, "Expected curr_block->prev == nullptr to be true, but got false. ");
    TORCH_CHECK(rest->next == nullptr, "Expected curr_block->next == nullptr to be true, but got false. ");
    std::vector<CachedBlock*> carved;
    for (const SegmentView::Block& b : segment.blocks) {
      pool.blocks.erase(rest);
      CachedBlock* block = use_block(rest, b.size, b.requested, b.size < rest->size);
      carved.push_back(block);
      rest = block->next;
      if (!rest) break;
    }
    for (size_t i = 0; i < carved.size(); ++i) {
      if (segment.blocks[i].allocated) {
        out.allocated.emplace_back(carved[i]->host, carved[i]);
      } else {
        free_locked(carved[i]);
      }
    }
  }
  return out;
}

std::vector<char*> DeviceCache::pool_live_blocks(PoolId pool) {
  std::lock_guard<SpinLock> lock(mu_);
  std::vector<char*> out;
  for (const CachedBlock* b : active_) {
    if (b->pool->owner == pool) out.push_back(b->host);
  }
  return out;
}

bool DeviceCache::in_private_segment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<SpinLock> lock(mu_);
  auto it = private_segments_.upper_bound(address);
  if (it == private_segments_.begin()) return false;
  --it;
  return address < it->first + it->second;
}

double apply_allocator_config(bool amd) {
  std::optional<std::string> env = c10::utils::get_env("PYTORCH_CUDA_ALLOC_CONF");
  if (!env && amd) env = c10::utils::get_env("PYTORCH_HIP_ALLOC_CONF");
  if (!env) env = c10::utils::get_env("PYTORCH_ALLOC_CONF");
  if (!env) return -1;
  cfg::AcceleratorAllocatorConfig::instance().parseArgs(*env);  // the generic keys, with their checks
  // The keys a CUDA (or ROCm) build's CUDAAllocatorConfig adds; everything else is an error there.
  static const std::unordered_set<std::string> device_keys{
      "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "release_lock_on_hipmalloc",
      "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
      "pinned_num_register_threads", "per_process_memory_fraction", "pinned_free_catch_all",
      "throw_on_cudamalloc_oom"};
  const auto& generic_keys = cfg::AcceleratorAllocatorConfig::getKeys();
  const cfg::ConfigTokenizer tokens(*env);
  double fraction = -1;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& key = tokens[i];
    TORCH_CHECK_VALUE(device_keys.count(key) || generic_keys.count(key), "Unrecognized key '", key,
                      "' in CUDA allocator config.");
    if (key == "backend") {
      tokens.checkToken(i + 1, ":");
      TORCH_CHECK_VALUE(tokens[i + 2] == "native" || tokens[i + 2] == "cudaMallocAsync",
                        "Unknown allocator backend, options are native and cudaMallocAsync");
    }
    if (key == "per_process_memory_fraction") {
      tokens.checkToken(i + 1, ":");
      fraction = tokens.toDouble(i + 2);
      TORCH_CHECK_VALUE(fraction >= 0.0 && fraction <= 1.0,
                        "per_process_memory_fraction is invalid, set it in [0.0, 1.0]");
    }
    i = tokens.skipKey(i);
    if (i + 1 < tokens.size()) tokens.checkToken(++i, ",");
  }
  return fraction;
}

}  // namespace mirage
