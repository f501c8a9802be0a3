// The flight recorder's feed: what each operation was (Record), sent as one JSON line at its
// start and end to the session's recorder (mirage/daemon/flight_recorder.py) and kept in the
// process's trace buffer, which _dump_nccl_trace and the dump on a watchdog timeout pickle as
// ProcessGroupNCCL's FlightRecorder does.
#pragma once

#include "checks.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace mirage::nccl {

// Where user code issued the operation: the innermost Python frame outside torch and mirage, as
// "file:line in function"; empty for a thread that never ran Python (DDP's reducer issues its
// all-reduces from autograd's device threads on a GPU). `in_backward`: the innermost frame of all
// is autograd's engine call, so C++ code inside a backward pass (DDP's reducer: mirage runs an
// emulated GPU's backward pass on the calling thread) issued it, and the site is that pass's
// caller. The GIL is taken only by threads Python knows, which released it to call in here.
struct CallSite {
  std::string site;
  bool in_backward = false;
};
CallSite python_call_site();

// The process's connection to its session, where flight-recorder lines go (set from Python once
// attached; -1 outside a session).
void set_session_fd(int fd);
// One line to the session; one line per write, under one lock, so lines never interleave.
void tell_session(const std::string& line);

// What one operation was, for the recorder, the watchdog's message and _dump_nccl_trace.
struct Record {
  uint64_t id = 0;             // in this process, over all groups
  uint64_t seq = 0;            // collective or p2p sequence number in the group
  bool p2p = false;
  std::string name;            // "all_reduce", "send", ...
  std::string profiling;       // "nccl:all_reduce"
  c10d::OpType type = c10d::OpType::UNKNOWN;
  std::vector<std::vector<int64_t>> input_sizes, output_sizes;
  std::string dtype;
  int64_t numel_in = 0, numel_out = 0, bytes = 0, bytes_out = 0;
  std::string reduce_op;
  int peer = -1;               // p2p: the other group rank
  CallSite call_site;          // python_call_site()
  std::chrono::milliseconds timeout{0};
  int64_t created_ns = 0, started_ns = 0, completed_ns = 0;
  std::string state = "scheduled";
};

int64_t wall_ns();

// The last TORCH_NCCL_TRACE_BUFFER_SIZE records of the process, for _dump_nccl_trace, as
// ProcessGroupNCCL's FlightRecorder keeps them (0 keeps none).
struct TraceBuffer {
  std::mutex mu;
  std::deque<std::pair<std::string, Record>> entries;  // (group name, record)
  size_t capacity = static_cast<size_t>(std::max(0, env_int("TORCH_NCCL_TRACE_BUFFER_SIZE", 2000)));
  uint64_t next_id = 0;
};
TraceBuffer& trace();
// The process's recent operations as ProcessGroupNCCL's flight recorder dump (its keys and
// version; pickled as torch pickles it), for _dump_nccl_trace and the dump on timeout.
std::string trace_pickle(bool include_collectives, bool only_active);

const char* op_type_name(c10d::OpType t);  // "ALLREDUCE", as WorkNCCL's description names it
std::string dtype_name(at::ScalarType t);
std::string json_string(const std::string& s);

}  // namespace mirage::nccl
