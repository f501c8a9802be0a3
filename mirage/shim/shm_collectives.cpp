// Same-host shared-memory collectives for emulated NCCL: all_reduce, all_gather (into one
// tensor), reduce_scatter (from one tensor) and broadcast.
//
// Every emulated GPU of a session lives on this host, so these need no sockets: the ranks of a
// process group map one /dev/shm segment with a slot per rank, copy their part in, and read what
// they need out, with a futex barrier in the segment ordering the steps. Gloo over TCP loopback
// pushes every byte through the kernel on every hop; here a byte is copied in and copied out.
// all_reduce splits the reduction between the ranks (reduce-scatter, then every rank copies the
// whole result back: the split NCCL's ring makes, with memory instead of links).
//
// Tensors go through in chunks that alternate between two buffers, so a rank may fill the next
// chunk while a slow peer still reads the previous one: one barrier per chunk (two for a large
// all_reduce chunk). Each element is reduced in rank order by one expression, so every rank gets
// the same bits. At the first barrier of a call every rank sees every peer's call (collective,
// size, dtype, op or root), so a desync fails on all ranks, naming each call.
//
// The segment of a group is set up once, over the group's gloo backend: rank 0 creates it under
// a random name and broadcasts the name, the others map it, an all-reduce of "mapped" agrees on
// using it (else the whole group stays on gloo), and rank 0 unlinks the name, so nothing is left
// in /dev/shm whatever happens to the ranks afterwards.

#include "shm_collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ATen/Dispatch.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <type_traits>
#include <unordered_map>

