// The caching allocator's bookkeeping (see caching_allocator.h for the rules and what is modelled).

#include "caching_allocator.h"

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

namespace {

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

void DeviceCache::update(StatArray& stat, bool small, int64_t delta) {
  update(stat[0], delta);
  update(stat[small ? 1 : 2], delta);
}

void DeviceCache::update(Stat& stat, int64_t delta) {
  stat.current += delta;
  stat.peak = std::max(stat.peak, stat.current);
  (delta > 0 ? stat.allocated : stat.freed) += delta > 0 ? delta : -delta;
}

void DeviceCache::tell(TraceAction action, const CachedBlock* block) const {
  if (observe_) (*observe_)(action, block->address, block->size, block->stream);
}

bool DeviceCache::take_free_block(BlockPool& pool, size_t size, int64_t stream, CachedBlock*& out) {
  CachedBlock key{stream, size, 0, 0, &pool};
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != stream) return false;
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
  const size_t bytes = segment_size_for(size);
  if (retry) stats_.num_alloc_retries += 1;
  if (!reserve(bytes, reserved_total_)) return false;
  out = new CachedBlock{stream, bytes, 0, next_address_, &pool};
  next_address_ += bytes;
  reserved_total_ += static_cast<int64_t>(bytes);
  update(stats_.segment, pool.is_small, 1);
  update(stats_.reserved_bytes, pool.is_small, static_cast<int64_t>(bytes));
  if (bytes >= max_split_size()) update(stats_.oversize_segments, 1);
  stats_.num_device_alloc += 1;
  tell(TraceAction::segment_alloc, out);
  return true;
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
  delete block;
}

// With max_split_size set: frees cached oversize segments (largest first) until `size` fits.
bool DeviceCache::release_oversize(BlockPool& pool, size_t size, int64_t stream, const Release& release) {
  if (max_split_size() == SIZE_MAX) return false;
  CachedBlock key{stream, std::max(size, max_split_size()), 0, 0, &pool};
  auto it = pool.blocks.lower_bound(&key);
  if (it != pool.blocks.end() && (*it)->stream == stream) {
    release_segment(*it, release);
    return true;
  }
  if (it == pool.blocks.begin()) return false;
  size_t released = 0;
  --it;
  while (released < key.size && (*it)->size >= max_split_size() && (*it)->stream == stream) {
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
  for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
    CachedBlock* block = *it++;
    if (!block->is_split()) release_segment(block, release);
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
    const bool empty = pair.large.blocks.empty() && pair.small.blocks.empty();
    const bool in_use = std::any_of(active_.begin(), active_.end(),
                                    [&](const CachedBlock* b) { return b->pool->owner == it->first; });
    it = pair.released && empty && !in_use ? private_.erase(it) : std::next(it);
  }
}

void DeviceCache::release_pool(PoolId pool, const Release& release, const Observer* observe) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = private_.find(pool);
  if (it == private_.end()) return;
  observe_ = observe;
  it->second.released = true;
  release_segments_locked(release);
  observe_ = nullptr;
}

