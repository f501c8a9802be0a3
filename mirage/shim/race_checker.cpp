// mirage run --check-races (race_checker.h): stream clocks, the shadow of device memory, reports.
#include "race_checker.h"

#include "device_guard.h"
#include "device_memory.h"
#include "unobserved_ops.h"

#include <Python.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/library.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace mirage::races {

namespace {

enum class Mode { kOff, kWarn, kError };

Mode mode_from_environment() {
  const char* v = std::getenv("MIRAGE_CHECK_RACES");
  if (!v || !*v || std::strcmp(v, "off") == 0) return Mode::kOff;
  return std::strcmp(v, "warn") == 0 ? Mode::kWarn : Mode::kError;
}

const Mode g_mode = mode_from_environment();

// What issued an access: the kernel (or collective), where the program was, the stream's name.
struct Issuer {
  const char* kernel = "";  // an operator's schema name (lives as long as the process), or interned
  const std::type_info* autograd_node = nullptr;  // the backward node running it (its name: at a report)
  std::shared_ptr<torch::CapturedTraceback> stack;
  bool collective = false;
  bool host_reads = false;
  ~Issuer();
};

struct Access {
  int32_t slot = -1;   // the stream (-1: none, e.g. a range never written)
  uint32_t tick = 0;   // its clock's own entry when it ran
  uint64_t block = 0;  // the allocation it was made to (0: memory not from the allocator model)
  std::shared_ptr<const Issuer> issuer;
};

// A byte range of device memory with the same history.
struct Segment {
  uint64_t end;
  Access write;
  c10::SmallVector<Access, 2> reads;  // since the write, one per stream
};

// A device's segments by address, with a hash index of where each begins: most accesses cover one
// segment exactly (a tensor used whole again), found without walking the tree.
struct Shadow {
  using Map = std::map<uint64_t, Segment>;
  Map segments;
  std::unordered_map<uint64_t, Map::iterator> starting_at;

  Map::iterator insert(uint64_t lo, Segment segment) {
    auto it = segments.emplace(lo, std::move(segment)).first;
    starting_at[lo] = it;
    return it;
  }
  Map::iterator erase(Map::iterator it) {
    starting_at.erase(it->first);
    return segments.erase(it);
  }
  Map::iterator exactly(uint64_t lo, uint64_t hi) {
    auto found = starting_at.find(lo);
    return found != starting_at.end() && found->second->second.end == hi ? found->second : segments.end();
  }
  // Splits the segment containing `at` (if any straddles it) so that one begins there.
  void split(uint64_t at) {
    auto it = segments.upper_bound(at);
    if (it == segments.begin()) return;
    --it;
    if (it->first < at && it->second.end > at) {
      Segment tail = it->second;
      it->second.end = at;
      insert(at, std::move(tail));
    }
  }
};

struct StreamState {
  DeviceIndex device;
  int64_t id;
  std::string name;
  VectorClock clock;
  uint64_t host_epoch_seen = 0;
};

// "float32[64, 64]"
std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream out;
  out << c10::getDtypeNames(t.scalar_type()).first << "[";
  for (int64_t d = 0; d < t.dim(); ++d) out << (d ? ", " : "") << t.size(d);
  out << "]";
  return out.str();
}

struct Race {
  Access earlier, later;
  bool earlier_wrote, later_wrote;
  bool by_host = false;  // the later access is a host op's
  std::string tensor;    // the later access's tensor, described
  std::string earlier_stream, later_stream;
  DeviceIndex device;
  const void* data;  // the later access's bytes (for naming its owner)
};

struct State {
  std::mutex mu;
  std::unordered_map<uint64_t, int32_t> slots;
  std::vector<StreamState> streams;
  VectorClock host;  // what the host has waited for
  uint64_t host_epoch = 1;
  std::array<Shadow, kMaxDevices> shadow;
  std::unordered_map<uint64_t, c10::SmallVector<int32_t, 2>> recorded;  // block -> record_stream's streams
  std::unordered_set<std::string> reported;
  // Host memory a non-blocking copy writes once its stream gets there (Kernel::write_host).
  struct PendingHost {
    uintptr_t lo, hi;
    DeviceIndex device;
    Access access;
  };
  std::vector<PendingHost> pending_host;
};

State& state() {
  static State* s = new State();  // outlives static destruction (threads may still report)
  return *s;
}

