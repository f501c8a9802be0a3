#include "faults.h"

#include "config.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace mirage {

std::atomic<bool> g_fault_ops{false}, g_fault_allocs{false};

namespace {

std::atomic<bool> g_device_lost{false};
// What the runtime returns once the device's context is unusable: cudaErrorUnknown (999) for a
// lost GPU, cudaErrorAssert (710) after a device-side assert (written before g_device_lost is set).
int g_device_error_code = 999;
const char* g_device_error = "unknown error";

// One fault as the launcher encodes it: "id,kind,trigger,count,stall_ms" (kind: kill, stall,
// oom, lose-gpu, kill-node; trigger: op, alloc, collective), already filtered to ranks that exist
// and checked.
struct Fault {
  int id = 0;
  std::string kind, trigger;
  int64_t count = 0, stall_ms = 0;
};

struct Faults {
  std::vector<Fault> mine;  // this rank's
  std::string folder;       // where fired faults leave their marker
  std::string rank;
  std::string node;         // MIRAGE_NODE_RANK, for a kill-node fault's message
  bool is_rank = false;     // RANK is set: a worker (not torchrun's agent or a helper process)
  std::string restart;      // torchrun's attempt (TORCHELASTIC_RESTART_COUNT)
  std::atomic<int64_t> ops{0}, allocs{0}, collectives{0};
};

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// One line of the session's record of what the ranks went through (folder/observed), which the
// summary reads: a worker starting (event "start", with its torchrun attempt) or an error it saw.
// One write with O_APPEND, so lines of several processes never interleave.
void observe(const Faults& f, const char* event, const std::string& detail) {
  if (f.folder.empty() || !f.is_rank) return;
  std::string clean = detail.substr(0, detail.find('\n'));
  for (char& c : clean) {
    if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) c = '\'';
  }
  char line[768];
  const int n = std::snprintf(line, sizeof line,
                              "{\"event\": \"%s\", \"rank\": %s, \"restart\": %s, \"pid\": %d, \"time\": %.6f, "
                              "\"detail\": \"%.400s\"}\n",
                              event, f.rank.c_str(), f.restart.c_str(), static_cast<int>(::getpid()), now_seconds(),
                              clean.c_str());
  const int fd = ::open((f.folder + "/observed").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  if (fd < 0 || n <= 0) return;
  (void)!::write(fd, line, static_cast<size_t>(std::min<int>(n, sizeof line - 1)));
  ::close(fd);
}

// MIRAGE_FAULTS: "target:id,kind,trigger,count,stall_ms;..." (the launcher's encoding). The target
// is a RANK, or "nN" for node N's first rank (its LOCAL_RANK 0), where a kill-node fault counts.
Faults* read_faults() {
  auto* out = new Faults();
  const char* spec = std::getenv("MIRAGE_FAULTS");
  const char* rank = std::getenv("RANK");
  const char* runtime = std::getenv("MIRAGE_RUNTIME");
  if (!spec || !runtime) return out;
  out->rank = rank ? rank : "0";
  out->is_rank = rank != nullptr;
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  out->restart = restart && *restart ? restart : "0";
  out->folder = std::string(runtime) + "/faults";
  const char* node = std::getenv("MIRAGE_NODE_RANK");
  const char* local_rank = std::getenv("LOCAL_RANK");
  out->node = node ? node : "0";
  const bool first_of_node = !local_rank || std::string(local_rank) == "0";
  std::stringstream entries(spec);
  std::string entry;
  while (std::getline(entries, entry, ';')) {
    const auto colon = entry.find(':');
    if (colon == std::string::npos) continue;
    const std::string target = entry.substr(0, colon);
    if (target != out->rank && !(first_of_node && target == "n" + out->node)) continue;
    std::stringstream fields(entry.substr(colon + 1));
    std::string id, count, stall;
    Fault fault;
    std::getline(fields, id, ',');
    std::getline(fields, fault.kind, ',');
    std::getline(fields, fault.trigger, ',');
    std::getline(fields, count, ',');
    std::getline(fields, stall, ',');
    fault.id = std::stoi(id);
    fault.count = std::stoll(count);
    fault.stall_ms = std::stoll(stall);
    if (fault.trigger == "op") g_fault_ops = true;
    if (fault.trigger == "alloc") g_fault_allocs = true;
    out->mine.push_back(fault);
  }
  observe(*out, "start", "");
  return out;
}

// Read when the shim loads (g_faults_read), before any thread; again in a child of the fork
// server (mirage_reload_faults), single-threaded too.
Faults* g_faults = nullptr;

Faults& faults() {
  if (!g_faults) g_faults = read_faults();
  return *g_faults;
}

// Claims the fault for this session (false: it already fired, e.g. before torchrun restarted
// this worker), then logs it: stderr ("SIGKILL on rank 1 at its collective 120", or `on` and
// `whose` for another target) and the marker the summary reads.
bool claim(const Fault& fault, const char* what, std::string on = "", const char* whose = "its") {
  Faults& f = faults();
  const std::string marker = f.folder + "/" + std::to_string(fault.id);
  const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return false;
  const double now = now_seconds();
  char line[512];
  const int n = std::snprintf(line, sizeof line,
                              "{\"id\": %d, \"kind\": \"%s\", \"rank\": %s, \"trigger\": \"%s\", \"count\": %lld, "
                              "\"pid\": %d, \"time\": %.6f}\n",
                              fault.id, fault.kind.c_str(), f.rank.c_str(), fault.trigger.c_str(),
                              static_cast<long long>(fault.count), static_cast<int>(::getpid()), now);
  if (n > 0) (void)!::write(fd, line, static_cast<size_t>(n));
  ::close(fd);
  if (on.empty()) on = "rank " + f.rank;
  std::fprintf(stderr, "mirage: fault %d injected: %s on %s at %s %s %lld\n", fault.id, what, on.c_str(), whose,
               fault.trigger.c_str(), static_cast<long long>(fault.count));
  std::fflush(stderr);
  return true;
}

[[noreturn]] void kill_self() {
  ::kill(::getpid(), SIGKILL);
  std::abort();  // not reached: SIGKILL cannot be caught
}

// A kill-node fault: the node's processes (its torchrun agent too) die at once, which only the
// launcher can do: this asks it through the FIFO it reads (launcher/faults.py, NodeKiller) and
// waits for its SIGKILL. Without a launcher reading, the rank at least dies.
[[noreturn]] void kill_node(const Fault& fault) {
  const std::string pipe = faults().folder + "/kill-node";
  const int fd = ::open(pipe.c_str(), O_WRONLY | O_NONBLOCK);
  char request[64];
  const int n = std::snprintf(request, sizeof request, "%d %d\n", fault.id, static_cast<int>(::getpid()));
  if (fd < 0 || ::write(fd, request, static_cast<size_t>(n)) != n) kill_self();
  ::close(fd);
  for (;;) ::pause();
}

// The fault of `trigger` whose count this event reaches, or null.
const Fault* due(const char* trigger, int64_t count) {
  for (const Fault& fault : faults().mine)
    if (fault.trigger == trigger && fault.count == count) return &fault;
  return nullptr;
}

// A lose-gpu fault: from now on the process's device work raises (the hot paths' flags make
// the op path and the allocator look), as after a GPU fell off the bus (Xid 79).
void lose_device() {
  observe(faults(), "error", "torch.AcceleratorError: unknown error (GPU lost)");
  g_device_lost = true;
  g_fault_ops = true;
  g_fault_allocs = true;
}

}  // namespace