namespace mirage::shm {
namespace {

using Clock = std::chrono::steady_clock;

// Per rank and buffer. Small enough that a chunk's slots (N x this) stay in cache from the
// copy-in to the reduction to the copy-out; measured best overall for 2-8 ranks on 2 cores
// (docs/benchmarks.md). A group's segment is 2 x N x this: 8 MiB for 32 ranks.
constexpr size_t kSlotBytes = size_t{128} << 10;
constexpr size_t kSmallChunkBytes = size_t{64} << 10;  // below this every rank reduces it all
constexpr size_t kPage = 4096;

bool supported(at::ScalarType dtype, c10d::ReduceOp::RedOpType op) {
  using Op = c10d::ReduceOp::RedOpType;
  bool integral = at::isIntegralType(dtype, /*includeBool=*/false);
  switch (op) {
    case Op::SUM:
    case Op::PRODUCT:
      return integral || at::isFloatingType(dtype) || at::isComplexType(dtype);
    case Op::MIN:
    case Op::MAX:
      return integral || at::isFloatingType(dtype);
    case Op::BAND:
    case Op::BOR:
    case Op::BXOR:
      return integral;
    default:
      return false;  // AVG / PREMUL_SUM arrive as SUM (emulated in Python); others: gloo decides
  }
}

// acc = acc (op) x, elementwise. Plain loops (vectorised by the compiler), not ATen kernels:
// those would wake intra-op threads, and with more ranks than cores the peers need every core.
template <typename T>
void accumulate(T* __restrict acc, const T* __restrict x, int64_t n, c10d::ReduceOp::RedOpType op) {
  using Op = c10d::ReduceOp::RedOpType;
  switch (op) {
    case Op::SUM:
      for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + x[i];
      return;
    case Op::PRODUCT:
      for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] * x[i];
      return;
    default:
      break;
  }
  if constexpr (!c10::is_complex<T>::value) {
    // NaN wins, as in torch.minimum / torch.maximum (a != a only for NaN).
    switch (op) {
      case Op::MIN:
        for (int64_t i = 0; i < n; ++i) acc[i] = (acc[i] != acc[i] || acc[i] < x[i]) ? acc[i] : x[i];
        return;
      case Op::MAX:
        for (int64_t i = 0; i < n; ++i) acc[i] = (acc[i] != acc[i] || acc[i] > x[i]) ? acc[i] : x[i];
        return;
      default:
        break;
    }
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case Op::BAND:
        for (int64_t i = 0; i < n; ++i) acc[i] &= x[i];
        return;
      case Op::BOR:
        for (int64_t i = 0; i < n; ++i) acc[i] |= x[i];
        return;
      case Op::BXOR:
        for (int64_t i = 0; i < n; ++i) acc[i] ^= x[i];
        return;
      default:
        break;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "reduce op not supported by the shared-memory path");
}

void accumulate(at::ScalarType dtype, char* acc, const char* x, int64_t n, c10d::ReduceOp::RedOpType op) {
  AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND2(at::kHalf, at::kBFloat16, dtype, "mirage_shm_reduce", [&] {
    accumulate(reinterpret_cast<scalar_t*>(acc), reinterpret_cast<const scalar_t*>(x), n, op);
  });
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

long futex(uint32_t* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

// Where a collective must be done by, and how to name it if it is not (or if it waits long).
struct Timing {
  Clock::time_point deadline;
  std::chrono::milliseconds timeout;
  const std::string& what;
  const std::string& group;  // the process group's name
  uint64_t call;             // this call's number in the group: the same on every rank
};

enum class Kind : int32_t { kAllReduce, kAllGather, kReduceScatter, kBroadcast };

// What a rank asked for: checked against every peer at the first barrier of each call.
struct Call {
  Kind kind;
  int32_t dtype;
  int32_t op_or_root;  // the reduce op, or broadcast's root
  int32_t padding = 0;  // numel stays 8-byte aligned in shared memory
  int64_t numel;  // per rank: all_gather's input, reduce_scatter's output
  bool operator==(const Call&) const = default;
};

class Segment;

// A barrier that is sleeping, for the runtime's hang watch (waits_json): DDP's reducer issues
// collectives from C++, where the flight recorder's Python wrappers never see them.
struct Wait {
  const Segment* segment;
  const Timing* timing;
  Call call;
  uint64_t barrier;  // the waiter's barrier count, to tell who has not reached it
  Clock::time_point since;
};
std::mutex g_waits_mu;
std::unordered_map<std::thread::id, Wait>& waits() {
  static auto* map = new std::unordered_map<std::thread::id, Wait>();
  return *map;
}

// Shared layout: [arrived | generation | entered[size] | calls[2][size] | buffer 0 slots |
// buffer 1 slots]. `entered[r]` counts the barriers rank r has entered, so a timeout can name
// who is missing; calls[b][r] is rank r's current call, per buffer like the slots.
class Segment {
 public:
  Segment(void* base, size_t bytes, int rank, int size)
      : base_(static_cast<char*>(base)), bytes_(bytes), rank_(rank), size_(size), spin_(size <= online_cpus()) {}
  ~Segment() { munmap(base_, bytes_); }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  static size_t bytes_for(int size) { return data_offset(size) + 2 * static_cast<size_t>(size) * kSlotBytes; }

  void all_reduce(char* data, int64_t numel, at::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                  const Timing& timing) {
    const Call asked{Kind::kAllReduce, static_cast<int32_t>(dtype), static_cast<int32_t>(op), 0, numel};
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t chunk = static_cast<int64_t>(kSlotBytes) / item;
    for (int64_t offset = 0; offset < numel; offset += chunk) {
      const int64_t n = std::min(chunk, numel - offset);
      char* mine = data + offset * item;
      const int buffer = next_buffer();
      std::memcpy(slot(buffer, rank_), mine, static_cast<size_t>(n * item));
      exchange(buffer, asked, offset == 0, timing);
      if (static_cast<size_t>(n * item) <= kSmallChunkBytes) {  // every rank reduces it all
        std::memcpy(mine, slot(buffer, 0), static_cast<size_t>(n * item));
        for (int r = 1; r < size_; ++r) accumulate(dtype, mine, slot(buffer, r), n, op);
        continue;
      }
      const int64_t lo = n * rank_ / size_, hi = n * (rank_ + 1) / size_;
      for (int r = 1; r < size_ && hi > lo; ++r) {
        accumulate(dtype, slot(buffer, 0) + lo * item, slot(buffer, r) + lo * item, hi - lo, op);
      }
      barrier(timing);
      std::memcpy(mine, slot(buffer, 0), static_cast<size_t>(n * item));
    }
  }

  // out[r * numel ...] = rank r's `in` (numel elements each).
  void all_gather(char* out, const char* in, int64_t numel, at::ScalarType dtype, const Timing& timing) {
    const Call asked{Kind::kAllGather, static_cast<int32_t>(dtype), 0, 0, numel};
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t chunk = static_cast<int64_t>(kSlotBytes) / item;
    for (int64_t offset = 0; offset < numel; offset += chunk) {
      const int64_t n = std::min(chunk, numel - offset);
      const int buffer = next_buffer();
      std::memcpy(slot(buffer, rank_), in + offset * item, static_cast<size_t>(n * item));
      exchange(buffer, asked, offset == 0, timing);
      for (int r = 0; r < size_; ++r) {
        std::memcpy(out + (r * numel + offset) * item, slot(buffer, r), static_cast<size_t>(n * item));
      }
    }
  }

  // out = the reduction over ranks of their `in[rank * numel ...]` (numel elements).
  void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype, c10d::ReduceOp::RedOpType op,
                      const Timing& timing) {
    const Call asked{Kind::kReduceScatter, static_cast<int32_t>(dtype), static_cast<int32_t>(op), 0, numel};
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kSlotBytes) / item / size_);
    for (int64_t offset = 0; offset < numel; offset += chunk) {
      const int64_t n = std::min(chunk, numel - offset);
      const int buffer = next_buffer();
      // This rank's slot holds, for every destination rank, its part of the chunk.
      for (int r = 0; r < size_; ++r) {
        std::memcpy(slot(buffer, rank_) + r * n * item, in + (r * numel + offset) * item, static_cast<size_t>(n * item));
      }
      exchange(buffer, asked, offset == 0, timing);
      char* mine = out + offset * item;
      std::memcpy(mine, slot(buffer, 0) + rank_ * n * item, static_cast<size_t>(n * item));
      for (int r = 1; r < size_; ++r) accumulate(dtype, mine, slot(buffer, r) + rank_ * n * item, n, op);
    }
  }