uint64_t key(DeviceIndex dev, int64_t stream) {
  return (static_cast<uint64_t>(static_cast<uint8_t>(dev)) << 56) ^ static_cast<uint64_t>(stream);
}

uint32_t entry(const VectorClock& c, int32_t slot) {
  return static_cast<size_t>(slot) < c.size() ? c[slot] : 0;
}

void merge(VectorClock& into, const VectorClock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

std::string default_name(DeviceIndex dev, int64_t stream) {
  return stream == 0 ? "the default stream of cuda:" + std::to_string(dev)
                     : "stream " + std::to_string(stream) + " of cuda:" + std::to_string(dev);
}

// The stream's slot, its clock brought up to what the host has waited for (caller holds mu).
int32_t prepare(State& s, DeviceIndex dev, int64_t stream) {
  auto [it, fresh] = s.slots.emplace(key(dev, stream), static_cast<int32_t>(s.streams.size()));
  if (fresh) s.streams.push_back({dev, stream, default_name(dev, stream), {}, 0});
  StreamState& st = s.streams[it->second];
  if (st.host_epoch_seen != s.host_epoch) {
    merge(st.clock, s.host);
    st.host_epoch_seen = s.host_epoch;
  }
  return it->second;
}

// The host has waited for what `clock` covers: every stream's next kernel is ordered after it
// (caller holds mu; prepare() merges it in).
void host_waited(State& s, const VectorClock& clock) {
  merge(s.host, clock);
  ++s.host_epoch;
}

bool ordered(const Access& earlier, int32_t slot, const VectorClock& now) {
  return earlier.slot < 0 || earlier.slot == slot || entry(now, earlier.slot) >= earlier.tick;
}

// The allocator block and the modelled range of `t`'s bytes.
struct Range {
  uint64_t lo = 0, hi = 0, block = 0;
};

Range range_of(const at::Tensor& t) {
  Range r;
  if (!t.defined() || t.numel() == 0) return r;
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  uint64_t base = reinterpret_cast<uintptr_t>(storage->data());
  if (const CachedBlock* block = device_block_of(storage->data_ptr())) {
    base = block->address;
    r.block = block->serial;
  }
  int64_t last = 0;  // the furthest element from the first, in elements
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::abs(t.stride(d));
  r.lo = base + static_cast<uint64_t>(t.storage_offset() * t.itemsize());
  r.hi = r.lo + static_cast<uint64_t>((last + 1) * t.itemsize());
  return r;
}

// The access that `access` conflicts with in `seg`, unordered before it: the write, or (for a
// write) a read since; none if it is ordered after all of them.
std::optional<Race> conflict(const Segment& seg, const Access& access, bool write, const VectorClock& now) {
  if (!ordered(seg.write, access.slot, now)) return Race{seg.write, access, true, write};
  if (write) {
    for (const Access& read : seg.reads) {
      if (!ordered(read, access.slot, now)) return Race{read, access, false, true};
    }
  }
  return std::nullopt;
}

// A read joins the segment's reads, replacing its stream's earlier one.
void add_read(Segment& seg, const Access& access) {
  auto same = std::find_if(seg.reads.begin(), seg.reads.end(), [&](const Access& a) { return a.slot == access.slot; });
  if (same != seg.reads.end()) {
    *same = access;
  } else {
    seg.reads.push_back(access);
  }
}

// Checks an access of [lo, hi) against the history, then records it; the first race found.
std::optional<Race> touch(State& s, DeviceIndex dev, const Range& range, Access access, bool write) {
  auto& shadow = s.shadow[dev];
  const VectorClock& now = s.streams[access.slot].clock;
  std::optional<Race> race;
  // The common case: the range is one segment already (a tensor used whole again, a block reused
  // for a tensor of the same size): checked and updated in place.
  auto whole = shadow.exactly(range.lo, range.hi);
  auto first = shadow.segments.end();
  if (whole != shadow.segments.end()) {
    race = conflict(whole->second, access, write, now);
  } else {
    shadow.split(range.lo);
    shadow.split(range.hi);
    first = shadow.segments.lower_bound(range.lo);
    for (auto it = first; it != shadow.segments.end() && it->first < range.hi && !race; ++it) {
      race = conflict(it->second, access, write, now);
    }
  }
  if (race) {
    race->earlier_stream = s.streams[race->earlier.slot].name;
    race->later_stream = s.streams[access.slot].name;
    race->device = dev;
  }
  if (whole != shadow.segments.end()) {
    if (write) {
      whole->second.write = std::move(access);
      whole->second.reads.clear();
    } else {
      add_read(whole->second, access);
    }
    return race;
  }
  if (write) {
    while (first != shadow.segments.end() && first->first < range.hi) first = shadow.erase(first);
    shadow.insert(range.lo, Segment{range.hi, std::move(access), {}});
    return race;
  }
  uint64_t cursor = range.lo;
  c10::SmallVector<std::pair<uint64_t, uint64_t>, 4> gaps;
  for (auto it = first; it != shadow.segments.end() && it->first < range.hi; ++it) {
    if (it->first > cursor) gaps.emplace_back(cursor, it->first);
    cursor = it->second.end;
    add_read(it->second, access);
  }
  if (cursor < range.hi) gaps.emplace_back(cursor, range.hi);
  for (auto [lo, hi] : gaps) shadow.insert(lo, Segment{hi, Access{}, {access}});
  return race;
}

// What Python knows of the tensor at `data` ("parameter 'layers.0.weight' of Net", ...), from
// mirage/runtime/races.py; empty where nothing does.
std::string owner_of(const void* data) {
  if (!Py_IsInitialized()) return "";
  PyGILState_STATE gil = PyGILState_Ensure();
  std::string owner;
  PyObject* module = PyImport_ImportModule("mirage.runtime.races");
  PyObject* found = module ? PyObject_CallMethod(module, "owner_of", "K",
                                                 static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(data)))
                           : nullptr;
  if (found && PyUnicode_Check(found)) owner = PyUnicode_AsUTF8(found);
  if (!found) PyErr_Clear();
  Py_XDECREF(found);
  Py_XDECREF(module);
  PyGILState_Release(gil);
  return owner;
}