void faults_loaded() { (void)faults(); }

[[noreturn]] static void raise_device_error() {
  const char* api = config().amd ? "HIP" : "CUDA";
  throw c10::AcceleratorError(c10::SourceLocation{__func__, __FILE__, __LINE__}, g_device_error_code,
                              std::string(api) + " error: " + g_device_error + "\n" + cuda_error_suffix());
}

void check_device_not_lost() {
  if (C10_UNLIKELY(g_device_lost.load(std::memory_order_relaxed))) raise_device_error();
}

void device_side_assert(const std::string& what) {
  std::fprintf(stderr, "%s\n", what.c_str());
  std::fflush(stderr);
  if (!g_device_lost.load()) {
    g_device_error_code = 710;
    g_device_error = "device-side assert triggered";
    observe(faults(), "error", "torch.AcceleratorError: device-side assert triggered");
    g_device_lost = true;
    g_fault_ops = true;
    g_fault_allocs = true;
  }
  raise_device_error();
}

void fault_at_op() {
  check_device_not_lost();
  const Fault* fault = due("op", ++faults().ops);
  if (!fault) return;
  if (fault->kind == "kill" && claim(*fault, "SIGKILL")) kill_self();
  if (fault->kind == "lose-gpu" && claim(*fault, "GPU lost")) {
    lose_device();
    check_device_not_lost();
  }
}

void fault_at_alloc(c10::DeviceIndex dev, size_t nbytes, void (*raise_oom)(c10::DeviceIndex, int64_t)) {
  check_device_not_lost();
  const Fault* fault = due("alloc", ++faults().allocs);
  if (!fault) return;
  if (fault->kind == "kill" && claim(*fault, "SIGKILL")) kill_self();
  if (fault->kind == "oom" && claim(*fault, "out of memory")) {
    observe(faults(), "error", "torch.OutOfMemoryError");
    raise_oom(dev, static_cast<int64_t>(nbytes));
  }
  if (fault->kind == "lose-gpu" && claim(*fault, "GPU lost")) {
    lose_device();
    check_device_not_lost();
  }
}

}  // namespace mirage

extern "C" int64_t mirage_fault_at_collective() {
  using namespace mirage;
  if (faults().mine.empty()) return 0;
  const Fault* fault = due("collective", ++faults().collectives);
  if (!fault) return 0;
  if (fault->kind == "kill" && claim(*fault, "SIGKILL")) kill_self();
  if (fault->kind == "kill-node" && claim(*fault, "SIGKILL", "node " + faults().node, "its first rank's"))
    kill_node(*fault);
  if (fault->kind == "stall" && claim(*fault, "stall")) return fault->stall_ms;
  if (fault->kind == "lose-gpu" && claim(*fault, "GPU lost")) lose_device();  // the backend sees it
  return 0;
}

extern "C" void mirage_fault_observed(const char* error) { mirage::observe(mirage::faults(), "error", error); }

extern "C" bool mirage_device_lost() { return mirage::g_device_lost.load(std::memory_order_relaxed); }

// Read MIRAGE_FAULTS when the shim loads, so the hot paths' flags are set before the first op.
static const bool g_faults_read = (mirage::faults_loaded(), true);

// The fork server (mirage/forkserver) loads the shim before it knows which rank each child will
// be; a child reads its faults here once it has taken over its process's environment.
extern "C" void mirage_reload_faults() {
  mirage::g_fault_ops = false;
  mirage::g_fault_allocs = false;
  delete mirage::g_faults;
  mirage::g_faults = mirage::read_faults();
}
