// The predicted timeline (device_clock.h): stream and host clocks, the work placed on them, the
// steps the report splits it into, and what the trace and the report read back.
#include "device_clock.h"
#include "gpu_trace.h"

#include "device_guard.h"
#include "device_memory.h"
#include "faults.h"
#include "op_cost.h"
#include "profiler_activities.h"
#include "unobserved_ops.h"

#include <torch/library.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mirage {

namespace {

// One step of the report: the predicted time between two step marks on a device, split.
struct Step {
  DeviceIndex device;
  int64_t end, duration, compute, memory, collective, exposed, idle;
  double flops;
};

struct MemorySample {
  int64_t time, allocated;
  DeviceIndex device;
};

// A collective on the timeline, [start, end), and the share of the HBM bandwidth its traffic takes.
struct Running {
  int64_t start, end;
  double hbm_share;
};

// The most of the HBM bandwidth collectives running together are taken to hold (the kernel
// beside them keeps the rest: a guard against a share summed over several collectives).
constexpr double kMaxHbmShare = 0.9;

struct Timeline {
  std::mutex mu;
  int64_t host = 0;
  std::array<std::unordered_map<c10::StreamId, int64_t>, kMaxDevices> streams;
  std::vector<Interval> intervals;  // in issue order; all of them when tracing, else since the last step
  size_t step_begin = 0;            // intervals[step_begin...] belong to the step in progress
  std::array<int64_t, kMaxDevices> last_mark{};
  std::array<bool, kMaxDevices> used{};
  std::vector<Step> steps;
  std::vector<MemorySample> memory;
  std::array<int64_t, kMaxDevices> last_allocated{};
  // Each device's collectives that may still run beside kernels issued from now.
  std::array<std::vector<Running>, kMaxDevices> collectives;
};

Timeline& timeline() {
  static Timeline t;
  return t;
}

bool tracing() {
  static const bool on = std::getenv("MIRAGE_TRACE") != nullptr && *std::getenv("MIRAGE_TRACE");
  return on;
}

// The length of the union of [start, end) ranges (sorted here), clipped to [from, to).
int64_t covered(std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t from, int64_t to) {
  std::sort(ranges.begin(), ranges.end());
  int64_t total = 0, reach = from;
  for (auto [start, end] : ranges) {
    start = std::max(start, reach);
    end = std::min(end, to);
    if (end > start) {
      total += end - start;
      reach = end;
    }
  }
  return total;
}

// Closes the step in progress on `dev` at `end` (under the timeline's lock).
void close_step(Timeline& tl, DeviceIndex dev, int64_t end) {
  const int64_t begin = tl.last_mark[dev];
  Step step{dev, end, end - begin, 0, 0, 0, 0, 0, 0};
  // computation kernels; those and the collectives; all work (copies as well)
  std::vector<std::pair<int64_t, int64_t>> kernels, hiding_or_hidden, all;
  for (size_t i = tl.step_begin; i < tl.intervals.size(); ++i) {
    const Interval& w = tl.intervals[i];
    if (w.device != dev) continue;
    const int64_t spent = w.end - w.start;
    switch (w.kind) {
      case WorkKind::kCompute: step.compute += spent; break;
      case WorkKind::kMemory:
      case WorkKind::kCopy: step.memory += spent; break;
      case WorkKind::kCollective: step.collective += spent; break;
    }
    step.flops += w.flops;
    const bool copy = is_memcpy(w.name);
    if (w.kind != WorkKind::kCollective && !copy) kernels.emplace_back(w.start, w.end);
    if (!copy) hiding_or_hidden.emplace_back(w.start, w.end);
    all.emplace_back(w.start, w.end);
  }
  // communication no computation kernel overlaps (a copy beside it does not hide it)
  step.exposed = std::max<int64_t>(covered(hiding_or_hidden, begin, end) - covered(kernels, begin, end), 0);
  step.idle = std::max<int64_t>(step.duration - covered(all, begin, end), 0);  // waiting for the host or for peers
  tl.steps.push_back(step);
  tl.last_mark[dev] = end;
}

int64_t& stream_clock(Timeline& tl, DeviceIndex dev, c10::StreamId stream) { return tl.streams[dev][stream]; }

int64_t device_done(Timeline& tl, DeviceIndex dev) {
  int64_t latest = 0;
  for (const auto& [id, t] : tl.streams[dev]) latest = std::max(latest, t);
  return latest;
}

// Keeps `work`, which the host issued at predicted time `issued`.
void keep(Timeline& tl, const Interval& work, int64_t issued) {
  tl.used[work.device] = true;
  tl.intervals.push_back(work);
  const uint32_t launch = count_launch();
  if (profiling_device()) note_device_work(work, issued, launch);  // torch.profiler's GPU side
  if (!tracing()) return;
  const int64_t allocated = g_caches[work.device].allocated();
  if (allocated != tl.last_allocated[work.device]) {
    tl.last_allocated[work.device] = allocated;
    tl.memory.push_back({tl.host, allocated, work.device});
  }
}

// When work issued at `start` ends: alone it advances at 1/cost_ns of itself a nanosecond, and
// while collectives run beside it at the rate `beside` gives for the compute units and HBM
// bandwidth they leave. Collectives that ended before `host` are dropped (no later kernel can
// start before the host issues it).
int64_t end_beside_collectives(std::vector<Running>& collectives, int64_t host, int64_t start, int64_t cost_ns,
                               const Beside* beside) {
  std::erase_if(collectives, [host](const Running& c) { return c.end <= host; });
  if (beside == nullptr || collectives.empty()) return start + cost_ns;
  double left = 1.0;  // the work not yet done
  double t = static_cast<double>(start);
  while (true) {
    // what runs beside it from t, and when that next changes
    double share = 0, next = -1;
    bool any = false;
    for (const Running& c : collectives) {
      const double from = static_cast<double>(c.start), to = static_cast<double>(c.end);
      if (from <= t && t < to) {
        any = true;
        share += c.hbm_share;
        if (next < 0 || to < next) next = to;
      } else if (from > t && (next < 0 || from < next)) {
        next = from;
      }
    }
    const double rate_ns = any ? static_cast<double>(std::max(cost_ns, beside->cost(std::min(share, kMaxHbmShare))))
                               : static_cast<double>(cost_ns);
    if (next < 0 || (next - t) / rate_ns >= left) return std::llround(t + left * rate_ns);
    left -= (next - t) / rate_ns;
    t = next;
  }
}

}  // namespace

