// Same-host shared-memory transport of the emulated NCCL backend.
//
// Collectives use the group's segment: each rank copies its part into its slot, a futex barrier,
// each rank reads what it needs. Gloo over TCP loopback pushes every byte through the kernel on
// every hop; here a byte is copied in and copied out. all_reduce splits the reduction between the
// ranks (reduce-scatter, then every rank copies the whole result back: the split NCCL's ring
// makes, with memory instead of links). Tensors go through in chunks that alternate between two
// buffers, so a rank may fill the next chunk while a slow peer still reads the previous one: one
// barrier per chunk (two for a large all_reduce chunk). Each element is reduced in rank order by
// one expression, so every rank gets the same bits. At the first barrier of a call every rank
// sees every peer's call (collective, size, dtype, op or root), so a desync fails on all ranks,
// naming each call.
//
// Point-to-point traffic (send/recv, and the collectives NCCL itself builds from it: gather,
// scatter, all_to_all, uneven all_gather) goes through one single-producer ring per ordered pair
// of ranks and channel, a segment created on first use under a name both ranks can derive. Each
// message carries its length, so a receive that matches a send of another size fails on both
// sides rather than mixing messages. A rank blocked on its rings sleeps on its own doorbell word
// in the group segment, which peers ring whenever they fill or drain one of its rings.
//
// Large tensors skip the staging (NCCL's P2P transport, which NCCL_P2P_DISABLE=1 turns off): a
// device tensor from 1 MiB lives in its process's shared arena (the shim's
// shared_device_memory.h), which every peer maps at connect. A message's receiver copies it once,
// straight from the sender's tensor, and the sender's work ends when the receiver says it has
// the bytes; a broadcast root's tensor is read by every rank at once, the root writing a share of
// each copy itself; all_reduce and reduce have each rank reduce its part straight from every
// rank's tensor; gather, scatter and all_to_all list their pieces in one table per call. Tensors
// outside the arena (smaller blocks, results of host kernels) take the staged path, which every
// rank can tell from what the others announce.
//
// Names: /mirage-<uid>-<session>.collectives-<id>[.p2p-...], so the run's teardown and `mirage
// cleanup` find segments a rank left behind by dying before every peer mapped them.

#include "transport.h"

#include "../shim/shared_device_memory.h"

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>
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
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <type_traits>