std::string stack_text(const torch::SymbolizedTracebacks& symbolized, size_t which, const Issuer& issuer) {
  std::ostringstream out;
  const auto& frames = symbolized.tracebacks.at(which);
  size_t shown = 0;
  for (auto it = frames.rbegin(); it != frames.rend(); ++it) {  // outermost first, as Python prints
    const auto& f = symbolized.all_frames.at(*it);
    out << "      File \"" << f.filename << "\", line " << f.lineno << ", in " << f.funcname << "\n";
    ++shown;
  }
  if (issuer.autograd_node) out << "      (in autograd's backward: " << c10::demangle(issuer.autograd_node->name()) << ")\n";
  if (shown == 0 && !issuer.autograd_node) out << "      (no Python frames on this thread)\n";
  return out.str();
}

const char* verb(bool wrote, bool past) { return wrote ? (past ? "wrote" : "writes") : (past ? "read" : "reads"); }

// Races reported in "error" mode (mirage/runtime/races.py fails the process at its exit if any:
// a program that caught the op's error and ended normally still fails).
std::atomic<int64_t> g_failed{0};

// The report, printed once per distinct race; in "error" mode the op then raises.
void report(const Race& race) {
  const Issuer& earlier = *race.earlier.issuer;
  const Issuer& later = *race.later.issuer;
  const bool reuse = race.earlier.block != 0 && race.later.block != 0 && race.earlier.block != race.later.block;
  const char* kind = reuse ? "memory reuse across streams"
                     : earlier.collective || later.collective ? "an async collective's tensor used before its wait"
                     : later.host_reads ? "a CPU read of device memory with no synchronisation"
                                        : "stream ordering";
  const char* fix =
      reuse ? "call tensor.record_stream(stream) for the stream that used the freed tensor, or keep a reference "
              "to it until that stream has been waited for (an event, wait_stream)"
      : earlier.collective || later.collective
          ? "call work.wait() (or wait on the collective's future, or wait_tensor) before the tensor is used again; "
            "do not write a collective's input until then"
      : later.host_reads ? "make the reading stream wait for the writing one (wait_stream, an event) or synchronize "
                           "the writing stream before the host reads the tensor"
                         : "order the two streams: the later one waits for the earlier (stream.wait_stream(other), "
                           "or an event recorded after the first access and waited on before the second)";
  std::vector<torch::CapturedTraceback*> stacks{earlier.stack.get(), later.stack.get()};
  const bool have_stacks = stacks[0] && stacks[1];
  const torch::SymbolizedTracebacks symbolized = have_stacks ? torch::symbolize(stacks) : torch::SymbolizedTracebacks{};
  const std::string earlier_at = have_stacks ? stack_text(symbolized, 0, earlier) : "";
  const std::string later_at = have_stacks ? stack_text(symbolized, 1, later) : "";
  State& s = state();
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (!s.reported.insert(std::string(kind) + earlier.kernel + later.kernel + earlier_at + later_at).second) {
      if (g_mode == Mode::kError) TORCH_CHECK(false, "mirage --check-races: ", kind, " (reported above)");
      return;
    }
  }
  const char* rank = std::getenv("RANK");
  const std::string owner = owner_of(race.data);
  std::ostringstream out;
  out << "\n================ mirage --check-races: a data race on "
      << (rank ? std::string("rank ") + rank : "process " + std::to_string(getpid())) << ", cuda:"
      << static_cast<int>(race.device) << " (" << kind << ")\n"
      << "  tensor: " << race.tensor << (owner.empty() ? "" : ", " + owner) << "\n";
  if (reuse) out << "  its memory was last another tensor's, freed while a stream may still have used it\n";
  if (race.by_host) {
    out << "  now:     the host reads it (" << later.kernel << ")\n";
  } else {
    out << "  now:     " << later.kernel << " " << verb(race.later_wrote, false) << " it on " << race.later_stream << "\n";
  }
  out
      << "  earlier: " << earlier.kernel << " " << verb(race.earlier_wrote, true) << " "
      << (reuse ? "that memory" : "it") << " on " << race.earlier_stream << "\n"
      << "  and nothing orders the two: on a GPU they may run at the same time, and the result changes from run "
         "to run.\n"
      << "  Fix: " << fix << ".\n"
      << "  now, from:\n" << later_at << "  earlier, from:\n" << earlier_at
      << "================ (mirage runs kernels in order, so here the data is right; --check-races=off hides this)\n";
  const std::string text = out.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  if (g_mode == Mode::kError) {
    ++g_failed;
    TORCH_CHECK(false, "mirage --check-races: ", kind, " on ", race.tensor, ": ", earlier.kernel,
                " on ", race.earlier_stream, ", then ", later.kernel, " on ", race.by_host ? "the host" : race.later_stream,
                " (the report above; --check-races=warn reports and goes on)");
  }
}

