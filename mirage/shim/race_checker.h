// mirage run --check-races: the orderings a GPU would not keep, found deterministically.
//
// The emulated device runs every kernel when it is issued, so a program that forgets a
// wait_stream, a record_stream or a work.wait() gets the right answer here and corrupt data now
// and then on a GPU. The checker keeps what the GPU's order would be: a vector clock per stream
// (what of every stream's work it is ordered after), advanced by each kernel and merged by event
// waits (wait_stream, Work.wait(), a CUDA future's wait) and by host synchronisation, and a
// shadow of device memory by the allocator model's addresses: per byte range the last write and
// the reads since, each with its stream's clock. An access that is not ordered after a conflicting
// one on another stream is a race. The hooks are the two choke points: the op path (every kernel:
// its arguments read or written, its fresh results written), copy_, the allocator's frees and
// record_stream, the device guard's events and synchronisations, and the emulated NCCL (each
// collective reads its inputs and writes its outputs on its communicator's stream, after that
// stream waited for the issuing one, as ProcessGroupNCCL orders it).
//
// Because addresses are the allocator model's, a block freed while another stream may still use it
// (no record_stream) and handed out again on its own stream is found where the next kernel writes
// it. MIRAGE_CHECK_RACES (set by the launcher) is "error" (report, then raise) or "warn" (report
// and go on); unset, every hook is one relaxed load.
#pragma once

#include "config.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mirage::races {

extern std::atomic<bool> g_on;
inline bool on() { return g_on.load(std::memory_order_relaxed); }

// What one stream has seen of every stream's work: entry i is the last tick of stream slot i
// it is ordered after (an event's snapshot of its stream's clock is one of these).
using VectorClock = std::vector<uint32_t>;

// An event recorded on `stream` of `dev` takes a snapshot of that stream's clock; waiting for it
// merges the snapshot into the waiting stream's; a host synchronisation with it, into the host's.
std::shared_ptr<const VectorClock> snapshot(DeviceIndex dev, int64_t stream);
void stream_waits(DeviceIndex dev, int64_t stream, const VectorClock& event);
void host_waits(const VectorClock& event);
void host_waits_for_stream(DeviceIndex dev, int64_t stream);
void host_waits_for_device(DeviceIndex dev);  // -1: every device

// One kernel's accesses to device memory, checked and recorded together on the current stream.
// It keeps pointers to the tensors it is given: they must live until commit().
class Kernel {
 public:
  Kernel(const char* name, DeviceIndex dev, int64_t stream);
  void read(const at::Tensor& t) { add(t, false); }
  void write(const at::Tensor& t) { add(t, true); }
  // A non-blocking copy into pinned host memory: the GPU writes `host` when the stream gets there,
  // so a host op reading it before a synchronisation that covers the copy races with it.
  void write_host(const at::Tensor& host) { host_target_ = host; }
  // The host reads what the kernel produced once it ends (.item(), a synchronous copy to host):
  // the host is then ordered after the stream.
  void host_reads_result() { host_sync_ = true; }
  // Checks every access against what came before, records them, reports a race (and in "error"
  // mode raises after reporting it). `collective`: the emulated NCCL's (reports name it so).
  void commit(bool collective = false);

 private:
  void add(const at::Tensor& t, bool write);
  struct Use {
    const at::Tensor* tensor;  // the caller's, alive until commit()
    bool write;
  };
  const char* name_;
  DeviceIndex dev_;
  int64_t stream_;
  bool host_sync_ = false;
  at::Tensor host_target_;
  c10::SmallVector<Use, 6> uses_;
};

// Tensor.record_stream: the allocator will not reuse the block before `stream`'s work queued so far.
void record_stream(const at::Tensor& t, const c10::Stream& stream);
// A block of the allocator model goes back to its pool: what ran on it and is ordered (or recorded)
// is forgotten; what another stream may still be doing stays, for whoever gets the block next.
void block_freed(DeviceIndex dev, uint64_t address, size_t size, int64_t block_stream);
// How reports name a stream (the emulated NCCL names its communicators' streams).
void name_stream(DeviceIndex dev, int64_t stream, std::string name);

}  // namespace mirage::races