namespace mirage::nccl {

namespace {

// Per rank and buffer. Small enough that a chunk's slots (N x this) stay in cache from the
// copy-in to the reduction to the copy-out; measured best overall for 2-8 ranks on 2 cores
// (docs/benchmarks.md). A group's segment is 2 x N x this: 8 MiB for 32 ranks.
constexpr size_t kSlotBytes = size_t{128} << 10;
constexpr size_t kSmallChunkBytes = size_t{64} << 10;  // below this every rank reduces it all
constexpr size_t kPage = 4096;
constexpr int kChannels = 2;
// Messages from this size are copied directly when their tensor lies in the shared arena (a
// tensor of kShareableMinBytes or more; all_to_all's pieces of one are smaller): below it the
// ring's two copies cost less than the acknowledgement the direct copy waits for.
constexpr size_t kDirectMinBytes = size_t{256} << 10;
constexpr uint64_t kDirectMessage = uint64_t{1} << 63;  // in a message's header: its bytes stay in the sender
constexpr uint64_t kNotShared = ~uint64_t{0};           // a tensor outside its process's arena

// What a rank tells its peers at connect: its process, its arena, and whether it could map every
// peer's; later, that its communicator is gone (aborted), which fails the peers waiting for it.
struct alignas(64) Peer {
  MirageSharedArena arena;
  uint32_t can_map;
  uint32_t gone;
  int64_t pid;
};

// exchange_pieces' table, per source and destination: where the source's piece lies (an offset
// in its arena, or kNotShared: the rings carry it), its size, and the size the destination expects.
struct PieceAt {
  uint64_t offset;
  uint64_t bytes;
  uint64_t expected;
};

// A peer's arena as mapped in this process, shared by every communicator that reaches the peer
// and unmapped with the last one (a dead peer's memory is freed once nobody maps it).
struct PeerArena {
  PeerArena(char* base, size_t capacity) : base(base), capacity(capacity) {}
  PeerArena(const PeerArena&) = delete;
  PeerArena& operator=(const PeerArena&) = delete;
  ~PeerArena() { munmap(base, capacity); }
  char* const base;
  const size_t capacity;
};

// Maps `arena` (another process's) here; null where its owner's file descriptors are not ours to
// open (another user) or the arena is not what was announced (its owner is gone).
std::shared_ptr<PeerArena> map_peer_arena(const MirageSharedArena& arena) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, uint64_t>, std::weak_ptr<PeerArena>> mapped;
  std::lock_guard<std::mutex> guard(mu);
  auto& cached = mapped[{arena.pid, arena.id}];
  if (auto live = cached.lock()) return live;
  const std::string path = "/proc/" + std::to_string(arena.pid) + "/fd/" + std::to_string(arena.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return nullptr;
  void* base = mmap(nullptr, arena.capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  auto peer = std::make_shared<PeerArena>(static_cast<char*>(base), arena.capacity);
  if (*static_cast<const uint64_t*>(base) != arena.id) return nullptr;
  cached = peer;
  return peer;
}

// The calling process's arena, from the shim (loaded with RTLD_GLOBAL); none without the shim.
MirageSharedArena own_arena() {
  using Describe = MirageSharedArena (*)();
  static const auto describe = reinterpret_cast<Describe>(dlsym(RTLD_DEFAULT, "mirage_shared_arena"));
  return describe ? describe() : MirageSharedArena{};
}

using Op = c10d::ReduceOp::RedOpType;

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

// Sleeps on `word` while it holds `seen`, at most until `deadline` (and 200 ms, so the caller can
// check what it waits for). False once the deadline has passed.
bool sleep_on(uint32_t* word, uint32_t seen, Clock::time_point deadline) {
  auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return false;
  auto wait = std::min<Clock::duration>(left, std::chrono::milliseconds(200));
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  futex(word, FUTEX_WAIT, seen, &ts);
  return true;
}

int online_cpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

std::string session_prefix() {
  const char* session = std::getenv("MIRAGE_SESSION");
  if (!session || !*session) return "";
  return "/mirage-" + std::to_string(getuid()) + "-" + session;
}

// Opens (creating if need be) a segment of `bytes`; both sides of a ring may be first. With
// `reserve`, the pages are allocated now, so a full /dev/shm is a refusal rather than a SIGBUS.
void* map_named(const std::string& name, size_t bytes, bool create, bool reserve) {
  int fd = shm_open(name.c_str(), O_RDWR | (create ? O_CREAT : 0), 0600);
  if (fd < 0) return nullptr;
  bool ok = !create || (reserve ? posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0
                                : ftruncate(fd, static_cast<off_t>(bytes)) == 0);
  void* base = ok ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  return base == MAP_FAILED ? nullptr : base;
}

size_t calls_offset(int size) { return 128 + 8 * static_cast<size_t>(size); }
size_t doorbells_offset(int size) { return calls_offset(size) + 2 * sizeof(Call) * static_cast<size_t>(size); }
size_t peers_offset(int size) { return (doorbells_offset(size) + 64 * static_cast<size_t>(size) + 63) / 64 * 64; }
size_t where_offset(int size) { return peers_offset(size) + sizeof(Peer) * static_cast<size_t>(size); }
size_t pieces_offset(int size) { return where_offset(size) + 2 * 64 * static_cast<size_t>(size); }
size_t data_offset(int size) {
  return (pieces_offset(size) + 2 * sizeof(PieceAt) * static_cast<size_t>(size) * size + kPage - 1) / kPage * kPage;
}
size_t segment_bytes(int size) { return data_offset(size) + 2 * static_cast<size_t>(size) * kSlotBytes; }

}  // namespace


class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(void* base, size_t bytes, int rank, int size, std::string instance);
  ~ShmCommunicator() override;
  const char* transport() const override { return direct_ ? "shared memory, P2P direct copies" : "shared memory"; }
  std::string peer_path(int) const override { return direct_ ? "P2P/direct pointer" : "SHM/direct/direct"; }
  // Decides, with every rank, whether large messages go straight between the ranks' device
  // memory: only if every rank could map every peer's arena (and `allowed`: NCCL_P2P_DISABLE unset).
  void probe_peer_memory(bool allowed, const Timing& timing);

  void all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                  const Timing& timing) override;
  void reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
              const Timing& timing) override;
  void all_gather(const std::vector<char*>& outs, const char* in, int64_t numel, at::ScalarType dtype,
                  const Timing& timing) override;
  void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                      const Timing& timing) override;
  void broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) override;
  void agree(const Call& call, const Timing& timing) override;
  void transfer(std::vector<Transfer>& transfers, int channel, const std::string& what,
                const std::function<void(std::vector<Transfer>&)>& poll,
                const std::function<void(size_t)>& finished) override;
  void interrupt_transfer() override { ring_bell(rank_); }
  void abort() override;
  void exchange_pieces(const Call& asked, const std::vector<Piece>& send, const std::vector<Piece>& recv,
                       const Timing& timing) override;

 private:
  struct Ring;
  uint32_t* arrived() const;
  uint32_t* generation() const;
  uint64_t* entered(int r) const;
  uint32_t* doorbell(int r) const;
  Call* call(int buffer, int r) const;
  Peer* peer(int r) const;
  // A broadcast's, all_reduce's or reduce's tensor, per rank: its offset in that rank's arena,
  // or kNotShared.
  uint64_t* where(int buffer, int r) const;
  // exchange_pieces' entry for the piece rank `src` sends rank `dst`.
  PieceAt* piece(int buffer, int src, int dst) const;
  // Where `data` lies in this process's arena, or kNotShared (also without direct copies).
  uint64_t shared_offset(const void* data) const;
  // The bytes at `offset` in rank r's arena, as mapped here.
  char* peer_bytes(int r, uint64_t offset) const;
  // One step of a message sent by direct copy; how many bytes of it moved (0: none).
  size_t step_direct(Transfer& t, Ring& ring);
  char* slot(int buffer, int r) const;
  int next_buffer() { return static_cast<int>(chunks_++ & 1); }
  void barrier(const Timing& timing);
  // While a call waits: raises ncclRemoteError if one of `waited_for` ended or aborted, or this
  // communicator's own abort if another thread aborted it.
  void check_peers(const std::vector<int>& waited_for, const std::string& what);
  void exchange(int buffer, const Call& asked, bool first_chunk, const Timing& timing);
  void reduce_chunks(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
                     const Call& asked, const Timing& timing);
  // The same, straight from every rank's tensor, all of them in shared device memory (their
  // offsets in where(buffer, r)).
  void reduce_direct(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
                     int buffer, const Timing& timing);
  bool all_shared(int buffer) const;
  void ring_bell(int r);
  Ring& ring(int src, int dst, int channel);

  char* base_;
  size_t bytes_;
  bool spin_;
  bool direct_ = false;  // P2P: large tensors copied straight between arenas (probe_peer_memory)
  MirageSharedArena own_{};
  std::vector<std::shared_ptr<PeerArena>> peer_memory_;  // per rank; null for this one
  uint64_t chunks_ = 0, barriers_ = 0;
  std::vector<std::unique_ptr<Ring>> rings_;  // [channel][src][dst], mapped on first use
};