std::shared_ptr<torch::CapturedTraceback> gather() {
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
}

// Stacks of issuers no access refers to any more. Releasing one releases Python code objects,
// which takes the GIL: never while the checker's mutex is held (a thread holding the GIL may be
// waiting for that mutex), and once per batch rather than once per kernel.
struct Retired {
  std::mutex mu;
  std::vector<std::shared_ptr<torch::CapturedTraceback>> stacks;
};

Retired& retired() {
  static auto* r = new Retired();
  return *r;
}

// A stack is released with the GIL: never here, where the checker's lock may be held.
Issuer::~Issuer() {
  if (!stack) return;
  std::lock_guard<std::mutex> g(retired().mu);
  retired().stacks.push_back(std::move(stack));
}

std::shared_ptr<Issuer> new_issuer() { return std::make_shared<Issuer>(); }

// Frees the retired stacks once there are enough (the caller holds no lock of the checker's).
void free_retired() {
  std::vector<std::shared_ptr<torch::CapturedTraceback>> batch;
  {
    std::lock_guard<std::mutex> g(retired().mu);
    if (retired().stacks.size() < 256) return;
    batch.swap(retired().stacks);
  }
  if (!Py_IsInitialized() || _Py_IsFinalizing()) {  // (left to the process's end)
    for (auto& stack : batch) new std::shared_ptr<torch::CapturedTraceback>(std::move(stack));
    return;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  batch.clear();
  PyGILState_Release(gil);
}

// The name of a collective (its profiling title may not outlive the call), kept for reports.
const char* interned(const char* name) {
  static auto* names = new std::unordered_set<std::string>();
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  return names->emplace(name).first->c_str();
}

}  // namespace

std::atomic<bool> g_on{g_mode != Mode::kOff};

std::shared_ptr<const VectorClock> snapshot(DeviceIndex dev, int64_t stream) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  return std::make_shared<const VectorClock>(s.streams[prepare(s, dev, stream)].clock);
}

void stream_waits(DeviceIndex dev, int64_t stream, const VectorClock& event) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  merge(s.streams[prepare(s, dev, stream)].clock, event);
}

void host_waits(const VectorClock& event) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  host_waited(s, event);
}

