// The flight recorder's feed (flight_recorder.h): each operation's record, its lines to the
// session's recorder, the process's trace buffer and its pickle, and the profiler's events.

#include "flight_recorder.h"

#include "process_group.h"

#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/python_headers.h>

#include <sys/socket.h>

#include <cstring>
#include <iomanip>
#include <sstream>

namespace mirage::nccl {

using c10d::OpType;

std::string dtype_name(at::ScalarType t) {
  return std::string(c10::getDtypeNames(t).first);
}

std::string json_string(const std::string& s) {
  std::ostringstream out;
  out << '"';
  for (char c : s) {
    if (c == '"' || c == '\\') out << '\\' << c;
    else if (static_cast<unsigned char>(c) < 0x20) out << "\\u" << std::hex << std::setw(4) << std::setfill('0') << int(c) << std::dec;
    else out << c;
  }
  out << '"';
  return out.str();
}

CallSite python_call_site() {
  CallSite out;
  if (!Py_IsInitialized() || PyGILState_GetThisThreadState() == nullptr) return out;
  PyGILState_STATE state = PyGILState_Ensure();
  PyFrameObject* frame = PyEval_GetFrame();
  Py_XINCREF(frame);
  bool innermost = true;
  while (frame && out.site.empty()) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    const char* function = PyUnicode_AsUTF8(code->co_name);
    const std::string name = file ? file : "?";
    if (innermost) out.in_backward = function && std::strcmp(function, "_engine_run_backward") == 0;
    innermost = false;
    if (name.find("/torch/") == std::string::npos && name.find("/mirage/") == std::string::npos) {
      out.site = name + ":" + std::to_string(PyFrame_GetLineNumber(frame)) + " in " + (function ? function : "?");
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  PyErr_Clear();
  PyGILState_Release(state);
  return out;
}

namespace {
std::mutex g_session_mu;
std::atomic<int> g_session_fd{-1};
}  // namespace

void set_session_fd(int fd) {
  std::lock_guard<std::mutex> g(g_session_mu);
  g_session_fd = fd;
}

void tell_session(const std::string& line) {
  std::lock_guard<std::mutex> g(g_session_mu);
  if (g_session_fd < 0) return;
  const char* p = line.data();
  size_t left = line.size();
  while (left) {
    ssize_t n = ::send(g_session_fd, p, left, MSG_NOSIGNAL);
    if (n <= 0) return;  // the session is gone: its watch thread stops the process
    p += n;
    left -= static_cast<size_t>(n);
  }
}

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

TraceBuffer& trace() {
  static auto* buffer = new TraceBuffer();
  return *buffer;
}
constexpr const char* kTraceVersion = "2.10";  // ProcessGroupNCCL's flight recorder format

const char* op_type_name(OpType t) {
  switch (t) {
    case OpType::BROADCAST: return "BROADCAST";
    case OpType::ALLREDUCE: return "ALLREDUCE";
    case OpType::ALLREDUCE_COALESCED: return "ALLREDUCE_COALESCED";
    case OpType::REDUCE: return "REDUCE";
    case OpType::ALLGATHER: return "ALLGATHER";
    case OpType::_ALLGATHER_BASE: return "_ALLGATHER_BASE";
    case OpType::ALLGATHER_COALESCED: return "ALLGATHER_COALESCED";
    case OpType::GATHER: return "GATHER";
    case OpType::SCATTER: return "SCATTER";
    case OpType::REDUCE_SCATTER: return "REDUCE_SCATTER";
    case OpType::ALLTOALL_BASE: return "ALLTOALL_BASE";
    case OpType::ALLTOALL: return "ALLTOALL";
    case OpType::SEND: return "SEND";
    case OpType::RECV: return "RECV";
    case OpType::BARRIER: return "BARRIER";
    case OpType::_REDUCE_SCATTER_BASE: return "_REDUCE_SCATTER_BASE";
    case OpType::COALESCED: return "COALESCED";
    default: return "UNKNOWN";
  }
}

std::string trace_pickle(bool include_collectives, bool only_active) {
  const auto new_dict = [] { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); };
  const auto sizes = [](const std::vector<std::vector<int64_t>>& list) {
    c10::List<c10::List<int64_t>> out;
    for (const auto& shape : list) out.push_back(c10::List<int64_t>(shape));
    return out;
  };
  const auto dtypes = [](const Record& r, size_t n) {
    return c10::List<std::string>(std::vector<std::string>(n, r.dtype));
  };
  const auto time_or_none = [](int64_t ns) { return ns ? c10::IValue(ns) : c10::IValue(); };
  c10::impl::GenericList entries(c10::AnyType::get());
  if (include_collectives) {
    TraceBuffer& buffer = trace();
    std::lock_guard<std::mutex> g(buffer.mu);
    for (const auto& [group, r] : buffer.entries) {
      if (only_active && r.state == "completed") continue;
      auto e = new_dict();
      e.insert("record_id", static_cast<int64_t>(r.id));
      e.insert("pg_id", int64_t{0});
      e.insert("process_group", c10::ivalue::Tuple::create(group, std::string()));
      e.insert("collective_seq_id", static_cast<int64_t>(r.p2p ? 0 : r.seq));
      e.insert("p2p_seq_id", static_cast<int64_t>(r.p2p ? r.seq : 0));
      e.insert("op_id", static_cast<int64_t>(r.seq));
      e.insert("profiling_name", r.profiling);
      e.insert("time_created_ns", r.created_ns);
      e.insert("time_discovered_started_ns", time_or_none(r.started_ns));
      e.insert("time_discovered_completed_ns", time_or_none(r.completed_ns));
      e.insert("duration_ms", r.started_ns && r.completed_ns ? c10::IValue((r.completed_ns - r.started_ns) / 1e6)
                                                             : c10::IValue());
      e.insert("input_sizes", sizes(r.input_sizes));
      e.insert("input_dtypes", dtypes(r, r.input_sizes.size()));
      e.insert("output_sizes", sizes(r.output_sizes));
      e.insert("output_dtypes", dtypes(r, r.output_sizes.size()));
      e.insert("state", r.state);
      e.insert("timeout_ms", static_cast<int64_t>(r.timeout.count()));
      e.insert("is_p2p", r.p2p);
      e.insert("retired", r.state == "completed");
      e.insert("frames", c10::impl::GenericList(c10::AnyType::get()));
      entries.push_back(e);
    }
  }
  auto dump = new_dict();
  dump.insert("version", std::string(kTraceVersion));
  dump.insert("entries", entries);
  dump.insert("pg_config", new_dict());
  dump.insert("pg_status", new_dict());
  const std::vector<char> bytes = torch::jit::pickle(dump);
  return std::string(bytes.begin(), bytes.end());
}

Record ProcessGroupNCCL::make_record(OpType type, const char* profiling, const char* name, const std::vector<at::Tensor>& ins,
                                     const std::vector<at::Tensor>& outs, std::chrono::milliseconds timeout, std::string reduce_op,
                                     bool p2p) {
  Record r;
  r.p2p = p2p;
  r.seq = p2p ? ++p2p_seq_ : ++seq_;
  r.name = name;
  r.profiling = profiling;
  r.type = type;
  r.timeout = timeout;
  r.reduce_op = std::move(reduce_op);
  for (const auto& t : ins) {
    r.input_sizes.push_back(t.sizes().vec());
    r.numel_in += t.numel();
    r.bytes += nbytes(t);
  }
  for (const auto& t : outs) {
    r.output_sizes.push_back(t.sizes().vec());
    r.numel_out += t.numel();
    r.bytes_out += nbytes(t);
  }
  const auto& any = !ins.empty() ? ins : outs;
  if (!any.empty()) r.dtype = dtype_name(any[0].scalar_type());
  r.created_ns = wall_ns();
  if (g_session_fd >= 0) r.call_site = python_call_site();  // only the session's recorder reads it
  return r;
}

// One line to the session's flight recorder (see mirage/daemon/flight_recorder.py).
void ProcessGroupNCCL::record(const Record& r, bool entering) {
  if (g_session_fd < 0) return;  // no session (--in-process): nobody to tell
  if (entering) {
    std::ostringstream line;
    line << "{\"op\": \"collective\", \"phase\": \"enter\", \"rank\": " << my_global_rank()
         << ", \"group\": " << json_string(group_name()) << ", \"instance\": " << json_string(instance())
         << ", \"seq\": " << r.seq << ", \"p2p\": " << (r.p2p ? "true" : "false") << ", \"group_ranks\": [";
    const char* sep = "";
    for (auto g : group_ranks()) {
      line << sep << g;
      sep = ", ";
    }
    line << "], \"name\": " << json_string(r.name) << ", \"dtype\": "
         << (r.dtype.empty() ? "null" : json_string(r.dtype)) << ", \"shapes\": [";
    sep = "";
    const auto& shapes = r.input_sizes.empty() ? r.output_sizes : r.input_sizes;
    for (size_t i = 0; i < shapes.size() && i < 4; ++i) {
      line << sep << "[";
      const char* comma = "";
      for (auto d : shapes[i]) {
        line << comma << d;
        comma = ", ";
      }
      line << "]";
      sep = ", ";
    }
    line << "], \"numel\": " << r.numel_in << ", \"bytes\": " << r.bytes << ", \"reduce_op\": "
         << (r.reduce_op.empty() ? "null" : json_string(r.reduce_op));
    if (r.p2p) line << ", \"peer\": " << group_ranks()[r.peer];
    if (!r.call_site.site.empty()) line << ", \"callsite\": " << json_string(r.call_site.site);
    if (r.call_site.in_backward) line << ", \"in_backward\": true";
    line << "}\n";
    tell_session(line.str());
  } else {
    tell_session("{\"op\": \"collective\", \"phase\": \"exit\", \"rank\": " + std::to_string(my_global_rank()) +
                 ", \"instance\": " + json_string(instance()) + ", \"seq\": " + std::to_string(r.seq) +
                 ", \"p2p\": " + (r.p2p ? "true" : "false") + "}\n");
  }
}

void ProcessGroupNCCL::keep_trace(const Record& r) {
  TraceBuffer& buffer = trace();
  std::lock_guard<std::mutex> g(buffer.mu);
  if (!buffer.capacity) return;
  Record copy = r;
  copy.id = buffer.next_id++;
  buffer.entries.emplace_back(group_name(), std::move(copy));
  while (buffer.entries.size() > buffer.capacity) buffer.entries.pop_front();
}

void ProcessGroupNCCL::finish_trace(const Record& r) {
  TraceBuffer& buffer = trace();
  std::lock_guard<std::mutex> g(buffer.mu);
  for (auto it = buffer.entries.rbegin(); it != buffer.entries.rend(); ++it) {
    if (it->second.seq == r.seq && it->second.p2p == r.p2p && it->first == group_name()) {
      const uint64_t id = it->second.id;
      it->second = r;
      it->second.id = id;
      break;
    }
  }
}

// The profiler's "record_param_comms" event with the operation's metadata, as ProcessGroupNCCL
// records it (collective name, sizes, dtype, the group's ranks as start and stride).
void ProcessGroupNCCL::record_param_comms(const Record& r, const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs) {
  const auto ranks = group_ranks();
  const int start = static_cast<int>(ranks.front());
  int stride = ranks.size() > 1 ? static_cast<int>(ranks[1] - ranks[0]) : 1;
  for (size_t i = 1; i < ranks.size(); ++i) {
    if (static_cast<int>(ranks[i] - ranks[i - 1]) != stride) stride = -1;
  }
  const auto& any = !ins.empty() ? ins : outs;
  const at::ScalarType dtype = any.empty() ? at::kByte : any[0].scalar_type();
  std::string name = param_comms_name(r);
  RECORD_PARAM_COMMS_DATA(static_cast<int>(r.seq), profiler_group(), ins, outs, rank_, std::move(name), r.numel_in,
                          r.numel_out, dtype, std::vector<int64_t>(), std::vector<int64_t>(), start, stride, size_);
}

// ProcessGroupNCCL's collective names in those events.
std::string ProcessGroupNCCL::param_comms_name(const Record& r) {
  switch (r.type) {
    case OpType::ALLREDUCE: return "allreduce";
    case OpType::ALLREDUCE_COALESCED: return "allreduce_coalesced";
    case OpType::BROADCAST: return "broadcast";
    case OpType::REDUCE: return "reduce";
    case OpType::ALLGATHER: return "all_gather";
    case OpType::_ALLGATHER_BASE: return "_allgather_base";
    case OpType::ALLGATHER_COALESCED: return "allgather_coalesced";
    case OpType::REDUCE_SCATTER: return "reduce_scatter";
    case OpType::_REDUCE_SCATTER_BASE: return "_reduce_scatter_base";
    case OpType::ALLTOALL_BASE: return "all_to_allv";
    case OpType::ALLTOALL: return "all_to_all";
    case OpType::GATHER: return "gather";
    case OpType::SCATTER: return "scatter";
    case OpType::SEND: return "send";
    case OpType::RECV: return "recv";
    case OpType::BARRIER: return "barrier";
    default: return r.name;
  }
}

}  // namespace mirage::nccl