CachedBlock* DeviceCache::allocate(size_t requested, int64_t stream, const Reserve& reserve, const Release& release,
                                   const Observer* observe, PoolId pool_id) {
  std::lock_guard<std::mutex> lock(mu_);
  observe_ = observe;
  const size_t size = round_size(requested);
  PoolPair* pair = &default_;
  if (pool_id != PoolId{0, 0}) {
    auto [it, fresh] = private_.try_emplace(pool_id);
    if (fresh) it->second.small.owner = it->second.large.owner = pool_id;
    pair = &it->second;
  }
  BlockPool& pool = size <= cfg::kSmallSize ? pair->small : pair->large;
  CachedBlock* block = nullptr;
  const bool found = take_free_block(pool, size, stream, block) || new_segment(pool, size, stream, false, reserve, block) ||
      (release_oversize(pool, size, stream, release) && new_segment(pool, size, stream, false, reserve, block)) ||
      ((release_segments_locked(release), true) && new_segment(pool, size, stream, true, reserve, block));
  if (!found) {
    stats_.num_ooms += 1;
    if (observe) (*observe)(TraceAction::oom, 0, size, stream);
    observe_ = nullptr;
    return nullptr;
  }
  const bool already_split = block->is_split();
  const size_t remaining_bytes = block->size - size;
  const bool split = pool.is_small ? remaining_bytes >= cfg::kMinBlockSize
                                   : size < max_split_size() && remaining_bytes > cfg::kSmallSize;
  if (split) {
    auto* rest = block;
    block = new CachedBlock{stream, size, 0, rest->address, &pool};
    block->prev = rest->prev;
    if (block->prev) block->prev->next = block;
    block->next = rest;
    rest->prev = block;
    rest->address += size;
    rest->size -= size;
    pool.blocks.insert(rest);
    if (already_split) {
      update(stats_.inactive_split_bytes, pool.is_small, -static_cast<int64_t>(block->size));
    } else {
      update(stats_.inactive_split_bytes, pool.is_small, static_cast<int64_t>(rest->size));
      update(stats_.inactive_split, pool.is_small, 1);
    }
  } else if (already_split) {
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
  observe_ = nullptr;
  return block;
}

size_t DeviceCache::merge(CachedBlock* dst, CachedBlock* src) {
  if (!src || src->allocated) return 0;
  if (dst->prev == src) {
    dst->address = src->address;
    dst->prev = src->prev;
    if (dst->prev) dst->prev->next = dst;
  } else {
    dst->next = src->next;
    if (dst->next) dst->next->prev = dst;
  }
  const size_t subsumed = src->size;
  dst->size += subsumed;
  dst->pool->blocks.erase(src);
  delete src;
  return subsumed;
}

void DeviceCache::free(CachedBlock* block, const Observer* observe) {
  std::lock_guard<std::mutex> lock(mu_);
  if (observe) {  // work is synchronous: the free completes as it is requested
    (*observe)(TraceAction::free_requested, block->address, block->requested, block->stream);
    (*observe)(TraceAction::free_completed, block->address, block->requested, block->stream);
  }
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
  block->pool->blocks.insert(block);
  if (block->is_split()) split_blocks += 1, split_bytes += static_cast<int64_t>(block->size);
  update(stats_.inactive_split, small, split_blocks);
  update(stats_.inactive_split_bytes, small, split_bytes);
  update(stats_.active, small, -1);
  update(stats_.active_bytes, small, -size);
  update(stats_.requested_bytes, small, -requested);
}

void DeviceCache::release_cached(const Release& release, const Observer* observe) {
  std::lock_guard<std::mutex> lock(mu_);
  observe_ = observe;
  release_segments_locked(release);
  observe_ = nullptr;
}

c10::CachingDeviceAllocator::DeviceStats DeviceCache::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  c10::CachingDeviceAllocator::DeviceStats copy = stats_;
  copy.max_split_size = static_cast<int64_t>(max_split_size());
  return copy;
}

void DeviceCache::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  for (StatArray* array : {&stats_.allocation, &stats_.segment, &stats_.active, &stats_.inactive_split,
                           &stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes,
                           &stats_.inactive_split_bytes, &stats_.requested_bytes}) {
    for (Stat& stat : *array) stat.peak = stat.current;
  }
  stats_.oversize_allocations.peak = stats_.oversize_allocations.current;
  stats_.oversize_segments.peak = stats_.oversize_segments.current;
}

void DeviceCache::reset_accumulated() {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_total_;
}

int64_t DeviceCache::allocated() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.allocated_bytes[0].current;
}

std::vector<SegmentView> DeviceCache::segments() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SegmentView> out;
  std::vector<const CachedBlock*> heads;
  auto add_heads = [&heads](const auto& blocks) {
    for (const CachedBlock* b : blocks) {
      if (!b->prev) heads.push_back(b);
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
    SegmentView view{head->address, 0, head->stream, head->pool->is_small, head->pool->owner, {}};
    for (const CachedBlock* b = head; b; b = b->next) {
      view.total_size += b->size;
      view.blocks.push_back({b->address, b->size, b->requested, b->allocated});
    }
    out.push_back(std::move(view));
  }
  std::sort(out.begin(), out.end(), [](const SegmentView& a, const SegmentView& b) { return a.address < b.address; });
  return out;
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