int64_t Beside::cost(double hbm_share) const {
  return std::llround(std::max(compute_ns, memory_ns / (1.0 - hbm_share)) + fixed_ns);
}

int64_t run_on_stream(DeviceIndex dev, c10::StreamId stream, int64_t cost_ns, WorkKind kind, const char* name,
                      int64_t bytes, double flops, const Beside* beside, c10::ScalarType dtype) {
  Timeline& tl = timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  int64_t& clock = stream_clock(tl, dev, stream);
  const int64_t start = std::max(clock, tl.host);
  // A straggler (--fault slow-gpu) runs its kernels slower; its copies ride the host link as before.
  const double slowdown = kind == WorkKind::kCompute || kind == WorkKind::kMemory ? cost_model().gpu_slowdown : 1.0;
  const int64_t ns = end_beside_collectives(tl.collectives[dev], tl.host, start, cost_ns, beside) - start;
  clock = start + (slowdown == 1.0 ? ns : std::llround(static_cast<double>(ns) * slowdown));
  const int64_t issued = tl.host;
  if (!tl_replaying) tl.host += cost_model().launch_ns;
  keep(tl, Interval{start, clock, name, bytes, flops, stream, kind, dev, dtype}, issued);
  return clock;
}

int64_t run_at(DeviceIndex dev, c10::StreamId stream, int64_t start, int64_t cost_ns, WorkKind kind,
               const char* name, int64_t bytes, double flops, c10::ScalarType dtype, double hbm_share) {
  Timeline& tl = timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  int64_t& clock = stream_clock(tl, dev, stream);
  const int64_t begin = std::max({clock, start, tl.host});
  clock = begin + cost_ns;
  if (kind == WorkKind::kCollective) tl.collectives[dev].push_back({begin, clock, hbm_share});
  const int64_t issued = tl.host;
  if (!tl_replaying) tl.host += cost_model().launch_ns;
  keep(tl, Interval{begin, clock, name, bytes, flops, stream, kind, dev, dtype}, issued);
  return clock;
}

int64_t stream_time(DeviceIndex dev, c10::StreamId stream) {
  Timeline& tl = timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  return stream_clock(tl, dev, stream);
}

void stream_waits_for(DeviceIndex dev, c10::StreamId stream, int64_t t) {
  Timeline& tl = timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  int64_t& clock = stream_clock(tl, dev, stream);
  clock = std::max(clock, t);
}

int64_t device_time(DeviceIndex dev) {
  Timeline& tl = timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  return device_done(tl, dev);
}

int64_t host_time() {
  Timeline& tl = timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  return tl.host;
}

void host_waits_for(int64_t t) {
  Timeline& tl = timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  tl.host = std::max(tl.host, t);
}

