// The arena of device memory peers can map (see shared_device_memory.h).

#include "shared_device_memory.h"

#include "config.h"
#include "cpu_allocator.h"

#include <c10/core/impl/alloc_cpu.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <unordered_map>
#include <utility>

namespace mirage {
namespace {

constexpr size_t kGranule = size_t{64} << 10;  // allocation unit; the first one holds the id
constexpr size_t kMaxCapacity = size_t{1} << 40;
// --lazy-device-memory: the address space of every device of a node (8 x 192 GB and more), which
// costs nothing until written, so the emulated GPUs may hold more than the host has.
constexpr size_t kLazyCapacity = size_t{1} << 42;
// A freed block this large gives its pages back to the host at once (as glibc unmaps its large
// chunks); smaller ones keep them for the next block placed there, so a training loop's
// recurring allocations do not fault their pages in again (nor on the peers that map them).
constexpr size_t kReturnPagesBytes = size_t{32} << 20;

// One memfd, mapped whole, carved best-fit. Only the address space is reserved up front: the
// file is sparse, and its pages are host memory only once touched (read or written: a read of
// shared memory allocates the page too).
//
// --lazy-device-memory makes it private anonymous memory instead: a page never written reads as
// zeros (the kernel's zero page) and costs nothing even when read, as a predicted run's kernels
// and collectives read results never computed; and every freed block's pages go back at once, so
// the host holds what is live and written. The price: peers cannot map it (the emulated NCCL then
// stages every message through shared memory), and a recurring block faults its pages in anew.
class Arena {
 public:
  // The process's arena, or null where memfd or the mapping is refused (then the heap serves).
  // A forked child inherits its parent's arena, mapped shared: it must neither carve it (its
  // blocks would be the parent's) nor free in it (a punched hole would zero the parent's
  // tensors), so there it is null too, as CUDA is unusable in a child forked after it started.
  static Arena* get() {
    Arena* arena = instance();
    return arena && arena->owned_here() ? arena : nullptr;
  }

  // The arena this process created or inherited, or null.
  static Arena* instance() {
    static Arena* arena = create();
    return arena;
  }

  bool owned_here() const { return owner_ == getpid(); }

  bool owns(const void* p) const {
    const char* c = static_cast<const char*>(p);
    return c >= base_ && c < base_ + capacity_;
  }

  void* allocate(size_t bytes) {
    const size_t len = (bytes + kGranule - 1) / kGranule * kGranule;
    std::lock_guard<std::mutex> guard(mu_);
    size_t offset;
    auto fit = free_by_size_.lower_bound({len, 0});
    if (fit != free_by_size_.end()) {
      const auto [have, at] = *fit;
      free_by_size_.erase(fit);
      free_by_offset_.erase(at);
      if (have > len) insert_free(at + len, have - len);
      offset = at;
    } else {
      if (end_ + len > capacity_) return nullptr;
      offset = end_;
      end_ += len;
    }
    live_[offset] = len;
    return base_ + offset;
  }

  void free(void* p) {
    size_t offset = static_cast<size_t>(static_cast<char*>(p) - base_);
    std::lock_guard<std::mutex> guard(mu_);
    auto it = live_.find(offset);
    if (it == live_.end()) return;
    size_t len = it->second;
    live_.erase(it);
    if (!shared_) {
      madvise(base_ + offset, len, MADV_DONTNEED);  // private: the range reads as zeros again
    } else if (len >= kReturnPagesBytes) {
      fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset), static_cast<off_t>(len));
    }
    // Merge with free neighbours; a range that reaches the end moves the end back.
    auto next = free_by_offset_.find(offset + len);
    if (next != free_by_offset_.end()) {
      len += next->second;
      erase_free(next);
    }
    auto prev = free_by_offset_.lower_bound(offset);
    if (prev != free_by_offset_.begin()) {
      --prev;
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        len += prev->second;
        erase_free(prev);
      }
    }
    if (offset + len == end_) {
      end_ = offset;
    } else {
      insert_free(offset, len);
    }
  }

  // What peers map; nothing (all zero) for a private arena.
  MirageSharedArena describe() const {
    if (!shared_) return MirageSharedArena{};
    return {static_cast<int64_t>(owner_), fd_, 0, id_, reinterpret_cast<uint64_t>(base_), capacity_};
  }

 private:
  Arena(int fd, char* base, size_t capacity, uint64_t id)
      : owner_(getpid()), shared_(fd >= 0), fd_(fd), base_(base), capacity_(capacity), id_(id) {}

  static Arena* create() { return config().lazy_memory ? create_private() : create_shared(); }

  // --lazy-device-memory's arena: address space only (MAP_NORESERVE: no commit charge either).
  static Arena* create_private() {
    void* base = mmap(nullptr, kLazyCapacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (base == MAP_FAILED) return nullptr;
    return new Arena(-1, static_cast<char*>(base), kLazyCapacity, 0);  // lives as long as the process
  }

  static Arena* create_shared() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return nullptr;
    // Twice the host's memory: more could never be backed, and every peer maps it too.
    size_t capacity = std::min(kMaxCapacity, 2 * static_cast<size_t>(pages) * static_cast<size_t>(page));
    capacity = capacity / kGranule * kGranule;
    // CLOEXEC: a program the workload execs does not inherit device memory (nor does it on a GPU).
    const int fd = memfd_create("mirage-device-memory", MFD_CLOEXEC);
    if (fd < 0) return nullptr;
    if (ftruncate(fd, static_cast<off_t>(capacity)) != 0) {
      close(fd);
      return nullptr;
    }
    void* base = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (base == MAP_FAILED) {
      close(fd);
      return nullptr;
    }
    std::random_device random;
    const uint64_t id = (uint64_t{random()} << 32) | random();
    *static_cast<uint64_t*>(base) = id;
    return new Arena(fd, static_cast<char*>(base), capacity, id);  // lives as long as the process
  }

  void insert_free(size_t offset, size_t len) {
    free_by_offset_[offset] = len;
    free_by_size_.insert({len, offset});
  }
  void erase_free(std::map<size_t, size_t>::iterator it) {
    free_by_size_.erase({it->second, it->first});
    free_by_offset_.erase(it);
  }

  const pid_t owner_;
  const bool shared_;  // a memfd peers map; else private anonymous memory (--lazy-device-memory)
  const int fd_;
  char* const base_;
  const size_t capacity_;
  const uint64_t id_;
  std::mutex mu_;
  size_t end_ = kGranule;                            // everything from here on is free
  std::map<size_t, size_t> free_by_offset_;          // free ranges below end_: offset -> length
  std::set<std::pair<size_t, size_t>> free_by_size_;  // the same, as (length, offset), for best fit
  std::unordered_map<size_t, size_t> live_;          // allocated: offset -> length
};

}  // namespace

void* allocate_device_bytes(size_t bytes) {
  if (bytes >= kShareableMinBytes) {
    if (Arena* arena = Arena::get()) {
      if (void* p = arena->allocate(bytes)) return p;
    }
  }
  return host_bytes_take(bytes);
}

void free_device_bytes(void* p) {
  Arena* arena = Arena::instance();
  if (!arena || !arena->owns(p)) {  // a pointer comparison: small blocks pay nothing more
    host_bytes_give(p);
  } else if (arena->owned_here()) {
    arena->free(p);
  }  // else: the parent's memory, which a forked child leaves alone
}

}  // namespace mirage

extern "C" MirageSharedArena mirage_shared_arena() {
  mirage::Arena* arena = mirage::Arena::get();
  return arena ? arena->describe() : MirageSharedArena{};
}