// One ordered pair's ring: [head (bytes written, by the producer) | tail (bytes read, by the
// consumer) | mapped (how many sides mapped it) | refused (a size mismatch) | acked (direct
// copies done)] then the data. A message is its length, then its bytes; or, for a direct copy,
// its length with kDirectMessage set, then its offset in the producer's arena, which the
// consumer copies from and then acknowledges.
struct ShmCommunicator::Ring {
  Ring(void* base, size_t bytes) : base(static_cast<char*>(base)), capacity(bytes - kPage) {}
  ~Ring() { munmap(base, capacity + kPage); }
  std::atomic_ref<uint64_t> head() const { return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base)); }
  std::atomic_ref<uint64_t> tail() const { return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + 64)); }
  uint32_t* mapped() const { return reinterpret_cast<uint32_t*>(base + 128); }
  // Set by the consumer when a message's length differs from what it expected: the producer
  // then fails too, instead of waiting for room that will never come.
  std::atomic_ref<uint32_t> refused() const { return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(base + 192)); }
  // Direct-copy messages the consumer has copied; the producer's own count is direct_sent.
  std::atomic_ref<uint64_t> acked() const { return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base + 256)); }
  char* data() const { return base + kPage; }

  // Copies up to `n` bytes in (producer) or out (consumer); returns how many moved.
  size_t push(const char* from, size_t n) {
    const uint64_t h = head().load(std::memory_order_relaxed), t = tail().load(std::memory_order_acquire);
    n = std::min<size_t>(n, capacity - static_cast<size_t>(h - t));
    copy_around(h, n, [&](size_t at, size_t off, size_t len) { std::memcpy(data() + at, from + off, len); });
    head().store(h + n, std::memory_order_release);
    return n;
  }
  size_t pop(char* to, size_t n) {
    const uint64_t t = tail().load(std::memory_order_relaxed), h = head().load(std::memory_order_acquire);
    n = std::min<size_t>(n, static_cast<size_t>(h - t));
    copy_around(t, n, [&](size_t at, size_t off, size_t len) { std::memcpy(to + off, data() + at, len); });
    tail().store(t + n, std::memory_order_release);
    return n;
  }
  size_t readable() const {
    return static_cast<size_t>(head().load(std::memory_order_acquire) - tail().load(std::memory_order_relaxed));
  }

  template <typename Fn>
  void copy_around(uint64_t position, size_t n, Fn&& copy) const {
    const size_t at = static_cast<size_t>(position % capacity), first = std::min(n, capacity - at);
    if (first) copy(at, 0, first);
    if (n > first) copy(0, first, n - first);
  }

  char* base;
  size_t capacity;
  uint64_t direct_sent = 0;  // producer side: direct-copy messages announced on this ring
};

ShmCommunicator::ShmCommunicator(void* base, size_t bytes, int rank, int size, std::string instance)
    : Communicator(rank, size, std::move(instance)), base_(static_cast<char*>(base)), bytes_(bytes),
      spin_(size <= online_cpus()), rings_(static_cast<size_t>(kChannels) * size * size) {}

ShmCommunicator::~ShmCommunicator() {
  rings_.clear();
  munmap(base_, bytes_);
}