  void broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) {
    const Call asked{Kind::kBroadcast, static_cast<int32_t>(dtype), root, 0, numel};
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t chunk = static_cast<int64_t>(kSlotBytes) / item;
    for (int64_t offset = 0; offset < numel; offset += chunk) {
      const int64_t n = std::min(chunk, numel - offset);
      const int buffer = next_buffer();
      if (rank_ == root) std::memcpy(slot(buffer, root), data + offset * item, static_cast<size_t>(n * item));
      exchange(buffer, asked, offset == 0, timing);
      if (rank_ != root) std::memcpy(data + offset * item, slot(buffer, root), static_cast<size_t>(n * item));
    }
  }

  static const char* kind_name(Kind kind) {
    static const char* const kNames[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};
    return kNames[static_cast<int>(kind) & 3];
  }

  // Group ranks that have not yet entered the barrier numbered `barrier`.
  std::vector<int> missing_ranks(uint64_t barrier) const {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (std::atomic_ref<uint64_t>(*entered(r)).load(std::memory_order_relaxed) < barrier) missing.push_back(r);
    }
    return missing;
  }

  // Refuses a group whose transport failed before (a timeout or a desync), as NCCL does.
  void check_usable(const std::string& what) const {
    TORCH_CHECK_WITH(DistBackendError, !unusable_, what, ": an earlier collective of this group failed (a "
                     "timeout or a desync); the group cannot be used again, as with NCCL");
  }

 private:
  static size_t calls_offset(int size) { return 128 + 8 * static_cast<size_t>(size); }
  static size_t data_offset(int size) {
    return (calls_offset(size) + 2 * sizeof(Call) * static_cast<size_t>(size) + kPage - 1) / kPage * kPage;
  }
  static int online_cpus() {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  }

  uint32_t* arrived() const { return reinterpret_cast<uint32_t*>(base_); }
  uint32_t* generation() const { return reinterpret_cast<uint32_t*>(base_ + 64); }
  uint64_t* entered(int r) const { return reinterpret_cast<uint64_t*>(base_ + 128) + r; }
  Call* call(int buffer, int r) const {
    return reinterpret_cast<Call*>(base_ + calls_offset(size_)) + static_cast<size_t>(buffer) * size_ + r;
  }
  char* slot(int buffer, int r) const {
    return base_ + data_offset(size_) + (static_cast<size_t>(buffer) * size_ + r) * kSlotBytes;
  }

  // A central barrier with a generation word to sleep on. Ranks that fit the CPUs spin briefly
  // first; oversubscribed ranks (more ranks than cores, the usual case here) go straight to the
  // futex, since spinning would only take the core from the peer being waited for.
  void barrier(const Timing& timing) {
    std::atomic_ref<uint32_t> gen(*generation());
    std::atomic_ref<uint32_t> count(*arrived());
    const uint32_t seen = gen.load(std::memory_order_acquire);
    std::atomic_ref<uint64_t>(*entered(rank_)).store(++barriers_, std::memory_order_relaxed);
    if (count.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size_)) {
      count.store(0, std::memory_order_relaxed);
      gen.store(seen + 1, std::memory_order_release);
      futex(generation(), FUTEX_WAKE, INT_MAX, nullptr);
      return;
    }
    for (int i = 0; spin_ && i < 20000; ++i) {
      if (gen.load(std::memory_order_acquire) != seen) return;
      cpu_relax();
    }
    struct Registered {  // this thread's entry in waits() while it sleeps here
      explicit Registered(const Wait& wait) {
        std::lock_guard<std::mutex> g(g_waits_mu);
        waits()[std::this_thread::get_id()] = wait;
      }
      ~Registered() {
        std::lock_guard<std::mutex> g(g_waits_mu);
        waits().erase(std::this_thread::get_id());
      }
    } registered(Wait{this, &timing, current_, barriers_, Clock::now()});
    while (gen.load(std::memory_order_acquire) == seen) {
      auto left = timing.deadline - Clock::now();
      if (left <= Clock::duration::zero()) fail_timeout(timing);
      auto wait = std::min<Clock::duration>(left, std::chrono::milliseconds(200));
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count();
      timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      futex(generation(), FUTEX_WAIT, seen, &ts);
    }
  }

  int next_buffer() { return static_cast<int>(chunks_++ & 1); }

  // The barrier after a chunk's copy-in; on a call's first chunk, also the comparison of calls.
  void exchange(int buffer, const Call& asked, bool first_chunk, const Timing& timing) {
    if (first_chunk) *call(buffer, rank_) = current_ = asked;
    barrier(timing);
    if (first_chunk) check_calls_match(buffer, asked, timing.what);
  }

  // NCCL would silently mix a desync's data (or hang); gloo fails on the size. Here every rank
  // sees every peer's call at the first barrier, so all of them stop with the same report.
  void check_calls_match(int buffer, const Call& asked, const std::string& what) {
    bool all_match = true;
    for (int r = 0; r < size_ && all_match; ++r) all_match = *call(buffer, r) == asked;
    if (all_match) return;
    std::ostringstream calls;
    for (int r = 0; r < size_; ++r) calls << "\n  group rank " << r << ": " << describe(*call(buffer, r));
    unusable_ = true;
    TORCH_CHECK_WITH(DistBackendError, false, what, ": the ranks' calls do not match (a desync: "
                     "NCCL would mix or hang here):", calls.str());
  }

  static std::string describe(const Call& c) {
    std::ostringstream text;
    text << kind_name(c.kind) << " of " << c.numel << " x "
         << c10::toString(static_cast<at::ScalarType>(c.dtype));
    if (c.kind == Kind::kBroadcast) {
      text << ", root " << c.op_or_root;
    } else if (c.kind != Kind::kAllGather) {
      text << ", op " << reduce_op_name(c.op_or_root);
    }
    return text.str();
  }

  static const char* reduce_op_name(int32_t op) {
    using Op = c10d::ReduceOp::RedOpType;
    switch (static_cast<Op>(op)) {
      case Op::SUM: return "SUM";
      case Op::PRODUCT: return "PRODUCT";
      case Op::MIN: return "MIN";
      case Op::MAX: return "MAX";
      case Op::BAND: return "BAND";
      case Op::BOR: return "BOR";
      case Op::BXOR: return "BXOR";
      default: return "?";
    }
  }

  [[noreturn]] void fail_timeout(const Timing& timing) {
    std::ostringstream missing;
    const char* sep = "";
    for (int r : missing_ranks(barriers_)) {
      missing << sep << r;
      sep = ", ";
    }
    unusable_ = true;
    TORCH_CHECK_WITH(DistBackendError, false, timing.what, " timed out after ", timing.timeout.count(),
                     " ms: group rank(s) ", missing.str(),
                     " never reached it (a rank that hung, died, or called a different collective). "
                     "Raise `timeout=` in init_process_group/new_group if they are just slow.");
  }

  char* base_;
  size_t bytes_;
  int rank_, size_;
  bool spin_;
  uint64_t chunks_ = 0, barriers_ = 0;
  Call current_{};  // the call in progress
  bool unusable_ = false;
};