void host_waits_for_stream(DeviceIndex dev, int64_t stream) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  host_waited(s, s.streams[prepare(s, dev, stream)].clock);
}

void host_waits_for_device(DeviceIndex dev) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  VectorClock all;
  for (const StreamState& st : s.streams) {
    if (dev < 0 || st.device == dev) merge(all, st.clock);
  }
  host_waited(s, all);
}

Kernel::Kernel(const char* name, DeviceIndex dev, int64_t stream) : name_(name), dev_(dev), stream_(stream) {}

void Kernel::add(const at::Tensor& t, bool write) {
  if (t.defined() && t.is_cuda() && t.numel() > 0) uses_.push_back({&t, write});
}

void Kernel::commit(bool collective) {
  if (uses_.empty() && !host_sync_) return;
  auto issuer = new_issuer();
  issuer->kernel = collective ? interned(name_) : name_;
  issuer->collective = collective;
  issuer->host_reads = host_sync_;
  issuer->stack = gather();
  if (auto node = torch::autograd::get_current_node()) issuer->autograd_node = &typeid(*node);
  std::optional<Race> race;
  State& s = state();
  {
    std::lock_guard<std::mutex> g(s.mu);
    const int32_t slot = prepare(s, dev_, stream_);
    VectorClock& clock = s.streams[slot].clock;
    if (clock.size() <= static_cast<size_t>(slot)) clock.resize(slot + 1, 0);
    const uint32_t tick = ++clock[slot];
    for (const Use& use : uses_) {
      const at::Tensor& tensor = *use.tensor;
      const Range range = range_of(tensor);
      if (range.hi == range.lo) continue;
      auto found = touch(s, dev_, range, Access{slot, tick, range.block, issuer}, use.write);
      if (found && !race) {
        race = std::move(found);
        race->data = tensor.storage().data();
        race->tensor = describe_tensor(tensor);
      }
    }
    if (host_sync_) host_waited(s, s.streams[slot].clock);
    if (host_target_.defined() && host_target_.numel() > 0) {
      const auto lo = reinterpret_cast<uintptr_t>(host_target_.data_ptr());
      s.pending_host.push_back({lo, lo + static_cast<uintptr_t>(host_target_.nbytes()), dev_,
                                Access{slot, tick, 0, issuer}});
      c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::TESTING_ONLY_GenericMode, true);
    }
  }
  uses_.clear();
  host_target_.reset();
  if (race) report(*race);
  free_retired();
}

void record_stream(const at::Tensor& t, const c10::Stream& stream) {
  if (!t.defined() || !t.is_cuda()) return;
  const CachedBlock* block = device_block_of(t.storage().unsafeGetStorageImpl()->data_ptr());
  if (!block) return;
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  const int32_t slot = prepare(s, stream.device_index(), stream.id());
  auto& streams = s.recorded[key(t.device().index(), static_cast<int64_t>(block->address))];
  if (std::find(streams.begin(), streams.end(), slot) == streams.end()) streams.push_back(slot);
}

void block_freed(DeviceIndex dev, uint64_t address, size_t size, int64_t block_stream) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  const int32_t own = prepare(s, dev, block_stream);
  c10::SmallVector<int32_t, 2> recorded;
  if (auto it = s.recorded.find(key(dev, static_cast<int64_t>(address))); it != s.recorded.end()) {
    recorded = std::move(it->second);
    s.recorded.erase(it);
  }
  const VectorClock& now = s.streams[own].clock;
  // Kept: what another stream did that the block's own stream is not yet ordered after and no
  // record_stream covers. The allocator hands the block out on its own stream only.
  auto harmless = [&](const Access& a) {
    return a.slot < 0 || ordered(a, own, now) || std::find(recorded.begin(), recorded.end(), a.slot) != recorded.end();
  };
  auto& shadow = s.shadow[dev];
  for (auto it = shadow.segments.lower_bound(address); it != shadow.segments.end() && it->first < address + size;) {
    Segment& seg = it->second;
    if (harmless(seg.write)) seg.write = Access{};
    seg.reads.erase(std::remove_if(seg.reads.begin(), seg.reads.end(), harmless), seg.reads.end());
    ++it;  // kept, if empty, for the block's next tensor (most often of the same size: checked in place)
  }
}

void name_stream(DeviceIndex dev, int64_t stream, std::string name) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  s.streams[prepare(s, dev, stream)].name = std::move(name) + " (stream " + std::to_string(stream) + " of cuda:" +
                                             std::to_string(dev) + ")";
}