std::unique_ptr<Communicator> connect_shared_memory(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    bool p2p, std::chrono::milliseconds timeout) {
  const std::string prefix = session_prefix();
  if (prefix.empty()) return nullptr;
  std::string name;
  if (rank == 0) {
    std::random_device random;
    name = prefix + ".collectives-" + std::to_string((uint64_t{random()} << 32) | random());
    void* base = map_named(name, segment_bytes(size), true, true);
    if (!base) {
      shm_unlink(name.c_str());
      name = "-";  // tells the others there is no segment
    } else {
      munmap(base, segment_bytes(size));
    }
    store->set("mirage/segment", std::vector<uint8_t>(name.begin(), name.end()));
  } else {
    std::vector<uint8_t> wire = store->get("mirage/segment");
    name.assign(wire.begin(), wire.end());
  }
  if (name == "-") return nullptr;
  void* base = map_named(name, segment_bytes(size), false, false);
  if (store->add("mirage/mapped", 1) == size) shm_unlink(name.c_str());  // every rank has it now
  TORCH_CHECK_WITH(DistBackendError, base, "emulated NCCL: could not map the communicator's shared memory ", name,
                   " (is /dev/shm full? `df -h /dev/shm`)");
  auto comm = std::make_unique<ShmCommunicator>(base, segment_bytes(size), rank, size, name.substr(name.rfind('-') + 1));
  comm->probe_peer_memory(p2p, Timing{Clock::now() + timeout, timeout, "connecting the communicator"});
  return comm;
}

void ShmCommunicator::probe_peer_memory(bool allowed, const Timing& timing) {
  own_ = allowed ? own_arena() : MirageSharedArena{};
  Peer* me = peer(rank_);
  me->arena = own_;
  me->pid = ::getpid();
  barrier(timing);
  bool can_map = own_.capacity > 0;
  std::vector<std::shared_ptr<PeerArena>> mapped(static_cast<size_t>(size_));
  for (int r = 0; r < size_ && can_map; ++r) {
    if (r == rank_) continue;
    mapped[r] = peer(r)->arena.capacity > 0 ? map_peer_arena(peer(r)->arena) : nullptr;
    can_map = mapped[r] != nullptr;
  }
  me->can_map = can_map;
  barrier(timing);
  bool everyone = true;
  for (int r = 0; r < size_; ++r) everyone = everyone && peer(r)->can_map;
  if (everyone) peer_memory_ = std::move(mapped);
  direct_ = everyone;
}

uint64_t ShmCommunicator::shared_offset(const void* data) const {
  const auto at = reinterpret_cast<uint64_t>(data);
  return direct_ && at >= own_.base && at < own_.base + own_.capacity ? at - own_.base : kNotShared;
}

char* ShmCommunicator::peer_bytes(int r, uint64_t offset) const {
  return (r == rank_ ? reinterpret_cast<char*>(own_.base) : peer_memory_[r]->base) + offset;
}

uint32_t* ShmCommunicator::arrived() const { return reinterpret_cast<uint32_t*>(base_); }
uint32_t* ShmCommunicator::generation() const { return reinterpret_cast<uint32_t*>(base_ + 64); }
uint64_t* ShmCommunicator::entered(int r) const { return reinterpret_cast<uint64_t*>(base_ + 128) + r; }
uint32_t* ShmCommunicator::doorbell(int r) const { return reinterpret_cast<uint32_t*>(base_ + doorbells_offset(size_) + 64 * r); }
Peer* ShmCommunicator::peer(int r) const { return reinterpret_cast<Peer*>(base_ + peers_offset(size_)) + r; }
uint64_t* ShmCommunicator::where(int buffer, int r) const {
  return reinterpret_cast<uint64_t*>(base_ + where_offset(size_) + 64 * (static_cast<size_t>(buffer) * size_ + r));
}
PieceAt* ShmCommunicator::piece(int buffer, int src, int dst) const {
  return reinterpret_cast<PieceAt*>(base_ + pieces_offset(size_)) + (static_cast<size_t>(buffer) * size_ + src) * size_ + dst;
}
Call* ShmCommunicator::call(int buffer, int r) const {
  return reinterpret_cast<Call*>(base_ + calls_offset(size_)) + static_cast<size_t>(buffer) * size_ + r;
}
char* ShmCommunicator::slot(int buffer, int r) const {
  return base_ + data_offset(size_) + (static_cast<size_t>(buffer) * size_ + r) * kSlotBytes;
}

// A central barrier with a generation word to sleep on. Ranks that fit the CPUs spin briefly
// first; oversubscribed ranks (more ranks than cores, the usual case here) go straight to the
// futex, since spinning would only take the core from the peer being waited for.
void ShmCommunicator::barrier(const Timing& timing) {
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
  while (gen.load(std::memory_order_acquire) == seen) {
    const bool in_time = sleep_on(generation(), seen, timing.deadline);
    if (gen.load(std::memory_order_acquire) != seen) break;
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (std::atomic_ref<uint64_t>(*entered(r)).load(std::memory_order_relaxed) < barriers_) missing.push_back(r);
    }
    check_peers(missing, timing.what);
    if (!in_time) fail_timeout(timing, missing, "reached it");
  }
}

void ShmCommunicator::check_peers(const std::vector<int>& waited_for, const std::string& what) {
  check_not_aborted(what);
  for (int r : waited_for) {
    const Peer* p = peer(r);
    const int64_t pid = std::atomic_ref<const int64_t>(p->pid).load(std::memory_order_acquire);
    const uint32_t gone = std::atomic_ref<const uint32_t>(p->gone).load(std::memory_order_acquire);
    const std::string who = "proxy: connection closed by group rank " + std::to_string(r) + " (pid " +
                            std::to_string(pid) + "): ";
    if (gone) fail_remote(who + "its communicator was aborted");
    if (r != rank_ && process_ended(pid)) fail_remote(who + "the process exited");
  }
}

