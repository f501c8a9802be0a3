// Clocked mode (mirage run --timing): each emulated GPU keeps a predicted clock per stream, and
// the host a predicted clock of its own, so that events, synchronisation and the end-of-run
// report follow the profiled hardware instead of this machine.
//
// The rules are a GPU's: a kernel starts at max(its stream's clock, the host's launch time) and
// ends after its cost (op_cost.h); the host advances by the profile's launch cost per kernel,
// not by this machine's speed, so the same run predicts the same figures on a loaded machine;
// an event takes its stream's clock when recorded; wait_event / wait_stream move a stream's
// clock forward; synchronize, .item() and blocking host copies move the host's. Collectives
// (the emulated NCCL) run on their communicator's stream from the last rank's ready time.
//
// Without MIRAGE_TIMING nothing here runs: every entry point is behind timing().
#pragma once

#include "config.h"

#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <cstring>

namespace mirage {

inline bool timing() {
  static const bool on = std::getenv("MIRAGE_TIMING") != nullptr && *std::getenv("MIRAGE_TIMING");
  return on;
}

// --predict-only: kernels are not run, only placed on the timeline (results hold no values).
inline bool predict_only() {
  static const bool on = timing() && std::getenv("MIRAGE_PREDICT_ONLY") != nullptr && *std::getenv("MIRAGE_PREDICT_ONLY");
  return on;
}

// --predict-only: whether values of this type are phantoms (no kernel computed them), which the
// host reads as the placeholder 0 (.item(), copies to the host). Integers and bools are not: what
// steers a program (token counts, all_gather_object's pickles) is computed and moved for real
// (the emulated NCCL's no_payload.cpp draws the same line).
inline bool is_phantom_dtype(c10::ScalarType dtype) { return c10::isFloatingType(dtype) || c10::isComplexType(dtype); }

// What bounded a piece of device work (the report's split of a step).
enum class WorkKind : uint8_t { kCompute = 0, kMemory = 1, kCollective = 2, kCopy = 3 };

// One piece of work on the predicted timeline, for the report and the trace.
struct Interval {
  int64_t start, end;   // ns of predicted time
  const char* name;     // the operator's name (stable: schema strings, literals)
  int64_t bytes;
  double flops;
  c10::StreamId stream;
  WorkKind kind;
  DeviceIndex device;
  c10::ScalarType dtype = c10::ScalarType::Undefined;  // what it computes in (the profiler's kernel names)
};

// The name a torch.compile'd graph's device work goes by (one entry for its fused kernels).
inline constexpr const char* kCompiledGraph = "compiled graph";

// A copy (cudaMemcpyAsync on a GPU, .item()'s read of a device scalar among them): what CUPTI
// reports as a memcpy rather than a kernel, and what does not hide communication (the report's
// exposed time, as Holistic Trace Analysis counts overlap: with computation kernels only).
inline bool is_memcpy(const char* name) {
  return name && (std::strncmp(name, "Memcpy", 6) == 0 || std::strcmp(name, "aten::_local_scalar_dense") == 0);
}

// A kernel's cost while a collective runs beside it on the same GPU, which takes two things from
// it: the compute units NCCL's kernel holds (its FLOPs run in more waves on the rest) and the HBM
// bandwidth the collective's own traffic uses (every byte NCCL sends is read from HBM and every
// byte it receives written there, so a collective moving L bytes a nanosecond each way over its
// links takes 2L of the memory's bytes a nanosecond).
struct Beside {
  double compute_ns = 0;  // its FLOPs on the compute units NCCL leaves
  double memory_ns = 0;   // its bytes at the full achievable HBM bandwidth
  double fixed_ns = 0;    // launch latency, ramp, tail
  // Its cost while collectives take `hbm_share` (< 1) of the HBM bandwidth.
  int64_t cost(double hbm_share) const;
};

// Puts work of `cost_ns` on `stream` of `dev`, issued by the host now (the host pays the launch,
// except inside a CUDA graph's replay): returns when it ends. While collectives already placed
// on `dev` run beside it, the work proceeds at the rate `beside` gives (null: unaffected, as a
// copy over the host link is).
int64_t run_on_stream(DeviceIndex dev, c10::StreamId stream, int64_t cost_ns, WorkKind kind, const char* name,
                      int64_t bytes, double flops, const Beside* beside = nullptr,
                      c10::ScalarType dtype = c10::ScalarType::Undefined);
// Work whose start was agreed elsewhere (a collective, from every rank's ready time). A
// collective takes `hbm_share` of the HBM bandwidth while it runs (its links' traffic, Beside).
int64_t run_at(DeviceIndex dev, c10::StreamId stream, int64_t start, int64_t cost_ns, WorkKind kind,
               const char* name, int64_t bytes, double flops, c10::ScalarType dtype = c10::ScalarType::Undefined,
               double hbm_share = 0);
int64_t stream_time(DeviceIndex dev, c10::StreamId stream);
void stream_waits_for(DeviceIndex dev, c10::StreamId stream, int64_t t);
// Every stream of `dev` done.
int64_t device_time(DeviceIndex dev);
int64_t host_time();
void host_waits_for(int64_t t);

// Device work made of other device work (a fused kernel written over ATen, a compiled graph):
// the outermost scope on a thread is the kernel; the ops inside it are not timed on their own.
inline thread_local int tl_kernel_depth = 0;
struct KernelScope {
  KernelScope() : outermost(tl_kernel_depth++ == 0) {}
  ~KernelScope() { --tl_kernel_depth; }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;
  const bool outermost;
};

// A CUDA graph's replay on this thread: its kernels were launched once, with the graph.
inline thread_local bool tl_replaying = false;
struct ReplayScope {
  ReplayScope() : outer(tl_replaying) { tl_replaying = true; }
  ~ReplayScope() { tl_replaying = outer; }
  ReplayScope(const ReplayScope&) = delete;
  ReplayScope& operator=(const ReplayScope&) = delete;
  const bool outer;
};

}  // namespace mirage

// For the emulated NCCL (another library, loaded after the shim): its communicator's stream and
// the collectives' place on the timeline.
extern "C" {
int mirage_timing_enabled();
int64_t mirage_clock_new_stream();
// The earliest a collective issued now on `comm_stream` may start on this rank: after the work
// queued on it, after the caller's current stream (ProcessGroupNCCL's syncStream), after launch.
int64_t mirage_clock_ready(int device, int64_t comm_stream);
// The collective, from `start` (every rank's latest ready time) for `cost_ns`: returns its end.
// `dtype`: its data's c10::ScalarType (-1: none); `kind` (mirage::nccl::Kind) and `ranks` size
// the traffic its links carry, whose HBM bandwidth kernels beside it do not get.
int64_t mirage_clock_place_collective(int device, int64_t comm_stream, int64_t start, int64_t cost_ns,
                                      const char* name, int64_t bytes, int dtype, int kind, int ranks);
// Work::wait: the caller's current stream waits for `t`.
void mirage_clock_current_stream_waits(int device, int64_t t);
// The predicted duration of a collective (op_cost.cpp): kind as mirage::nccl::Kind, `bytes` the
// per-rank buffer NCCL's busbw formulas use, across `nodes` emulated nodes whose links between
// them are `nic_slowdown` times slower than the profile's (1: as the profile says).
int64_t mirage_collective_cost_ns(int kind, int64_t bytes, int ranks, int nodes, double nic_slowdown);
// How many times slower the links among these emulated nodes are (--fault slow-link; 1: none).
double mirage_link_slowdown(const int64_t* nodes, int count);
}