// Every op of a thread that left a non-blocking copy into host memory pending passes here (the
// thread-local TESTING_ONLY_GenericMode key, set by Kernel::commit, cleared once nothing is
// pending): a CPU tensor among its arguments over pending bytes is a host read the GPU may not
// have written yet.
void host_op(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  State& s = state();
  std::optional<Race> race;
  {
    std::lock_guard<std::mutex> g(s.mu);
    auto& pending = s.pending_host;
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](const State::PendingHost& p) { return entry(s.host, p.access.slot) >= p.access.tick; }),
                  pending.end());
    const size_t num_args = op.schema().arguments().size();
    for (size_t i = stack->size() - num_args; i < stack->size() && !race && !pending.empty(); ++i) {
      const c10::IValue& iv = (*stack)[i];
      if (!iv.isTensor() || !iv.toTensor().defined() || iv.toTensor().is_cuda() || !iv.toTensor().has_storage()) continue;
      const at::Tensor& t = iv.toTensor();
      const auto lo = reinterpret_cast<uintptr_t>(t.storage().data());
      const uintptr_t hi = lo + t.storage().nbytes();
      for (const auto& p : pending) {
        if (p.lo < hi && lo < p.hi) {
          race = Race{p.access, Access{}, true, false, true};
          race->tensor = describe_tensor(t);
          race->earlier_stream = s.streams[p.access.slot].name;
          race->later_stream = "the host";
          race->device = p.device;
          race->data = t.storage().data();
          break;
        }
      }
    }
    if (pending.empty()) c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::TESTING_ONLY_GenericMode, false);
  }
  if (race) {
    auto issuer = new_issuer();
    issuer->kernel = op.schema().name().c_str();
    issuer->host_reads = true;
    issuer->stack = gather();
    race->later.issuer = std::move(issuer);
    report(*race);
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::TESTING_ONLY_GenericMode),
                     stack);
}

}  // namespace mirage::races

MIRAGE_LIBRARY(m) {
  m.def("races_failed() -> int", []() { return mirage::races::g_failed.load(); });
}

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&mirage::races::host_op>());
}

// The emulated NCCL's half (mirage/nccl, which finds these through dlsym): a collective or a
// point-to-point transfer issued on `stream` (its communicator's) of `device`, whose inputs it
// reads and outputs it writes after that stream waited for the issuing thread's current stream,
// as ProcessGroupNCCL orders it. The handle is the stream's clock after it, which Work.wait()
// merges into the waiting thread's current stream; release it with the Work.
extern "C" {
int mirage_races_enabled() { return mirage::races::on() ? 1 : 0; }

void* mirage_races_collective(int device, int64_t stream, const at::Tensor* inputs, size_t num_inputs,
                              const at::Tensor* outputs, size_t num_outputs, const char* name) {
  using namespace mirage::races;
  const auto dev = static_cast<mirage::DeviceIndex>(device);
  stream_waits(dev, stream, *snapshot(dev, mirage::tl_stream[dev]));
  Kernel kernel(name, dev, stream);
  for (size_t i = 0; i < num_inputs; ++i) kernel.read(inputs[i]);
  for (size_t i = 0; i < num_outputs; ++i) kernel.write(outputs[i]);
  kernel.commit(true);
  // ProcessGroupNCCL keeps its tensors' blocks from reuse until its stream is done with them
  // (record_stream, or holding them until the work is waited for): freeing them early is safe.
  const c10::Stream comm(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, dev), stream);
  for (size_t i = 0; i < num_inputs; ++i) record_stream(inputs[i], comm);
  for (size_t i = 0; i < num_outputs; ++i) record_stream(outputs[i], comm);
  return new std::shared_ptr<const VectorClock>(snapshot(dev, stream));
}

void mirage_races_wait(void* handle, int device) {
  const auto dev = static_cast<mirage::DeviceIndex>(device);
  mirage::races::stream_waits(dev, mirage::tl_stream[dev],
                              **static_cast<std::shared_ptr<const mirage::races::VectorClock>*>(handle));
}

void mirage_races_release(void* handle) { delete static_cast<std::shared_ptr<const mirage::races::VectorClock>*>(handle); }

void mirage_races_name_stream(int device, int64_t stream, const char* name) {
  mirage::races::name_stream(static_cast<mirage::DeviceIndex>(device), stream, name);
}
}