void ShmCommunicator::abort() {
  Communicator::abort();
  std::atomic_ref<uint32_t>(peer(rank_)->gone).store(1, std::memory_order_release);
  // Wake every waiter, here and on the peers, so they see it now rather than at their deadline.
  futex(generation(), FUTEX_WAKE, INT_MAX, nullptr);
  for (int r = 0; r < size_; ++r) ring_bell(r);
}

// The barrier after a chunk's copy-in; on a call's first chunk, also the comparison of calls.
void ShmCommunicator::exchange(int buffer, const Call& asked, bool first_chunk, const Timing& timing) {
  if (first_chunk) {
    *call(buffer, rank_) = asked;
    call(buffer, rank_)->ready_ns = timing.ready_ns;
  }
  barrier(timing);
  if (first_chunk) check_calls_match(call(buffer, 0), asked, timing.what);
}

void ShmCommunicator::all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                                 const Timing& timing) {
  const Call asked{Kind::kAllReduce, static_cast<int32_t>(dtype), static_cast<int32_t>(reduction.op), 0, numel};
  reduce_chunks(data, numel, dtype, reduction, -1, asked, timing);
}

void ShmCommunicator::reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
                             const Timing& timing) {
  const Call asked{Kind::kReduce, static_cast<int32_t>(dtype), (root << 8) | static_cast<int32_t>(reduction.op), 0,
                   numel};
  reduce_chunks(data, numel, dtype, reduction, root, asked, timing);
}

// all_reduce (root -1) and reduce: per chunk, every rank copies its part in; a small chunk is
// reduced whole by each rank that wants the result; a large one is split, each rank reducing
// its share into rank 0's slot, and after a second barrier the result is copied out.
void ShmCommunicator::reduce_chunks(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                                    int root, const Call& asked, const Timing& timing) {
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t chunk = static_cast<int64_t>(kSlotBytes) / item;
  const bool wants_result = root < 0 || root == rank_;
  const bool large = static_cast<size_t>(numel * item) >= kDirectMinBytes && reduction.op != Op::PREMUL_SUM;
  for (int64_t offset = 0; offset == 0 || offset < numel; offset += chunk) {
    const int64_t n = std::min(chunk, numel - offset);
    char* mine = data + offset * item;
    const int buffer = next_buffer();
    // The first chunk is staged even when every tensor turns out shared: whether they are is
    // known only after the barrier, and a chunk's copy costs less than another barrier.
    if (offset == 0) *where(buffer, rank_) = large ? shared_offset(data) : kNotShared;
    std::memcpy(slot(buffer, rank_), mine, static_cast<size_t>(n * item));
    if (reduction.op == Op::PREMUL_SUM) scale(dtype, slot(buffer, rank_), n, reduction, 0);
    exchange(buffer, asked, offset == 0, timing);
    if (offset == 0 && all_shared(buffer)) {
      reduce_direct(data, numel, dtype, reduction, root, buffer, timing);
      return;
    }
    if (static_cast<size_t>(n * item) <= kSmallChunkBytes) {
      if (!wants_result) continue;
      std::memcpy(mine, slot(buffer, 0), static_cast<size_t>(n * item));
      for (int r = 1; r < size_; ++r) accumulate(dtype, mine, slot(buffer, r), n, reduction.op);
      if (reduction.op == Op::AVG) scale(dtype, mine, n, reduction, size_);
      continue;
    }
    const int64_t lo = n * rank_ / size_, hi = n * (rank_ + 1) / size_;
    for (int r = 1; r < size_ && hi > lo; ++r) {
      accumulate(dtype, slot(buffer, 0) + lo * item, slot(buffer, r) + lo * item, hi - lo, reduction.op);
    }
    if (reduction.op == Op::AVG && hi > lo) scale(dtype, slot(buffer, 0) + lo * item, hi - lo, reduction, size_);
    barrier(timing);
    if (wants_result) std::memcpy(mine, slot(buffer, 0), static_cast<size_t>(n * item));
  }
}

bool ShmCommunicator::all_shared(int buffer) const {
  for (int r = 0; r < size_; ++r) {
    if (*where(buffer, r) == kNotShared) return false;
  }
  return true;
}