// The end of a training step (the optimizer's step, or the user's marker): every device this
// process used closes its step when its queued work is done.
static void mark_step() {
  Timeline& tl = timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  for (DeviceIndex dev = 0; dev < config().num_devices; ++dev) {
    if (tl.used[dev]) close_step(tl, dev, std::max(device_done(tl, dev), tl.last_mark[dev]));
  }
  if (!tracing()) tl.intervals.clear();
  tl.step_begin = tl.intervals.size();
}

}  // namespace mirage

extern "C" {
int mirage_timing_enabled() { return mirage::timing() ? 1 : 0; }

int64_t mirage_clock_new_stream() { return mirage::new_stream_id(); }

int64_t mirage_clock_ready(int device, int64_t comm_stream) {
  const auto dev = static_cast<mirage::DeviceIndex>(device);
  auto& tl = mirage::timeline();
  std::lock_guard<std::mutex> g(tl.mu);
  return std::max({mirage::stream_clock(tl, dev, comm_stream), mirage::stream_clock(tl, dev, mirage::tl_stream[dev]),
                   tl.host});
}

int64_t mirage_clock_place_collective(int device, int64_t comm_stream, int64_t start, int64_t cost_ns,
                                      const char* name, int64_t bytes, int dtype, int kind, int ranks) {
  return mirage::run_at(static_cast<mirage::DeviceIndex>(device), comm_stream, start, cost_ns,
                        mirage::WorkKind::kCollective, name, bytes, 0,
                        dtype < 0 ? c10::ScalarType::Undefined : static_cast<c10::ScalarType>(dtype),
                        mirage::collective_hbm_share(kind, bytes, ranks, cost_ns));
}

void mirage_clock_current_stream_waits(int device, int64_t t) {
  const auto dev = static_cast<mirage::DeviceIndex>(device);
  mirage::stream_waits_for(dev, mirage::tl_stream[dev], t);
}
}

// What the runtime (mirage/runtime/timing.py) reads: clocks, step marks, and at exit the steps,
// the timeline and the memory samples for the report and the trace.
MIRAGE_LIBRARY(m) {
  m.def("clock_enabled() -> bool", []() { return mirage::timing(); });
  m.def("clock_host_ns() -> int", []() -> int64_t { return mirage::timing() ? mirage::host_time() : 0; });
  m.def("clock_host_advance(int ns) -> ()", [](int64_t ns) {
    if (mirage::timing()) mirage::host_waits_for(mirage::host_time() + ns);
  });
  // torch.cuda.synchronize: the host waits for the current device (and hears of its failure:
  // a lost GPU, a device-side assert).
  m.def("clock_synchronize() -> ()", []() {
    mirage::check_device_not_lost();
    if (auto* trace = mirage::gpu_trace()) (*trace)->trace_gpu_device_synchronization(c10::DeviceType::CUDA);
    if (mirage::timing()) mirage::host_waits_for(mirage::device_time(mirage::tl_device));
  });
  // The program marks its own steps: those the optimizer marked so far do not count.
  m.def("clock_discard_steps() -> ()", []() {
    auto& tl = mirage::timeline();
    std::lock_guard<std::mutex> g(tl.mu);
    tl.steps.clear();
  });
  m.def("clock_mark_step() -> ()", []() {
    if (mirage::timing()) mirage::mark_step();
  });
  // Per step: [device, end, duration, compute, memory-bound, collectives, exposed communication,
  // idle] in ns, and its FLOPs.
  m.def("clock_steps() -> (int[][], float[])", []() {
    auto& tl = mirage::timeline();
    std::lock_guard<std::mutex> g(tl.mu);
    std::vector<std::vector<int64_t>> rows;
    std::vector<double> flops;
    for (const auto& s : tl.steps) {
      rows.push_back({s.device, s.end, s.duration, s.compute, s.memory, s.collective, s.exposed, s.idle});
      flops.push_back(s.flops);
    }
    return std::make_tuple(rows, flops);
  });
  // The timeline kept for the trace: per interval [device, stream, kind, start, end, bytes],
  // its FLOPs and name; and the memory samples [device, time, allocated].
  m.def("clock_timeline() -> (int[][], float[], str[], int[][])", []() {
    auto& tl = mirage::timeline();
    std::lock_guard<std::mutex> g(tl.mu);
    std::vector<std::vector<int64_t>> rows, memory;
    std::vector<double> flops;
    std::vector<std::string> names;
    for (const auto& w : tl.intervals) {
      rows.push_back({w.device, w.stream, static_cast<int64_t>(w.kind), w.start, w.end, w.bytes});
      flops.push_back(w.flops);
      names.emplace_back(w.name);
    }
    for (const auto& s : tl.memory) memory.push_back({s.device, s.time, s.allocated});
    return std::make_tuple(rows, flops, names, memory);
  });
}