// Rank 0's side of set-up: a fresh segment under a random name, sized and backed by pages
// now (fallocate), so that a full /dev/shm is a refusal here rather than a SIGBUS later.
std::string create_segment(int size) {
  const char* session = std::getenv("MIRAGE_SESSION");
  if (!session || !*session) return "";
  // Named after the session's table (mirage/daemon/shared_table.py), so that the run's teardown
  // and `mirage cleanup` find a segment a rank left behind by dying during set-up.
  std::random_device random;
  std::string name = "/mirage-" + std::to_string(getuid()) + "-" + session + ".collectives-" +
                     std::to_string((uint64_t{random()} << 32) | random());
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return "";
  bool ok = posix_fallocate(fd, 0, static_cast<off_t>(Segment::bytes_for(size))) == 0;
  close(fd);
  if (!ok) {
    shm_unlink(name.c_str());
    return "";
  }
  return name;
}

std::unique_ptr<Segment> map_segment(const std::string& name, int rank, int size) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return nullptr;
  size_t bytes = Segment::bytes_for(size);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  return std::make_unique<Segment>(base, bytes, rank, size);
}

// Done once per group, collectively, over its gloo backend (see the file comment). Returns null
// when the group is to stay on gloo: NCCL_SHM_DISABLE=1 (as NCCL then uses the network), no
// session, /dev/shm too small, or any rank unable to map the segment.
std::unique_ptr<Segment> set_up(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  const char* disabled = std::getenv("NCCL_SHM_DISABLE");
  if (disabled && std::strcmp(disabled, "0") != 0 && *disabled) return nullptr;
  auto gloo = pg->getBackend(c10::DeviceType::CPU);
  const int rank = pg->getRank(), size = pg->getSize();
  std::string name = rank == 0 ? create_segment(size) : "";
  // The name travels as bytes in a fixed-size tensor; an empty name means "no segment".
  at::Tensor wire = at::zeros({256}, at::kByte);
  std::memcpy(wire.data_ptr(), name.data(), std::min<size_t>(name.size(), 255));
  std::vector<at::Tensor> broadcast{wire};
  gloo->broadcast(broadcast)->wait();
  name = reinterpret_cast<const char*>(wire.data_ptr());
  if (name.empty()) return nullptr;
  std::unique_ptr<Segment> segment = map_segment(name, rank, size);
  std::vector<at::Tensor> mapped{at::full({1}, segment ? 1 : 0, at::kInt)};
  c10d::AllreduceOptions all_mapped;
  all_mapped.reduceOp = c10d::ReduceOp::MIN;
  gloo->allreduce(mapped, all_mapped)->wait();
  if (rank == 0) shm_unlink(name.c_str());
  if (mapped[0].item<int>() == 0) return nullptr;
  return segment;
}