// Rank r reduces elements [numel r / N, numel (r+1) / N) of every rank's tensor, in rank order,
// and writes them where the result goes: its own tensor (all_reduce: no other rank reads that
// part of it) or the root's (reduce). Its slot, which no rank reads on this path, holds each
// piece while it is reduced, since this rank's own part is an input too. An all_reduce then
// copies the other parts from their owners. Two barriers in all, against two per 128 KiB chunk
// on the staged path; each byte read once from where it lies, and no copy in or out of a slot.
void ShmCommunicator::reduce_direct(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                                    int root, int buffer, const Timing& timing) {
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t step = static_cast<int64_t>(kSlotBytes) / item;
  std::vector<const char*> inputs(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) inputs[r] = peer_bytes(r, *where(buffer, r));
  char* target = root < 0 ? data : peer_bytes(root, *where(buffer, root));
  char* scratch = slot(buffer, rank_);
  const auto part = [&](int r) { return numel * r / size_; };
  for (int64_t at = part(rank_); at < part(rank_ + 1); at += step) {
    const int64_t n = std::min(step, part(rank_ + 1) - at);
    const size_t offset = static_cast<size_t>(at * item), bytes = static_cast<size_t>(n * item);
    std::memcpy(scratch, inputs[0] + offset, bytes);
    for (int r = 1; r < size_; ++r) accumulate(dtype, scratch, inputs[r] + offset, n, reduction.op);
    if (reduction.op == Op::AVG) scale(dtype, scratch, n, reduction, size_);
    std::memcpy(target + offset, scratch, bytes);
  }
  barrier(timing);  // every part reduced, every input read
  if (root >= 0) return;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    copy_between_ranks(data + part(r) * item, inputs[r] + part(r) * item,
                       static_cast<size_t>((part(r + 1) - part(r)) * item));
  }
  barrier(timing);  // no rank's tensor changes before every copy of its part is done
}

void ShmCommunicator::all_gather(const std::vector<char*>& outs, const char* in, int64_t numel, at::ScalarType dtype,
                              const Timing& timing) {
  const Call asked{Kind::kAllGather, static_cast<int32_t>(dtype), 0, 0, numel};
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t chunk = static_cast<int64_t>(kSlotBytes) / item;
  for (int64_t offset = 0; offset == 0 || offset < numel; offset += chunk) {
    const int64_t n = std::min(chunk, numel - offset);
    const int buffer = next_buffer();
    std::memcpy(slot(buffer, rank_), in + offset * item, static_cast<size_t>(n * item));
    exchange(buffer, asked, offset == 0, timing);
    for (int r = 0; r < size_; ++r) {
      std::memcpy(outs[r] + offset * item, slot(buffer, r), static_cast<size_t>(n * item));
    }
  }
}

void ShmCommunicator::reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype,
                                  const Reduction& reduction, const Timing& timing) {
  const Call asked{Kind::kReduceScatter, static_cast<int32_t>(dtype), static_cast<int32_t>(reduction.op), 0, numel};
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kSlotBytes) / item / size_);
  for (int64_t offset = 0; offset == 0 || offset < numel; offset += chunk) {
    const int64_t n = std::min(chunk, numel - offset);
    const int buffer = next_buffer();
    // This rank's slot holds, for every destination rank, its part of the chunk.
    for (int r = 0; r < size_; ++r) {
      std::memcpy(slot(buffer, rank_) + r * n * item, in + (r * numel + offset) * item, static_cast<size_t>(n * item));
    }
    if (reduction.op == Op::PREMUL_SUM) scale(dtype, slot(buffer, rank_), n * size_, reduction, 0);
    exchange(buffer, asked, offset == 0, timing);
    char* mine = out + offset * item;
    std::memcpy(mine, slot(buffer, 0) + rank_ * n * item, static_cast<size_t>(n * item));
    for (int r = 1; r < size_; ++r) accumulate(dtype, mine, slot(buffer, r) + rank_ * n * item, n, reduction.op);
    if (reduction.op == Op::AVG) scale(dtype, mine, n, reduction, size_);
  }
}

void ShmCommunicator::broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) {
  const Call asked{Kind::kBroadcast, static_cast<int32_t>(dtype), root, 0, numel};
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  // Only the root writes: a chunk fills the whole buffer (every rank's slot), one barrier per N slots.
  const int64_t chunk = static_cast<int64_t>(kSlotBytes) * size_ / item;
  const size_t bytes = static_cast<size_t>(numel * item);
  // Each rank says where its tensor is; a root whose tensor is shared leaves its slot empty.
  const uint64_t mine = bytes >= kDirectMinBytes ? shared_offset(data) : kNotShared;
  for (int64_t offset = 0; offset == 0 || offset < numel; offset += chunk) {
    const int64_t n = std::min(chunk, numel - offset);
    const int buffer = next_buffer();
    if (offset == 0) *where(buffer, rank_) = mine;
    if (rank_ == root && mine == kNotShared) std::memcpy(slot(buffer, 0), data + offset * item, static_cast<size_t>(n * item));
    exchange(buffer, asked, offset == 0, timing);
    if (offset == 0 && *where(buffer, root) != kNotShared) {
      // Every rank copies straight from the root's tensor, except the last `share` bytes of
      // each shared destination, which the root writes itself: n ranks, n copiers.
      const size_t share = bytes / static_cast<size_t>(size_) / 64 * 64;
      if (rank_ == root) {
        for (int r = 0; r < size_; ++r) {
          const uint64_t to = *where(buffer, r);
          if (r != root && to != kNotShared) copy_between_ranks(peer_bytes(r, to) + bytes - share, data + bytes - share, share);
        }
      } else {
        copy_between_ranks(data, peer_bytes(root, *where(buffer, root)), mine != kNotShared ? bytes - share : bytes);
      }
      barrier(timing);  // the root's tensor and every destination stay put until all copies are done
      return;
    }
    if (rank_ != root) std::memcpy(data + offset * item, slot(buffer, 0), static_cast<size_t>(n * item));
  }
}

void ShmCommunicator::agree(const Call& asked, const Timing& timing) { exchange(next_buffer(), asked, true, timing); }

// With direct copies, every rank lists its pieces when the calls are compared: each receiver
// copies the pieces that lie in their sender's shared memory straight from there (no
// handshake per piece: the barrier that ends the call keeps the senders' tensors still until
// then), and the others go through the rings. Every rank sees every pair's sizes, so a piece
// sent with a size its receiver does not expect fails on every rank before anything moves.
void ShmCommunicator::exchange_pieces(const Call& asked, const std::vector<Piece>& send, const std::vector<Piece>& recv,
                                      const Timing& timing) {
  if (!direct_) return Communicator::exchange_pieces(asked, send, recv, timing);
  const int buffer = next_buffer();
  for (int r = 0; r < size_; ++r) {
    // Fields, not whole entries: the receiver writes `expected` of the same entry meanwhile.
    piece(buffer, rank_, r)->offset = send[r].first ? shared_offset(send[r].first) : kNotShared;
    piece(buffer, rank_, r)->bytes = send[r].first ? send[r].second : 0;
    piece(buffer, r, rank_)->expected = recv[r].first ? recv[r].second : 0;
  }
  exchange(buffer, asked, true, timing);
  bool any_direct = false;
  for (int src = 0; src < size_; ++src) {
    for (int dst = 0; dst < size_; ++dst) {
      const PieceAt& p = *piece(buffer, src, dst);
      if (src == dst || p.bytes == p.expected) {
        any_direct = any_direct || (src != dst && p.bytes && p.offset != kNotShared);
        continue;
      }
      unusable_ = true;
      TORCH_CHECK_WITH(DistBackendError, false, timing.what, ": group rank ", src, " sends ", p.bytes,
                       " bytes to group rank ", dst, ", which expects ", p.expected,
                       " bytes (a send and its recv must have the same size, as with NCCL)");
    }
  }
  std::vector<Transfer> transfers;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      copy_own_piece(send[r], recv[r]);
      continue;
    }
    if (send[r].first && send[r].second && piece(buffer, rank_, r)->offset == kNotShared) {
      transfers.push_back(Transfer{true, r, send[r].first, send[r].second, timing.deadline, timing.timeout});
    }
    if (!recv[r].first || !recv[r].second) continue;
    if (const uint64_t from = piece(buffer, r, rank_)->offset; from != kNotShared) {
      copy_between_ranks(recv[r].first, peer_bytes(r, from), recv[r].second);
    } else {
      transfers.push_back(Transfer{false, r, recv[r].first, recv[r].second, timing.deadline, timing.timeout});
    }
  }
  transfer(transfers, 1, timing.what, {}, {});
  if (any_direct) barrier(timing);  // no sender's tensor changes before its pieces are copied
}

void ShmCommunicator::ring_bell(int r) {
  std::atomic_ref<uint32_t>(*doorbell(r)).fetch_add(1, std::memory_order_acq_rel);
  futex(doorbell(r), FUTEX_WAKE, INT_MAX, nullptr);
}

ShmCommunicator::Ring& ShmCommunicator::ring(int src, int dst, int channel) {
  auto& entry = rings_[(static_cast<size_t>(channel) * size_ + src) * size_ + dst];
  if (entry) return *entry;
  const size_t capacity = size_ <= 16 ? size_t{1} << 20 : size_t{256} << 10;
  const std::string name = session_prefix() + ".collectives-" + instance_ + ".p2p-" + std::to_string(src) + "-" +
                           std::to_string(dst) + "-" + std::to_string(channel);
  void* base = map_named(name, capacity + kPage, true, false);
  TORCH_CHECK_WITH(DistBackendError, base, "emulated NCCL: could not map the point-to-point ring ", name,
                   " (is /dev/shm full? `df -h /dev/shm`)");
  entry = std::make_unique<Ring>(base, capacity + kPage);
  // Unlinked once both sides have it mapped (a rank's ring to itself has one side).
  const uint32_t sides = src == dst ? 1 : 2;
  if (std::atomic_ref<uint32_t>(*entry->mapped()).fetch_add(1) + 1 == sides) shm_unlink(name.c_str());
  return *entry;
}