struct GroupState {
  std::string group_name;
  uint64_t calls = 0;  // collectives on the segment so far
  std::mutex mu;  // one collective at a time per group and process
  std::unique_ptr<Segment> segment;  // null: the group uses gloo
};
std::mutex g_groups_mu;
// Keyed by the ProcessGroup's address; mirage::forget_process_group drops an entry when Python
// destroys the group (a reference here would delay the group's teardown, see distributed.py).
std::unordered_map<const void*, std::shared_ptr<GroupState>>& groups() {
  static auto* map = new std::unordered_map<const void*, std::shared_ptr<GroupState>>();
  return *map;
}

// Runs `collective` on the group's segment, setting the segment up on the group's first call.
// False, having done nothing, when the group stays on gloo.
template <typename Fn>
bool on_segment(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, std::chrono::milliseconds timeout,
                const std::string& what, Fn&& collective) {
  if (pg->getSize() < 2) return false;
  std::shared_ptr<GroupState> state;
  bool fresh = false;
  {
    std::lock_guard<std::mutex> g(g_groups_mu);
    auto& slot = groups()[pg.get()];
    if (!slot) {
      slot = std::make_shared<GroupState>();
      slot->group_name = pg->getGroupName();
      fresh = true;
    }
    state = slot;
  }
  std::lock_guard<std::mutex> g(state->mu);
  if (fresh) state->segment = set_up(pg);
  if (!state->segment) return false;
  state->segment->check_usable(what);
  // A timedelta.max timeout would overflow the clock: a year is forever enough.
  timeout = std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365));
  collective(*state->segment, Timing{Clock::now() + timeout, timeout, what, state->group_name, state->calls++});
  return true;
}

}  // namespace