// The producer announces where its bytes are and is done once the consumer acknowledges; the
// consumer, given the offset, copies the whole message at once.
size_t ShmCommunicator::step_direct(Transfer& t, Ring& r) {
  char* source = reinterpret_cast<char*>(&t.source);
  size_t moved = 0;
  if (t.send) {
    if (t.source_done < sizeof(t.source)) {
      moved = r.push(source + t.source_done, sizeof(t.source) - t.source_done);
      t.source_done += moved;
      if (t.source_done == sizeof(t.source)) ++r.direct_sent;
    }
    if (t.source_done == sizeof(t.source) && r.acked().load(std::memory_order_acquire) == r.direct_sent) {
      t.done = t.bytes;
      moved += t.bytes;
    }
    return moved;
  }
  if (t.source_done < sizeof(t.source)) {
    moved = r.pop(source + t.source_done, sizeof(t.source) - t.source_done);
    t.source_done += moved;
  }
  if (t.source_done == sizeof(t.source)) {
    copy_between_ranks(t.data, peer_bytes(t.peer, t.source), t.bytes);
    t.done = t.bytes;
    moved += t.bytes;
    r.acked().fetch_add(1, std::memory_order_release);
  }
  return moved;
}

void ShmCommunicator::transfer(std::vector<Transfer>& transfers, int channel, const std::string& what,
                            const std::function<void(std::vector<Transfer>&)>& poll,
                            const std::function<void(size_t)>& finished) {
  // Each message is its length (8 bytes) then its bytes; per peer and direction only the oldest
  // unfinished transfer moves, so messages keep their order, as NCCL matches them in order.
  std::vector<char> busy;  // [direction][peer]: an older transfer is unfinished this round
  size_t done = 0;
  for (const Transfer& t : transfers) done += t.finished();
  int idle_rounds = 0;
  bool quiet_round_passed = false;  // a quiet round passed since the last movement
  while (done < transfers.size()) {
    const uint32_t seen = std::atomic_ref<uint32_t>(*doorbell(rank_)).load(std::memory_order_acquire);
    bool moved = false;
    busy.assign(static_cast<size_t>(2 * size_), 0);
    for (size_t i = 0; i < transfers.size(); ++i) {
      Transfer& t = transfers[i];
      if (t.finished()) continue;
      char& blocked = busy[static_cast<size_t>(t.send ? 0 : size_) + t.peer];
      if (blocked) continue;
      blocked = 1;
      Ring& r = t.send ? ring(rank_, t.peer, channel) : ring(t.peer, rank_, channel);
      if (t.send && r.refused().load(std::memory_order_acquire)) fail_size(t, what);
      size_t n = 0;
      if (t.header_done < sizeof(t.header)) {
        char* header = reinterpret_cast<char*>(&t.header);
        if (t.send) {
          if (t.header_done == 0) {
            t.source = t.bytes >= kDirectMinBytes ? shared_offset(t.data) : kNotShared;
            t.header = {t.bytes | (t.source != kNotShared ? kDirectMessage : 0), t.clock};
          }
          n = r.push(header + t.header_done, sizeof(t.header) - t.header_done);
        } else if (r.readable() >= sizeof(t.header)) {
          n = r.pop(header, sizeof(t.header));
          if ((t.header.length & ~kDirectMessage) != t.bytes) {
            t.header.length &= ~kDirectMessage;
            r.refused().store(1, std::memory_order_release);
            ring_bell(t.peer);
            fail_size(t, what);
          }
        }
        t.header_done += n;
      }
      if (t.header_done == sizeof(t.header) && t.done < t.bytes) {
        if (t.header.length & kDirectMessage) {
          n += step_direct(t, r);
        } else {
          size_t m = t.send ? r.push(t.data + t.done, t.bytes - t.done) : r.pop(t.data + t.done, t.bytes - t.done);
          t.done += m;
          n += m;
        }
      }
      if (n) {
        moved = true;
        ring_bell(t.peer);
      }
      if (t.finished()) {
        ++done;
        blocked = 0;  // the next message to this peer may start in this round
        if (finished) finished(i);
      }
    }
    if (moved) {
      idle_rounds = 0;
      quiet_round_passed = false;
      continue;
    }
    if (poll) {
      const size_t before = transfers.size();
      poll(transfers);
      if (transfers.size() != before) continue;
    }
    if (done == transfers.size()) break;
    if (spin_ && ++idle_rounds < 2000) {
      cpu_relax();
      continue;
    }
    Clock::time_point deadline = Clock::time_point::max();
    for (const Transfer& t : transfers) {
      if (!t.finished()) deadline = std::min(deadline, t.deadline);
    }
    // Wake at least every 200 ms to take new work (`poll`) even if no peer rings.
    const bool in_time = sleep_on(doorbell(rank_), seen, deadline);
    if (std::atomic_ref<uint32_t>(*doorbell(rank_)).load(std::memory_order_acquire) != seen) continue;
    // Nothing rang: a peer that ended may have left its last bytes in a ring, so it is judged
    // only after a round that moved nothing following its end (its ring is drained by then).
    std::vector<int> waited_for;
    for (const Transfer& t : transfers) {
      if (!t.finished()) waited_for.push_back(t.peer);
    }
    if (quiet_round_passed) check_peers(waited_for, what);
    quiet_round_passed = true;
    if (!in_time) {
      for (const Transfer& t : transfers) {
        if (!t.finished() && t.deadline <= Clock::now()) {
          Timing timing{t.deadline, t.timeout, what};
          fail_timeout(timing, {t.peer}, t.send ? "received this send" : "sent to this receive");
        }
      }
    }
  }
}

}  // namespace mirage::nccl