bool all_reduce(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* data, int64_t numel, at::ScalarType dtype,
                c10d::ReduceOp::RedOpType op, std::chrono::milliseconds timeout, const std::string& what) {
  if (numel == 0 || !supported(dtype, op)) return false;
  return on_segment(pg, timeout, what, [&](Segment& segment, const Timing& timing) {
    segment.all_reduce(static_cast<char*>(data), numel, dtype, op, timing);
  });
}

bool all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* out, const void* in, int64_t numel,
                at::ScalarType dtype, std::chrono::milliseconds timeout, const std::string& what) {
  if (numel == 0) return false;
  return on_segment(pg, timeout, what, [&](Segment& segment, const Timing& timing) {
    segment.all_gather(static_cast<char*>(out), static_cast<const char*>(in), numel, dtype, timing);
  });
}

bool reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* out, const void* in, int64_t numel,
                    at::ScalarType dtype, c10d::ReduceOp::RedOpType op, std::chrono::milliseconds timeout,
                    const std::string& what) {
  if (numel == 0 || !supported(dtype, op) ||
      static_cast<size_t>(pg->getSize()) * c10::elementSize(dtype) > kSlotBytes) {
    return false;
  }
  return on_segment(pg, timeout, what, [&](Segment& segment, const Timing& timing) {
    segment.reduce_scatter(static_cast<char*>(out), static_cast<const char*>(in), numel, dtype, op, timing);
  });
}

bool broadcast(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, void* data, int64_t numel, at::ScalarType dtype,
               int root, std::chrono::milliseconds timeout, const std::string& what) {
  if (numel == 0) return false;
  return on_segment(pg, timeout, what, [&](Segment& segment, const Timing& timing) {
    segment.broadcast(static_cast<char*>(data), numel, dtype, root, timing);
  });
}

std::string waits_json() {
  std::lock_guard<std::mutex> g(g_waits_mu);
  std::ostringstream json;
  json << "[";
  const char* sep = "";
  for (const auto& [thread, wait] : waits()) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - wait.since).count();
    json << sep << "{\"group\": \"" << wait.timing->group << "\", \"seq\": " << wait.timing->call
         << ", \"name\": \"" << Segment::kind_name(wait.call.kind) << "\", \"dtype\": \""
         << c10::toString(static_cast<at::ScalarType>(wait.call.dtype)) << "\", \"numel\": " << wait.call.numel
         << ", \"waited_ms\": " << waited << ", \"missing\": [";
    const char* comma = "";
    for (int r : wait.segment->missing_ranks(wait.barrier)) {
      json << comma << r;
      comma = ", ";
    }
    json << "]}";
    sep = ", ";
  }
  json << "]";
  return json.str();
}

void forget_process_group(const std::string& group_name) {
  std::lock_guard<std::mutex> g(g_groups_mu);
  std::erase_if(groups(), [&](const auto& entry) { return entry.second->group_name == group_name; });
}

}  // namespace mirage::shm
