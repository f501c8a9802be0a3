// The emulated NCCL backend: a c10d Backend of its own, the one place every collective on an
// emulated GPU passes, whoever issues it (Python, DDP's reducer, FSDP, functional collectives).
//
// It is what torch.distributed builds where it would build ProcessGroupNCCL (mirage puts this
// class in its place, see mirage/runtime/distributed.py), so `init_process_group("nccl")`, the
// cuda default, "cuda:nccl,cpu:gloo", new_group, DeviceMesh and every group a framework creates
// get it for cuda. Data moves through same-host shared memory (shm_transport.cpp). Around each
// operation this file does what ProcessGroupNCCL does around a kernel launch: NCCL's argument
// checks and error messages, sequence numbers, Work objects with futures, profiler events named
// as NCCL's ("nccl:all_reduce"), the watchdog's timeout handling (TORCH_NCCL_ASYNC_ERROR_HANDLING,
// TORCH_NCCL_BLOCKING_WAIT), and the session's flight recorder (one JSON line per start and end
// of an operation on the session socket, keyed by the communicator instance).
//
// Collectives run to completion in the calling thread, in issue order: on a GPU they would run
// in issue order on the communicator's stream, and the caller could not touch their buffers
// before waiting anyway. Point-to-point operations go to a worker thread that moves every
// pending send and receive at once, as NCCL's stream would, so isend/irecv in any order and
// batch_isend_irecv never deadlock.

#include "gloo_on_device.h"
#include "transport.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/extension.h>
#include <pybind11/chrono.h>

#include <dlfcn.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace mirage::nccl {
namespace {

using c10d::OpType;
using Op = c10d::ReduceOp::RedOpType;

bool env_flag(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (!value || !*value) return fallback;
  return std::string(value) != "0" && std::string(value) != "false" && std::string(value) != "False";
}

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::atoi(value) : fallback;
}

const char* library() {
  const char* vendor = std::getenv("MIRAGE_VENDOR");
  return vendor && std::string(vendor) == "amd" ? "RCCL" : "NCCL";
}

// The dtypes NCCL has (ProcessGroupNCCL's ncclDataType map); bool travels as uint8.
bool nccl_has(at::ScalarType t) {
  switch (t) {
    case at::kChar: case at::kByte: case at::kBool: case at::kInt: case at::kLong: case at::kHalf:
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kFloat8_e5m2: case at::kFloat8_e4m3fn:
    case at::kFloat8_e4m3fnuz: case at::kFloat8_e5m2fnuz: case at::kUInt32: case at::kUInt64:
    case at::kComplexFloat: case at::kComplexDouble: case at::kComplexHalf:
      return true;
    default:
      return false;
  }
}

// ProcessGroupNCCL's checkSingleTensor.
void check_tensor(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cuda() && !t.is_sparse(), "Tensors must be CUDA and dense");
  TORCH_CHECK_VALUE(t.is_contiguous(t.suggest_memory_format()), "Tensors must be contiguous");
  TORCH_CHECK_TYPE(nccl_has(t.scalar_type()), "Input tensor data type is not supported for NCCL process group: ",
                   t.scalar_type());
}

// Complex tensors travel as their real views (NCCL has no complex type).
at::Tensor as_real(const at::Tensor& t) { return t.is_complex() ? at::view_as_real(t) : t; }

int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.numel() * t.element_size()); }

// NCCL's reduce op for `op` on `dtype` (ProcessGroupNCCL's getNcclReduceOp and its errors).
Reduction reduction_of(const c10d::ReduceOp& op, const at::Tensor& t) {
  Reduction r;
  r.op = op.op_;
  if (t.is_complex()) {
    TORCH_CHECK_VALUE(c10d::isComplexViewAsRealAllowed(op), "all_reduce does not support ", reduce_op_name(op.op_),
                      " on complex tensors");
  }
  if (t.scalar_type() == at::kBool) {
    TORCH_CHECK_VALUE(op.op_ != Op::AVG, "Cannot use ReduceOp.AVG with boolean inputs");
    if (op.op_ == Op::SUM) r.op = Op::MAX;
    if (op.op_ == Op::PRODUCT) r.op = Op::MIN;
  }
  switch (op.op_) {
    case Op::BAND: TORCH_CHECK_VALUE(false, "Cannot use ReduceOp.BAND with NCCL");
    case Op::BOR: TORCH_CHECK_VALUE(false, "Cannot use ReduceOp.BOR with NCCL");
    case Op::BXOR: TORCH_CHECK_VALUE(false, "Cannot use ReduceOp.BXOR with NCCL");
    case Op::UNUSED: TORCH_CHECK_VALUE(false, "Unhandled ReduceOp");
    default: break;
  }
  const at::ScalarType real = as_real(t).scalar_type();
  TORCH_CHECK_VALUE(!at::isFloat8Type(real), "the emulated ", library(), " does not reduce ", real,
                    " tensors (copies only: broadcast, all_gather, all_to_all, send/recv)");
  TORCH_CHECK_VALUE(real != at::kUInt32 && real != at::kUInt64, "the emulated ", library(), " does not reduce ",
                    real, " tensors");
  if (op.op_ == Op::PREMUL_SUM) {
    auto* supplement = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(supplement, "PREMUL_SUM without its factor");
    if (supplement->tensor_factor.defined()) {
      // The factor's bytes, in the tensor's dtype (a device or CPU scalar).
      r.factor_data = supplement->tensor_factor.to(real).data_ptr();
    } else {
      r.factor = supplement->double_factor;
    }
  }
  return r;
}

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

// ---------------------------------------------------------------- the shim's clock (clocked mode)

// The shim's predicted timeline (mirage/shim/device_clock.h's C interface), found through dlsym as
// the arena is: the shim is loaded with RTLD_GLOBAL before this module, which must also import
// without it (its build imports it). Without clocked mode (or the shim) `on` is false.
struct ShimClock {
  int (*enabled)() = nullptr;
  int64_t (*new_stream)() = nullptr;
  int64_t (*ready)(int, int64_t) = nullptr;
  int64_t (*collective)(int, int64_t, int64_t, int64_t, const char*, int64_t) = nullptr;
  void (*current_stream_waits)(int, int64_t) = nullptr;
  int64_t (*cost_ns)(int, int64_t, int, int, double) = nullptr;
  double (*link_slowdown)(const int64_t*, int) = nullptr;
  bool on = false;

  static const ShimClock& get() {
    static const ShimClock clock = [] {
      ShimClock c;
      c.enabled = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "mirage_timing_enabled"));
      c.new_stream = reinterpret_cast<int64_t (*)()>(dlsym(RTLD_DEFAULT, "mirage_clock_new_stream"));
      c.ready = reinterpret_cast<int64_t (*)(int, int64_t)>(dlsym(RTLD_DEFAULT, "mirage_clock_ready"));
      c.collective = reinterpret_cast<int64_t (*)(int, int64_t, int64_t, int64_t, const char*, int64_t)>(
          dlsym(RTLD_DEFAULT, "mirage_clock_collective"));
      c.current_stream_waits = reinterpret_cast<void (*)(int, int64_t)>(
          dlsym(RTLD_DEFAULT, "mirage_clock_current_stream_waits"));
      c.cost_ns = reinterpret_cast<int64_t (*)(int, int64_t, int, int, double)>(
          dlsym(RTLD_DEFAULT, "mirage_collective_cost_ns"));
      c.link_slowdown = reinterpret_cast<double (*)(const int64_t*, int)>(dlsym(RTLD_DEFAULT, "mirage_link_slowdown"));
      c.on = c.enabled && c.new_stream && c.ready && c.collective && c.current_stream_waits && c.cost_ns &&
             c.link_slowdown && c.enabled();
      return c;
    }();
    return clock;
  }
};
const ShimClock& shim_clock() { return ShimClock::get(); }

// ---------------------------------------------------------------- the session's flight recorder

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

// Where flight-recorder lines go: the process's connection to its session (set from Python once
// attached; -1 outside a session). One line per write, under one lock, so lines never interleave.
std::mutex g_session_mu;
std::atomic<int> g_session_fd{-1};

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

// What one operation was, for the recorder, the watchdog's message and _dump_nccl_trace.
struct Record {
  uint64_t id = 0;             // in this process, over all groups
  uint64_t seq = 0;            // collective or p2p sequence number in the group
  bool p2p = false;
  std::string name;            // "all_reduce", "send", ...
  std::string profiling;       // "nccl:all_reduce"
  OpType type = OpType::UNKNOWN;
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

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The last TORCH_NCCL_TRACE_BUFFER_SIZE records of the process, for _dump_nccl_trace, as
// ProcessGroupNCCL's FlightRecorder keeps them (0 keeps none).
struct TraceBuffer {
  std::mutex mu;
  std::deque<std::pair<std::string, Record>> entries;  // (group name, record)
  size_t capacity = static_cast<size_t>(std::max(0, env_int("TORCH_NCCL_TRACE_BUFFER_SIZE", 2000)));
  uint64_t next_id = 0;
};
TraceBuffer& trace() {
  static auto* buffer = new TraceBuffer();
  return *buffer;
}
constexpr const char* kTraceVersion = "2.10";  // ProcessGroupNCCL's flight recorder format
std::string trace_pickle(bool include_collectives, bool only_active);

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

// ---------------------------------------------------------------- Work

class EmulatedWork final : public c10d::Work {
 public:
  EmulatedWork(int rank, OpType type, const char* profiling_title, const std::vector<at::Tensor>& inputs,
               std::vector<at::Tensor> outputs, uint64_t seq, std::string description,
               std::tuple<std::string, std::string> group, int group_size)
      : c10d::Work(rank, type, profiling_title, inputs), outputs_(std::move(outputs)), seq_(seq),
        description_(std::move(description)), group_(std::move(group)), group_size_(group_size) {
    std::vector<c10::Device> devices;
    for (const auto& t : outputs_) {
      if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
        devices.push_back(t.device());
      }
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), devices);
  }

  // Clocked mode: the operation ends at `end_ns` on `stream` (its communicator's) of `device`.
  void set_predicted_end(int device, int64_t stream, int64_t end_ns) {
    clock_device_ = device;
    clock_stream_ = stream;
    end_ns_ = end_ns;
  }

  // Completes the work (and its future); an error is kept for wait() to raise. In clocked mode
  // the future's events are recorded on the communicator's stream, as ProcessGroupNCCL's are,
  // so whoever waits on the future (DDP's reducer) waits for the operation's predicted end.
  void complete(std::exception_ptr error = nullptr) {
    duration_ms_ = std::chrono::duration<float, std::milli>(Clock::now() - started_).count();
    if (error) {
      future_->setError(error);
    } else if (clock_device_ >= 0) {
      c10::StreamGuard on_comm_stream(
          c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(clock_device_)),
                      clock_stream_));
      future_->markCompleted(c10::IValue(outputs_));
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
    finish(error);
  }

  std::vector<at::Tensor> result() override { return outputs_; }
  // TORCH_NCCL_ENABLE_TIMING (or enableCollectivesTiming): how long the operation ran.
  float getDuration() const override {
    TORCH_CHECK(timed_, "getDuration only works if timing was enabled");
    return duration_ms_;
  }
  void time_it() { timed_ = true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  uint64_t getSequencenumber() const override { return seq_; }
  void synchronize() override {}

  bool wait(std::chrono::milliseconds timeout) override {
    // The profiler's record of the wait, as WorkNCCL::wait makes it.
    RECORD_PARAM_COMMS(static_cast<int>(seq_), group_, rank_, "wait", 0, 0, at::kByte, std::vector<int64_t>(),
                       std::vector<int64_t>(), -1, -1, group_size_);
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout == std::chrono::milliseconds(0)) {  // kNoTimeout
      cv_.wait(lock, [&] { return completed_; });
    } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
      C10_THROW_ERROR(DistBackendError, "[Rank " + std::to_string(rank_) + "] " + description_ +
                      " timed out in blocking wait after " + std::to_string(timeout.count()) + " ms.");
    }
    if (exception_) std::rethrow_exception(exception_);
    if (clock_device_ >= 0) shim_clock().current_stream_waits(clock_device_, end_ns_);  // the caller's stream waits
    return true;
  }

  const std::string& description() const { return description_; }

 private:
  std::vector<at::Tensor> outputs_;
  uint64_t seq_;
  std::string description_;
  std::tuple<std::string, std::string> group_;  // (name, description), for the profiler
  int group_size_;
  Clock::time_point started_ = Clock::now();
  float duration_ms_ = 0;
  bool timed_ = false;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  int clock_device_ = -1;  // clocked mode: where and when the operation ends
  int64_t clock_stream_ = 0, end_ns_ = 0;
};

// A work made of others (the coalesced ops of a batch): complete when all of them are.
class CoalescedWork final : public c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<EmulatedWork>> works)
      : c10d::Work(rank, OpType::COALESCED), works_(std::move(works)) {}
  bool isCompleted() override {
    return std::all_of(works_.begin(), works_.end(), [](auto& w) { return w->isCompleted(); });
  }
  bool isSuccess() const override {
    return std::all_of(works_.begin(), works_.end(), [](auto& w) { return w->isSuccess(); });
  }
  std::exception_ptr exception() const override {
    for (auto& w : works_) {
      if (auto e = w->exception()) return e;
    }
    return nullptr;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : works_) w->wait(timeout);
    return true;
  }
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> all;
    for (auto& w : works_) {
      for (auto& t : w->result()) all.push_back(t);
    }
    return all;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(c10::FutureType::create(c10::ListType::ofTensors()));
    for (auto& w : works_) futures.push_back(w->getFuture());
    auto all = c10::collectAll(futures);
    auto result = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    auto outputs = this->result();
    all->addCallback([result, outputs](c10::ivalue::Future& f) {
      if (f.hasError()) result->setError(f.exception_ptr());
      else result->markCompleted(c10::IValue(outputs));
    });
    return result;
  }

 private:
  std::vector<c10::intrusive_ptr<EmulatedWork>> works_;
};

}  // namespace

// ---------------------------------------------------------------- options

struct NCCLConfig : torch::CustomClassHolder {
  int blocking = 1;
  int cga_cluster_size = 4;
  int min_ctas = 1;
  int max_ctas = 32;
  std::string net_name;
  int split_share = 0;
  int cta_policy = 0;
};

struct Options : c10d::Backend::Options {
  explicit Options(bool is_high_priority_stream = false)
      : c10d::Backend::Options("nccl", std::chrono::minutes(10)), is_high_priority_stream(is_high_priority_stream),
        config(c10::make_intrusive<NCCLConfig>()) {}
  bool is_high_priority_stream;
  c10::intrusive_ptr<NCCLConfig> config;
  c10::intrusive_ptr<c10d::Backend> split_from;
  int split_color = 0;
};

// ---------------------------------------------------------------- the backend

class ProcessGroupNCCL final : public c10d::Backend {
 public:
  ProcessGroupNCCL(c10::intrusive_ptr<c10d::Store> store, int rank, int size, c10::intrusive_ptr<Options> options)
      : c10d::Backend(rank, size), store_(std::move(store)), options_(std::move(options)), uid_(next_uid()++) {
    blocking_wait_ = env_flag("TORCH_NCCL_BLOCKING_WAIT", false);
    measure_durations_ = env_flag("TORCH_NCCL_ENABLE_TIMING", false);
    async_error_handling_ = env_int("TORCH_NCCL_ASYNC_ERROR_HANDLING", 3);
    // NCCL leaves a node's shared memory and P2P paths for the network only when both are
    // turned off; so does the emulation.
    // The connection's keys, per torchrun attempt where the workers share the agent's store
    // (TORCHELASTIC_USE_AGENT_STORE): torchrun restarts them against that same store, where the
    // failed attempt's keys (a communicator segment long unlinked) still sit. Without it each
    // attempt's workers get a new store, and the attempt count, which is each agent's own, may
    // differ between ranks (a node that rejoined counts from 0): no prefix then.
    const bool agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE") &&
                             std::string(std::getenv("TORCHELASTIC_USE_AGENT_STORE")) == "True";
    const auto connect_store = c10::make_intrusive<c10d::PrefixStore>(
        agent_store ? "mirage/attempt-" + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0)) : "mirage", store_);
    const bool p2p = !env_flag("NCCL_P2P_DISABLE", false);
    comm_ = env_flag("NCCL_SHM_DISABLE", false) && !p2p ? connect_sockets(connect_store, rank, size, options_->timeout)
            : std::getenv("MIRAGE_ISOLATED_NODES") ? connect_across_nodes(connect_store, rank, size, p2p, options_->timeout)
            : connect_shared_memory(connect_store, rank, size, p2p, options_->timeout);
    TORCH_CHECK_WITH(DistBackendError, comm_, library(), " error: the emulated ", library(),
                     " runs inside a mirage session only (mirage run -- ...): no MIRAGE_SESSION, or /dev/shm "
                     "has no room for the communicator (`df -h /dev/shm`; NCCL_SHM_DISABLE=1 NCCL_P2P_DISABLE=1 "
                     "use sockets instead)");
    if (std::getenv("NCCL_DEBUG") && (std::string(std::getenv("NCCL_DEBUG")) == "INFO" ||
                                      std::string(std::getenv("NCCL_DEBUG")) == "TRACE")) {
      log_init();
    }
  }

  ~ProcessGroupNCCL() override { stop_worker(); }

  const std::string getBackendName() const override { return "nccl"; }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override { return options_; }
  c10::intrusive_ptr<Options> options() const { return options_; }
  bool supportsCoalescing() const override { return true; }
  bool supportsSplitting() const override { return false; }
  // ncclCommShrink exists from NCCL 2.27 (the emulated NCCL's version); RCCL 2.26 lacks it, so a
  // ROCm build of torch refuses dist.shrink_group, and so does an AMD profile.
  bool supportsShrinking() const override { return std::string(library()) == "NCCL"; }

  // dist.shrink_group: a communicator over the ranks not excluded, formed by those ranks alone
  // (through this group's store, under a key of this communicator and shrink), as ncclCommShrink
  // forms it from the parent without the excluded ranks. SHRINK_ABORT (1) aborts the parent first.
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                                           const c10::intrusive_ptr<c10d::Backend::Options>& opts_override) override {
    TORCH_CHECK(supportsShrinking(), "Backend nccl does not support shrink");
    const std::set<int64_t> excluded(ranks_to_exclude.begin(), ranks_to_exclude.end());
    TORCH_CHECK_VALUE(!excluded.count(rank_), "rank ", rank_, " is excluded from the shrunk group and must not call "
                      "shrink_group");
    if (shrink_flags & 1) abort();
    auto options = c10::make_intrusive<Options>(*options_);
    if (auto asked = c10::dynamic_intrusive_pointer_cast<Options>(opts_override)) options = c10::make_intrusive<Options>(*asked);
    const auto parent_ranks = group_ranks();
    options->global_ranks_in_group.clear();
    int new_rank = 0;
    for (int r = 0; r < size_; ++r) {
      if (excluded.count(r)) continue;
      if (r < rank_) ++new_rank;
      options->global_ranks_in_group.push_back(parent_ranks[static_cast<size_t>(r)]);
    }
    const auto store = c10::make_intrusive<c10d::PrefixStore>(
        "mirage/shrink/" + comm_->instance() + "/" + std::to_string(++shrinks_), store_);
    return c10::make_intrusive<ProcessGroupNCCL>(store, new_rank, static_cast<int>(options->global_ranks_in_group.size()),
                                                 options);
  }
  uint64_t uid() const { return uid_; }
  const std::string& instance() const { return comm_->instance(); }

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  void setTimeout(std::chrono::milliseconds timeout) override { options_->timeout = timeout; }
  void add_ephemeral_timeout(std::chrono::milliseconds extra) { ephemeral_timeout_ += extra; }
  void eagerConnectSingleDevice(at::Device) override {}
  void enableCollectivesTiming() override { measure_durations_ = true; }

  void startCoalescing() override {
    std::lock_guard<std::mutex> g(mu_);
    coalescing_ = true;
    coalesced_.clear();
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    std::vector<c10::intrusive_ptr<EmulatedWork>> works;
    {
      std::lock_guard<std::mutex> g(mu_);
      coalescing_ = false;
      works.swap(coalesced_);
    }
    return c10::make_intrusive<CoalescedWork>(rank_, std::move(works));
  }

  // ------------------------------------------------------------ collectives

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const at::Tensor& t = single(tensors);
    const int root = static_cast<int>(opts.rootRank);
    check_root(root);
    return collective(OpType::BROADCAST, "nccl:broadcast", "broadcast", tensors, tensors, opts.timeout, "", [&] {
      at::Tensor r = as_real(t);
      comm_->broadcast(data(r), r.numel(), r.scalar_type(), root, timing_);
    });
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const at::Tensor& t = single(tensors);
    TORCH_CHECK(!opts.sparseIndices.has_value(), "the emulated ", library(), " has no sparse all_reduce");
    const Reduction reduction = reduction_of(opts.reduceOp, t);
    return collective(OpType::ALLREDUCE, "nccl:all_reduce", "all_reduce", tensors, tensors, opts.timeout,
                      op_name(opts.reduceOp), [&] {
      at::Tensor r = as_real(t);
      comm_->all_reduce(data(r), r.numel(), r.scalar_type(), reduction, timing_);
    });
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    for (const auto& t : tensors) check_tensor(t);
    return collective(OpType::COALESCED, "nccl:allreduce_coalesced", "all_reduce_coalesced", tensors, tensors,
                      opts.timeout, op_name(opts.reduceOp), [&] {
      for (const auto& t : tensors) {
        at::Tensor r = as_real(t);
        comm_->all_reduce(data(r), r.numel(), r.scalar_type(), reduction_of(opts.reduceOp, t), timing_);
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    const at::Tensor& t = single(tensors);
    const int root = static_cast<int>(opts.rootRank);
    check_root(root);
    const Reduction reduction = reduction_of(opts.reduceOp, t);
    return collective(OpType::REDUCE, "nccl:reduce", "reduce", tensors, tensors, opts.timeout, op_name(opts.reduceOp),
                      [&] {
      at::Tensor r = as_real(t);
      comm_->reduce(data(r), r.numel(), r.scalar_type(), reduction, root, timing_);
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override {
    const at::Tensor& in = single(inputs);
    TORCH_CHECK_VALUE(outputs.size() == 1, "Expecting one output list, got ", outputs.size());
    auto& outs = outputs[0];
    check_list(outs, in, "output");
    bool even = std::all_of(outs.begin(), outs.end(), [&](const at::Tensor& o) { return o.numel() == in.numel(); });
    return collective(OpType::ALLGATHER, "nccl:all_gather", "all_gather", inputs, outs, opts.timeout, "", [&] {
      at::Tensor r = as_real(in);
      if (even) {
        std::vector<char*> to;
        for (const auto& o : outs) to.push_back(data(as_real(o)));
        comm_->all_gather(to, data(r), r.numel(), r.scalar_type(), timing_);
        return;
      }
      // Uneven sizes: a broadcast from each rank in turn, as ProcessGroupNCCL does them.
      as_real(outs[rank_]).copy_(r);
      for (int root = 0; root < size_; ++root) {
        at::Tensor o = as_real(outs[root]);
        comm_->broadcast(data(o), o.numel(), o.scalar_type(), root, timing_);
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts) override {
    check_tensor(out);
    check_tensor(in);
    TORCH_CHECK_VALUE(in.dtype() == out.dtype(), "output tensor must have the same type as input tensor");
    TORCH_CHECK_VALUE(in.numel() * size_ == out.numel(),
                      "output tensor size must be equal to world_size times input tensor size");
    std::vector<at::Tensor> ins{in}, outs{out};
    return collective(OpType::_ALLGATHER_BASE, "nccl:_all_gather_base", "all_gather_into_tensor", ins, outs,
                      opts.timeout, "", [&] { gather_flat(out, in); });
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "allgather_coalesced: one output list per input");
    std::vector<at::Tensor> flat_outputs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_tensor(inputs[i]);
      check_list(outputs[i], inputs[i], "output");
      for (const auto& o : outputs[i]) flat_outputs.push_back(o);
    }
    return collective(OpType::ALLGATHER_COALESCED, "nccl:all_gather_coalesced", "all_gather_coalesced", inputs,
                      flat_outputs, opts.timeout, "", [&] {
      for (size_t i = 0; i < inputs.size(); ++i) {
        std::vector<char*> to;
        for (const auto& o : outputs[i]) to.push_back(data(as_real(o)));
        at::Tensor r = as_real(inputs[i]);
        comm_->all_gather(to, data(r), r.numel(), r.scalar_type(), timing_);
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "one output tensor per input tensor");
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_tensor(inputs[i]);
      check_tensor(outputs[i]);
      TORCH_CHECK_VALUE(inputs[i].numel() * size_ == outputs[i].numel(),
                        "output tensor size must be equal to world_size times input tensor size");
    }
    return collective(OpType::COALESCED, "nccl:allgather_into_tensor_coalesced", "all_gather_into_tensor_coalesced",
                      inputs, outputs, opts.timeout, "", [&] {
      for (size_t i = 0; i < inputs.size(); ++i) gather_flat(outputs[i], inputs[i]);
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const at::Tensor& out = single(outputs);
    TORCH_CHECK_VALUE(inputs.size() == 1, "Expecting one input list, got ", inputs.size());
    auto& ins = inputs[0];
    check_list(ins, out, "input");
    const Reduction reduction = reduction_of(opts.reduceOp, out);
    bool even = std::all_of(ins.begin(), ins.end(), [&](const at::Tensor& i) { return i.numel() == out.numel(); });
    return collective(OpType::REDUCE_SCATTER, "nccl:reduce_scatter", "reduce_scatter", ins, outputs, opts.timeout,
                      op_name(opts.reduceOp), [&] {
      if (even) {
        at::Tensor flat = at::empty({size_ * as_real(out).numel()}, as_real(out).options().device(at::kCPU));
        for (int r = 0; r < size_; ++r) {
          flat.narrow(0, r * as_real(out).numel(), as_real(out).numel()).copy_(as_real(ins[r]).reshape(-1));
        }
        at::Tensor o = as_real(out);
        comm_->reduce_scatter(data(o), static_cast<char*>(flat.data_ptr()), o.numel(), o.scalar_type(), reduction,
                              timing_);
        return;
      }
      // Uneven sizes: a reduce to each rank in turn, on copies (reduce writes its buffer).
      for (int root = 0; root < size_; ++root) {
        at::Tensor buffer = as_real(ins[root]).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
        comm_->reduce(static_cast<char*>(buffer.data_ptr()), buffer.numel(), buffer.scalar_type(), reduction, root,
                      timing_);
        if (root == rank_) as_real(out).copy_(buffer.view(as_real(out).sizes()));
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& opts) override {
    check_tensor(out);
    check_tensor(in);
    TORCH_CHECK_VALUE(in.dtype() == out.dtype(), "input tensor must be the same type as the output tensor.");
    TORCH_CHECK_VALUE(in.numel() == out.numel() * size_,
                      "input tensor must be the same size as output size times world size");
    const Reduction reduction = reduction_of(opts.reduceOp, out);
    std::vector<at::Tensor> ins{in}, outs{out};
    return collective(OpType::_REDUCE_SCATTER_BASE, "nccl:_reduce_scatter_base", "reduce_scatter_tensor", ins, outs,
                      opts.timeout, op_name(opts.reduceOp), [&] { scatter_flat(out, in, reduction); });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "one output tensor per input tensor");
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_tensor(inputs[i]);
      check_tensor(outputs[i]);
      TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_,
                        "input tensor must be the same size as output size times world size");
    }
    return collective(OpType::COALESCED, "nccl:reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced",
                      inputs, outputs, opts.timeout, op_name(opts.reduceOp), [&] {
      for (size_t i = 0; i < inputs.size(); ++i) scatter_flat(outputs[i], inputs[i], reduction_of(opts.reduceOp, outputs[i]));
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    check_tensor(out);
    check_tensor(in);
    TORCH_CHECK_VALUE(in.dtype() == out.dtype(), "alltoall: input and output must have the same dtype");
    const auto pieces = [&](const at::Tensor& t, const std::vector<int64_t>& splits) {
      std::vector<std::pair<char*, size_t>> parts;
      const int64_t rows = t.dim() ? t.size(0) : 1;
      const size_t row_bytes = rows ? static_cast<size_t>(nbytes(t) / rows) : 0;
      if (splits.empty()) {
        TORCH_CHECK_VALUE(rows % size_ == 0, "Tensor's dim 0 does not divide equally across group size");
      } else {
        TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size_, "Number of tensor splits not equal to group size");
        int64_t sum = 0;
        for (int64_t s : splits) sum += s;
        TORCH_CHECK_VALUE(sum == rows, "Split sizes doesn't match total dim 0 size");
      }
      char* p = data(t);
      for (int r = 0; r < size_; ++r) {
        const size_t n = row_bytes * static_cast<size_t>(splits.empty() ? rows / size_ : splits[r]);
        parts.emplace_back(p, n);
        p += n;
      }
      return parts;
    };
    auto send = pieces(in, in_splits), recv = pieces(out, out_splits);
    std::vector<at::Tensor> ins{in}, outs{out};
    return collective(OpType::ALLTOALL_BASE, "nccl:all_to_all", "all_to_all_single", ins, outs, opts.timeout, "",
                      [&] { exchange_pieces(Kind::kAllToAll, -1, in.scalar_type(), send, recv); });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                          const c10d::AllToAllOptions& opts) override {
    TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size_ && static_cast<int>(ins.size()) == size_,
                      "alltoall: one input and one output tensor per rank");
    std::vector<std::pair<char*, size_t>> send, recv;
    for (int r = 0; r < size_; ++r) {
      check_tensor(ins[r]);
      check_tensor(outs[r]);
      TORCH_CHECK_VALUE(ins[r].dtype() == outs[r].dtype(), "alltoall: input and output must have the same dtype");
      send.emplace_back(data(ins[r]), static_cast<size_t>(nbytes(ins[r])));
      recv.emplace_back(data(outs[r]), static_cast<size_t>(nbytes(outs[r])));
    }
    return collective(OpType::ALLTOALL, "nccl:all_to_all", "all_to_all", ins, outs, opts.timeout, "",
                      [&] { exchange_pieces(Kind::kAllToAll, -1, ins[0].scalar_type(), send, recv); });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    const at::Tensor& in = single(inputs);
    const int root = static_cast<int>(opts.rootRank);
    check_root(root);
    std::vector<std::pair<char*, size_t>> send(size_, {nullptr, 0}), recv(size_, {nullptr, 0});
    std::vector<at::Tensor> outs;
    if (rank_ == root) {
      TORCH_CHECK_VALUE(outputs.size() == 1, "gather: requires a single-element output list");
      check_list(outputs[0], in, "output");
      for (int r = 0; r < size_; ++r) recv[r] = {data(outputs[0][r]), static_cast<size_t>(nbytes(outputs[0][r]))};
      outs = outputs[0];
    } else {
      TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "gather: requires empty output on non-root");
    }
    send[root] = {data(in), static_cast<size_t>(nbytes(in))};
    return collective(OpType::GATHER, "nccl:gather", "gather", inputs, outs, opts.timeout, "",
                      [&] { exchange_pieces(Kind::kGather, root, in.scalar_type(), send, recv); });
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    const at::Tensor& out = single(outputs);
    const int root = static_cast<int>(opts.rootRank);
    check_root(root);
    std::vector<std::pair<char*, size_t>> send(size_, {nullptr, 0}), recv(size_, {nullptr, 0});
    std::vector<at::Tensor> ins;
    if (rank_ == root) {
      TORCH_CHECK_VALUE(inputs.size() == 1, "scatter: requires a single-element input list");
      check_list(inputs[0], out, "input");
      for (int r = 0; r < size_; ++r) send[r] = {data(inputs[0][r]), static_cast<size_t>(nbytes(inputs[0][r]))};
      ins = inputs[0];
    } else {
      TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "scatter: requires empty input on non-root");
    }
    recv[root] = {data(out), static_cast<size_t>(nbytes(out))};
    return collective(OpType::SCATTER, "nccl:scatter", "scatter", ins, outputs, opts.timeout, "",
                      [&] { exchange_pieces(Kind::kScatter, root, out.scalar_type(), send, recv); });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    // ProcessGroupNCCL's barrier runs on the group's device: the one given, else the one this
    // process used last, else (guessDeviceId) the global rank modulo the GPUs it sees.
    if (opts.device) {
      barrier_device_ = opts.device->index();
    } else if (!opts.device_ids.empty()) {
      barrier_device_ = static_cast<int>(opts.device_ids[0]);
    } else if (barrier_device_ < 0) {
      barrier_device_ = my_global_rank() % std::max<int>(1, static_cast<int>(c10::impl::getDeviceGuardImpl(
                                                                c10::DeviceType::CUDA)->deviceCount()));
    }
    std::vector<at::Tensor> none;
    return collective(OpType::BARRIER, "nccl:all_reduce_barrier", "barrier", none, none, opts.timeout, "", [&] {
      comm_->agree(Call{Kind::kBarrier, 0, 0, 0, 0}, timing_);
    });
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    TORCH_CHECK(false, "ProcessGroupNCCL does not support recvAnysource");
  }

  // ------------------------------------------------------------ point-to-point

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int) override {
    return point_to_point(tensors, dst, true);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int) override {
    return point_to_point(tensors, src, false);
  }

  // ------------------------------------------------------------ lifetime

  // ncclCommAbort: what waits on this communicator here fails at once, and so do the peers
  // waiting for this rank (ncclRemoteError there); a new group is what can be used next.
  void abort() override {
    failed_ = true;
    comm_->abort();
    stop_worker();
  }
  void shutdown() override { stop_worker(); }
  c10d::ErrorType getError() override { return failed_ ? c10d::ErrorType::COMM_ERROR : c10d::ErrorType::SUCCESS; }

  static void set_session_fd(int fd) {
    std::lock_guard<std::mutex> g(g_session_mu);
    g_session_fd = fd;
  }


 private:
  static uint64_t& next_uid() {
    static uint64_t uid = 0;
    return uid;
  }

  static char* data(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

  const at::Tensor& single(std::vector<at::Tensor>& tensors) const {
    TORCH_CHECK_VALUE(tensors.size() == 1, "Expecting one tensor only but got multiple");
    check_tensor(tensors[0]);
    return tensors[0];
  }

  void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* what) const {
    TORCH_CHECK_VALUE(static_cast<int>(list.size()) == size_, "Tensor list input to scatter/gather must match number "
                      "of collective participants but got ", list.size(), " ", what, "s for ", size_, " ranks");
    for (const auto& t : list) {
      check_tensor(t);
      TORCH_CHECK_VALUE(t.dtype() == like.dtype(), "Tensors must have identical type");
    }
  }

  void check_root(int root) const {
    TORCH_CHECK_VALUE(root >= 0 && root < size_, "Invalid rootRank ", root, " for a group of ", size_);
  }

  static std::string op_name(const c10d::ReduceOp& op) { return reduce_op_name(op.op_); }

  std::string group_name() const { return options_->group_name.empty() ? "0" : options_->group_name; }

  std::vector<uint64_t> group_ranks() const {
    if (!options_->global_ranks_in_group.empty()) return options_->global_ranks_in_group;
    std::vector<uint64_t> ranks;
    for (int r = 0; r < size_; ++r) ranks.push_back(static_cast<uint64_t>(r));
    return ranks;
  }

  int my_global_rank() const {
    if (!options_->global_ranks_in_group.empty()) return static_cast<int>(options_->global_ranks_in_group[rank_]);
    return rank_;  // the default group (torch gives it no list): group ranks are global ranks
  }

  std::chrono::milliseconds timeout_for(std::chrono::milliseconds asked) const {
    auto t = asked == c10d::kUnsetTimeout ? options_->timeout + ephemeral_timeout_ : asked;
    return std::min<std::chrono::milliseconds>(t, std::chrono::hours(24 * 365));  // timedelta.max: forever enough
  }

  std::string describe_work(const Record& r) const {
    std::ostringstream text;
    text << "WorkNCCL(SeqNum=" << r.seq << ", OpType=" << op_type_name(r.type) << ", NumelIn=" << r.numel_in
         << ", NumelOut=" << r.numel_out << ", Timeout(ms)=" << r.timeout.count() << ")";
    return text.str();
  }

  std::string log_prefix() const {
    return "[PG ID " + std::to_string(uid_) + " PG GUID " + group_name() + "(" + getGroupDesc() + ") Rank " +
           std::to_string(rank_) + "] ";
  }

  Record make_record(OpType type, const char* profiling, const char* name, const std::vector<at::Tensor>& ins,
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
  void record(const Record& r, bool entering) {
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

  void keep_trace(const Record& r) {
    TraceBuffer& buffer = trace();
    std::lock_guard<std::mutex> g(buffer.mu);
    if (!buffer.capacity) return;
    Record copy = r;
    copy.id = buffer.next_id++;
    buffer.entries.emplace_back(group_name(), std::move(copy));
    while (buffer.entries.size() > buffer.capacity) buffer.entries.pop_front();
  }

  void finish_trace(const Record& r) {
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

  // What the watchdog does with a failed operation: NCCL's timeout message, or for a
  // communicator error (ncclRemoteError: a peer died or aborted; ncclUnhandledCudaError: this
  // rank's GPU was lost) the watchdog's exception; then, unless the user asked for errors in the
  // caller (TORCH_NCCL_BLOCKING_WAIT=1, or async error handling off), the process is taken down
  // as ProcessGroupNCCL's watchdog takes it down.
  std::exception_ptr on_failure(const Record& r, const c10::Error& e, bool timed_out) {
    failed_ = true;
    const bool comm_error = !timed_out && (comm_->remote_failed() || device_lost());
    // The transport's message names the work (describe_work) and what went wrong.
    const bool take_down = (timed_out || comm_error) && !blocking_wait_ && async_error_handling_ != 0;
    // With blocking wait the caller gets the watchdog's own message (as WorkNCCL::wait raises it).
    std::string message = timed_out    ? log_prefix() + "Watchdog caught collective operation timeout: " +
                                              e.what_without_backtrace()
                          : comm_error ? log_prefix() + e.what_without_backtrace()
                                       : log_prefix() + describe_work(r) + " failed: " + e.what_without_backtrace();
    if (timed_out) dump_trace_once();
    static const auto observed = reinterpret_cast<void (*)(const char*)>(dlsym(RTLD_DEFAULT, "mirage_fault_observed"));
    if (observed) {  // for the summary of a session with faults: which rank saw which error
      const std::string error = timed_out ? "watchdog timeout: " + describe_work(r) : e.what_without_backtrace();
      observed((std::string(take_down ? "taken down: " : "") + error).c_str());
    }
    if (take_down) {
      std::ostringstream log;
      const std::time_t now = std::time(nullptr);
      char stamp[32];
      std::strftime(stamp, sizeof(stamp), "%m%d %H:%M:%S", std::localtime(&now));
      const std::string line = "[rank" + std::to_string(my_global_rank()) + "]:[E" + stamp + " ProcessGroupNCCL.cpp] ";
      if (timed_out) log << line << message << "\n";
      else {
        log << line << log_prefix() << "Some NCCL operations have failed or timed out. Due to the "
            << "asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.\n";
      }
      log << line << log_prefix() << "To avoid data inconsistency, we are taking the entire process down.\n";
      if (comm_error) {
        log << line << log_prefix() << "Process group watchdog thread terminated with exception: "
            << e.what_without_backtrace() << "\n";
      }
      std::cerr << log.str() << std::flush;
      comm_->abort();  // the peers learn at once, as NCCL's proxy connections close with the process
      std::abort();
    }
    return std::make_exception_ptr(c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, message));
  }

  // Faults on purpose (--fault lose-gpu): whether this process's GPU was lost (mirage/shim/faults.h).
  static bool device_lost() {
    static const auto lost = reinterpret_cast<bool (*)()>(dlsym(RTLD_DEFAULT, "mirage_device_lost"));
    return lost && lost();
  }

  // TORCH_NCCL_DUMP_ON_TIMEOUT (on by default, with a trace buffer): the first timeout of the
  // process writes the flight recorder, pickled, where ProcessGroupNCCL's writes it (torch's
  // own DebugInfoWriter: TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE, else
  // ~/.cache/torch/comm_lib_trace_rank_<global rank>), for torch's fr_trace analyser.
  void dump_trace_once() {
    static std::atomic<bool> dumped{false};
    if (!env_flag("TORCH_NCCL_DUMP_ON_TIMEOUT", true) || trace().capacity == 0 || dumped.exchange(true)) return;
    c10d::DebugInfoWriter::getWriter(my_global_rank()).write(trace_pickle(true, false));
  }

  std::tuple<std::string, std::string> profiler_group() const { return {group_name(), getGroupDesc()}; }

  // The profiler's "record_param_comms" event with the operation's metadata, as ProcessGroupNCCL
  // records it (collective name, sizes, dtype, the group's ranks as start and stride).
  void record_param_comms(const Record& r, const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs) {
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
  static std::string param_comms_name(const Record& r) {
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

  static bool timed_out(const c10::Error& e) {
    return std::string(e.what_without_backtrace()).find("before timing out") != std::string::npos;
  }

  // Runs one collective: checks, sequence number, recorder, profiler event, the transfer, the Work.
  template <typename Fn>
  c10::intrusive_ptr<c10d::Work> collective(OpType type, const char* profiling, const char* name,
                                            const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs,
                                            std::chrono::milliseconds asked_timeout, std::string reduce_op, Fn&& run) {
    std::lock_guard<std::mutex> serial(collective_mu_);  // the communicator's stream: one at a time
    const auto timeout = timeout_for(asked_timeout);
    Record r = make_record(type, profiling, name, ins, outs, timeout, std::move(reduce_op), false);
    auto work = c10::make_intrusive<EmulatedWork>(rank_, type, profiling, ins, outs, r.seq, describe_work(r),
                                                  profiler_group(), size_);
    record_param_comms(r, ins, outs);
    if (measure_durations_) work->time_it();
    const auto& tensors = ins.empty() ? outs : ins;
    check_distinct_gpus(tensors);
    if (!tensors.empty()) barrier_device_ = tensors[0].device().index();
    timing_ = Timing{Clock::now() + timeout, timeout, describe_work(r), r.seq};
    r.started_ns = wall_ns();
    r.state = "started";
    keep_trace(r);
    record(r, true);
    std::exception_ptr error;
    const auto finished = [&] {
      r.completed_ns = wall_ns();
      r.state = "completed";
      finish_trace(r);
      record(r, false);
    };
    const bool clocked = shim_clock().on && barrier_device_ >= 0;
    if (clocked) timing_.ready_ns = shim_clock().ready(barrier_device_, comm_stream());
    try {
      inject_fault(r);
      comm_->check_usable(timing_.what);
      run();
    } catch (const c10::DistBackendError& e) {
      error = on_failure(r, e, timed_out(e));
    } catch (...) {  // an argument refused on the way: the operation ends here, with the error
      finished();
      throw;
    }
    finished();
    if (clocked && !error) {
      const auto [kind, bus_bytes] = bus_shape(r);
      const int64_t cost = shim_clock().cost_ns(kind, bus_bytes, size_, nodes_in_group_, nic_slowdown_);
      const int64_t end = shim_clock().collective(barrier_device_, comm_stream(), comm_->agreed_ready_ns(), cost,
                                                  profiling, bus_bytes);
      work->set_predicted_end(barrier_device_, comm_stream(), end);
    }
    work->complete(error);
    std::lock_guard<std::mutex> g(mu_);
    if (coalescing_) coalesced_.push_back(work);
    return work;
  }

  // Faults on purpose (mirage/shim/faults.h): the shim counts this process's collectives and kills
  // it at a kill fault's; a stall holds the collective here, on the communicator's stream, so the
  // peers wait inside theirs until their timeout, as behind a rank stuck in NCCL. On a lost GPU
  // (a lose-gpu fault, here or at an earlier op) the collective fails as NCCL's does when its
  // kernels cannot launch: ncclUnhandledCudaError.
  void inject_fault(const Record& r) {
    static const auto at_collective =
        reinterpret_cast<int64_t (*)()>(dlsym(RTLD_DEFAULT, "mirage_fault_at_collective"));
    const int64_t stall_ms = at_collective ? at_collective() : 0;
    if (stall_ms > 0) {
      LOG(WARNING) << log_prefix() << "mirage fault: stalling " << describe_work(r) << " for " << stall_ms << " ms";
      std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
    }
    const bool amd = std::string(library()) == "RCCL";
    TORCH_CHECK_WITH(DistBackendError, !device_lost(), "NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for "
                     "details), NCCL version ", nccl_version(), "\nncclUnhandledCudaError: Call to CUDA function "
                     "failed.\nLast error:\n", amd ? "HIP failure 'unknown error'" : "Cuda failure 999 'unknown error'");
  }

  // Clocked mode: the communicator's own stream (ProcessGroupNCCL takes one per device).
  int64_t comm_stream() {
    if (comm_stream_ < 0) comm_stream_ = shim_clock().new_stream();
    return comm_stream_;
  }

  // Clocked mode: point-to-point traffic with `peer` has a stream of its own, as ProcessGroupNCCL
  // gives each pair of ranks a communicator and stream (sends and receives of other pairs overlap).
  int64_t p2p_stream(int peer) {
    std::lock_guard<std::mutex> g(p2p_streams_mu_);
    auto [it, fresh] = p2p_streams_.emplace(peer, 0);
    if (fresh) it->second = shim_clock().new_stream();
    return it->second;
  }

  // The collective as nccl-tests size it: its kind (mirage::nccl::Kind) and the bytes its bus
  // factor applies to (the buffer for all_reduce, broadcast, reduce; the whole gathered or
  // scattered buffer for all_gather, reduce_scatter, all_to_all, gather, scatter).
  std::pair<int, int64_t> bus_shape(const Record& r) const {
    const std::string& name = r.name;
    const int64_t out_bytes = r.bytes_out;
    if (name.rfind("all_reduce", 0) == 0) return {static_cast<int>(Kind::kAllReduce), r.bytes};
    if (name.rfind("all_gather", 0) == 0) return {static_cast<int>(Kind::kAllGather), std::max(out_bytes, r.bytes * size_)};
    if (name.rfind("reduce_scatter", 0) == 0) return {static_cast<int>(Kind::kReduceScatter), std::max(r.bytes, out_bytes * size_)};
    if (name == "broadcast") return {static_cast<int>(Kind::kBroadcast), r.bytes};
    if (name == "reduce") return {static_cast<int>(Kind::kReduce), r.bytes};
    if (name == "gather") return {static_cast<int>(Kind::kGather), r.bytes * size_};
    if (name == "scatter") return {static_cast<int>(Kind::kScatter), out_bytes * size_};
    if (name.rfind("all_to_all", 0) == 0) return {static_cast<int>(Kind::kAllToAll), r.bytes};
    return {static_cast<int>(Kind::kBarrier), 0};
  }

  void gather_flat(const at::Tensor& out, const at::Tensor& in) {
    at::Tensor r = as_real(in), o = as_real(out);
    std::vector<char*> to;
    for (int k = 0; k < size_; ++k) to.push_back(data(o) + k * nbytes(r));
    comm_->all_gather(to, data(r), r.numel(), r.scalar_type(), timing_);
  }

  void scatter_flat(const at::Tensor& out, const at::Tensor& in, const Reduction& reduction) {
    at::Tensor r = as_real(in), o = as_real(out);
    comm_->reduce_scatter(data(o), data(r), o.numel(), o.scalar_type(), reduction, timing_);
  }

  // gather, scatter, all_to_all: send[r] goes to rank r, recv[r] comes from it.
  void exchange_pieces(Kind kind, int root, at::ScalarType dtype, const std::vector<std::pair<char*, size_t>>& send,
                       const std::vector<std::pair<char*, size_t>>& recv) {
    comm_->exchange_pieces(Call{kind, static_cast<int32_t>(dtype), root, 0, -1}, send, recv, timing_);
  }

  // NCCL refuses a communicator with two ranks on one GPU at its first collective; so do we.
  void check_distinct_gpus(const std::vector<at::Tensor>& tensors) {
    if (gpus_checked_) return;
    gpus_checked_ = true;
    const int device = tensors.empty() ? std::max(barrier_device_, 0) : tensors[0].device().index();
    const char* host = std::getenv("NCCL_HOSTID");
    const char* visible = std::getenv("MIRAGE_VISIBLE_GPUS");
    int node_gpu = device;
    if (visible && *visible) {
      std::stringstream list(visible);
      std::string item;
      for (int i = 0; std::getline(list, item, ','); ++i) {
        if (i == device) node_gpu = std::atoi(item.c_str());
      }
    }
    // Each rank's host, its GPU there, and its emulated node (for the cost of slow links).
    int64_t mine[3] = {static_cast<int64_t>(std::hash<std::string>{}(host ? host : "")), node_gpu,
                       env_int("MIRAGE_NODE_RANK", 0)};
    std::vector<int64_t> all(3 * static_cast<size_t>(size_));
    std::vector<char*> to;
    for (int r = 0; r < size_; ++r) to.push_back(reinterpret_cast<char*>(all.data() + 3 * r));
    Timing timing{Clock::now() + options_->timeout, options_->timeout, "the communicator's first collective"};
    comm_->all_gather(to, reinterpret_cast<const char*>(mine), 3, at::kLong, timing);
    std::vector<int64_t> hosts, nodes;
    for (int r = 0; r < size_; ++r) {
      hosts.push_back(all[3 * r]);
      nodes.push_back(all[3 * r + 2]);
    }
    if (shim_clock().on) nic_slowdown_ = shim_clock().link_slowdown(nodes.data(), static_cast<int>(nodes.size()));
    host_of_rank_ = hosts;
    node_of_rank_ = nodes;
    std::sort(hosts.begin(), hosts.end());
    nodes_in_group_ = static_cast<int>(std::unique(hosts.begin(), hosts.end()) - hosts.begin());
    for (int a = 0; a < size_; ++a) {
      for (int b = 0; b < a; ++b) {
        if (all[3 * a] == all[3 * b] && all[3 * a + 1] == all[3 * b + 1] && (a == rank_ || b == rank_)) {
          failed_ = true;
          TORCH_CHECK_WITH(DistBackendError, false, library(), " error: invalid usage (run with NCCL_DEBUG=WARN for "
              "details)\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
              "Duplicate GPU detected : rank ", a, " and rank ", b, " both on CUDA device ", node_gpu,
              " (mirage: emulated node ", host ? host : "?", "; give each rank its own GPU, e.g. "
              "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before the first collective)");
        }
      }
    }
  }

  // NCCL_DEBUG=INFO's line for a new communicator, as NCCL prints it, with what mirage adds.
  void log_init() const {
    char host[256] = "?";
    gethostname(host, sizeof(host) - 1);
    const int device = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
    std::string profile = std::getenv("MIRAGE_PROFILE") ? std::getenv("MIRAGE_PROFILE") : "?";
    profile = profile.substr(profile.rfind('/') + 1);
    profile = profile.substr(0, profile.rfind('.'));
    const char* node = std::getenv("MIRAGE_NODE_RANK");
    const char* local = std::getenv("LOCAL_RANK");
    std::ostringstream line;
    line << host << ":" << getpid() << " [" << device << "] " << library() << " INFO comm 0x" << instance()
         << " rank " << rank_ << " nRanks " << size_ << " node " << (node ? node : "0") << " localRank "
         << (local ? local : "0") << " cudaDev " << device << " profile " << profile << " group " << group_name()
         << " - Init COMPLETE (mirage emulated, transport " << comm_->transport() << ")\n";
    // Then each peer's path, as NCCL's channel set-up lines give it, and the NIC it uses.
    const std::string prefix = std::string(host) + ":" + std::to_string(getpid()) + " [" + std::to_string(device) + "] " +
                               library() + " INFO ";
    bool network = false;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const std::string path = comm_->peer_path(peer);
      network |= path.rfind("NET/", 0) == 0;
      line << prefix << "Channel 00/0 : " << rank_ << "[" << device << "] -> " << peer << " via " << path << "\n";
    }
    if (network) line << prefix << "NET/Socket : Using [0]" << socket_interface() << "<0>\n";
    // One write: ranks sharing a stderr (torchrun's) must not interleave their lines.
    const std::string text = line.str();
    (void)!::write(STDERR_FILENO, text.data(), text.size());
  }

  // ------------------------------------------------------------ the point-to-point worker

  struct Pending {
    c10::intrusive_ptr<EmulatedWork> work;
    Record record;
    Transfer transfer;
    int clock_device = -1;  // clocked mode: where, when ready and for how long
    int64_t ready_ns = 0, cost_ns = 0;
  };

  c10::intrusive_ptr<c10d::Work> point_to_point(std::vector<at::Tensor>& tensors, int peer, bool sending) {
    const at::Tensor& t = single(tensors);
    TORCH_CHECK_WITH(DistBackendError, !stopping_, "the process group was destroyed or aborted");
    // (A rank may send to itself, as NCCL allows within a batch: its own ring carries it.)
    TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "Invalid ", sending ? "destination" : "source", " rank ", peer,
                      " for a group of ", size_, " (this rank ", rank_, ")");
    const auto timeout = timeout_for(c10d::kUnsetTimeout);
    std::string profiling = std::string(sending ? "nccl:send " : "nccl:recv ") + std::to_string(rank_) +
                            (sending ? "->" : "<-") + std::to_string(peer);
    Pending p;
    {
      std::lock_guard<std::mutex> g(mu_);
      p.record = make_record(sending ? OpType::SEND : OpType::RECV, profiling.c_str(), sending ? "send" : "recv",
                             tensors, tensors, timeout, "", true);
    }
    p.record.peer = peer;
    p.work = c10::make_intrusive<EmulatedWork>(rank_, p.record.type, profiling.c_str(), tensors, tensors, p.record.seq,
                                               describe_work(p.record), profiler_group(), size_);
    record_param_comms(p.record, tensors, tensors);
    if (measure_durations_) p.work->time_it();
    p.transfer = Transfer{sending, peer, data(t), static_cast<size_t>(nbytes(t)), Clock::now() + timeout, timeout};
    if (shim_clock().on && t.is_cuda()) {
      // Clocked mode: a send leaves when this rank's stream reaches it, its clock in the message's
      // header; the receive ends once both sides are there (set when the message arrives).
      p.clock_device = t.device().index();
      const bool across = static_cast<size_t>(peer) < host_of_rank_.size() && host_of_rank_[peer] != host_of_rank_[rank_];
      double slowdown = 1.0;  // a slow link between the two ranks' nodes (--fault slow-link)
      if (across && static_cast<size_t>(peer) < node_of_rank_.size()) {
        const int64_t pair[2] = {node_of_rank_[rank_], node_of_rank_[peer]};
        slowdown = shim_clock().link_slowdown(pair, 2);
      }
      p.cost_ns = shim_clock().cost_ns(9, nbytes(t), 2, across ? 2 : 1, slowdown);
      p.ready_ns = shim_clock().ready(p.clock_device, p2p_stream(peer));
      if (sending) {
        p.transfer.clock = p.ready_ns;
        p.work->set_predicted_end(p.clock_device, p2p_stream(peer),
                                  shim_clock().collective(p.clock_device, p2p_stream(peer), p.ready_ns, p.cost_ns,
                                                          "nccl:send", nbytes(t)));
      }
    }
    keep_trace(p.record);
    record(p.record, true);
    c10::intrusive_ptr<EmulatedWork> work = p.work;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (coalescing_) coalesced_.push_back(work);
      queue_.push_back(std::move(p));
      if (!worker_.joinable()) worker_ = std::thread([this] { run_worker(); });
    }
    queue_cv_.notify_one();
    comm_->interrupt_transfer();
    return work;
  }

  void run_worker() {
    std::vector<Pending> active;
    std::vector<Transfer> transfers;
    const auto take_new = [&](std::vector<Transfer>& list) {
      std::lock_guard<std::mutex> g(mu_);
      // Destroying or aborting the group ends what is still pending, as ncclCommAbort does.
      TORCH_CHECK_WITH(DistBackendError, !stopping_, "the process group was destroyed or aborted while it was "
                       "pending");
      while (!queue_.empty()) {
        active.push_back(std::move(queue_.front()));
        queue_.pop_front();
        list.push_back(active.back().transfer);
      }
    };
    const auto finished = [&](size_t i) {
      Pending& done = active[i];
      if (done.clock_device >= 0 && !done.transfer.send) {  // both sides there: from the later one
        const int64_t start = std::max(done.ready_ns, transfers[i].header.clock);
        const int64_t stream = p2p_stream(done.transfer.peer);
        done.work->set_predicted_end(done.clock_device, stream,
                                     shim_clock().collective(done.clock_device, stream, start, done.cost_ns,
                                                             "nccl:recv", static_cast<int64_t>(done.transfer.bytes)));
      }
      active[i].record.completed_ns = wall_ns();
      active[i].record.state = "completed";
      finish_trace(active[i].record);
      record(active[i].record, false);
      active[i].work->complete();
    };
    while (true) {
      {
        std::unique_lock<std::mutex> g(mu_);
        queue_cv_.wait(g, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
      }
      active.clear();
      transfers.clear();
      take_new(transfers);
      try {
        comm_->transfer(transfers, 0, "point-to-point " + describe_work(active[0].record), take_new, finished);
      } catch (const c10::DistBackendError& e) {
        for (size_t i = 0; i < active.size(); ++i) {
          if (transfers[i].finished()) continue;
          record(active[i].record, false);
          active[i].work->complete(on_failure(active[i].record, e, timed_out(e)));
        }
      }
    }
  }

  void stop_worker() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    if (worker_.joinable()) {
      if (worker_.get_id() == std::this_thread::get_id()) worker_.detach();
      else worker_.join();
    }
    // What the worker never took fails as well, as ncclCommAbort fails everything pending.
    std::deque<Pending> left;
    {
      std::lock_guard<std::mutex> g(mu_);
      left.swap(queue_);
    }
    for (auto& p : left) {
      record(p.record, false);
      p.work->complete(std::make_exception_ptr(c10::DistBackendError(
          c10::SourceLocation{__func__, __FILE__, __LINE__},
          log_prefix() + describe_work(p.record) + " failed: the process group was destroyed or aborted while it "
          "was pending")));
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<Options> options_;
  uint64_t uid_;
  std::unique_ptr<Communicator> comm_;
  bool blocking_wait_ = false;
  std::atomic<bool> measure_durations_{false};  // Works measure their duration
  int async_error_handling_ = 3;
  std::chrono::milliseconds ephemeral_timeout_{0};
  std::mutex collective_mu_;
  Timing timing_;  // of the collective in progress (under collective_mu_)
  std::atomic<uint64_t> seq_{0}, p2p_seq_{0};
  int shrinks_ = 0;  // this communicator's shrinks so far (each forms under a key of its own)
  bool gpus_checked_ = false;
  int nodes_in_group_ = 1;               // emulated nodes the group spans (from the first collective)
  double nic_slowdown_ = 1.0;            // --fault slow-link between two of them (clocked mode)
  std::vector<int64_t> host_of_rank_;    // each rank's node (its NCCL_HOSTID's hash)
  std::vector<int64_t> node_of_rank_;    // each rank's emulated node (MIRAGE_NODE_RANK)
  int64_t comm_stream_ = -1;             // clocked mode: the communicator's stream
  std::mutex p2p_streams_mu_;
  std::map<int, int64_t> p2p_streams_;   // clocked mode: a stream per point-to-point peer
  int barrier_device_ = -1;  // see barrier()
  std::atomic<bool> failed_{false};
  std::mutex mu_;  // coalescing state and the point-to-point queue
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<EmulatedWork>> coalesced_;
  std::deque<Pending> queue_;
  std::condition_variable queue_cv_;
  bool stopping_ = false;
  std::thread worker_;
};

namespace {
// The process's recent operations as ProcessGroupNCCL's flight recorder dump (its keys and
// version; pickled as torch pickles it), for _dump_nccl_trace and the dump on timeout.
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
}  // namespace

}  // namespace mirage::nccl

namespace {

// As torch's own bindings hold backends: the last reference dropped without the GIL.
template <typename T>
class NoGilHolder {
 public:
  NoGilHolder() = default;
  /* implicit */ NoGilHolder(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  explicit NoGilHolder(T* impl) : impl_(c10::intrusive_ptr<T>::unsafe_steal_from_new(impl)) {}
  ~NoGilHolder() {
    if (impl_ && PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      impl_.reset();
    }
  }
  NoGilHolder(const NoGilHolder&) = default;
  NoGilHolder(NoGilHolder&&) noexcept = default;
  NoGilHolder& operator=(const NoGilHolder&) = default;
  NoGilHolder& operator=(NoGilHolder&&) noexcept = default;
  T* get() const noexcept { return impl_.get(); }
  T& operator*() const noexcept { return *impl_; }
  T* operator->() const noexcept { return impl_.get(); }

 private:
  c10::intrusive_ptr<T> impl_;
};

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilHolder<T>, true)

// ProcessGroupNCCL.NCCL_CTA_POLICY_* (ncclConfig_t's CTA policies).
static const int kCtaDefault = 0, kCtaEfficiency = 1, kCtaZero = 2;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using mirage::nccl::NCCLConfig;
  using mirage::nccl::Options;
  using mirage::nccl::ProcessGroupNCCL;
  m.doc() = "mirage's emulated NCCL: a c10d backend over same-host shared memory";
  py::module::import("torch._C._distributed_c10d");  // registers the base classes

  auto pg = py::class_<ProcessGroupNCCL, c10d::Backend, NoGilHolder<ProcessGroupNCCL>>(m, "ProcessGroupNCCL");
  py::class_<NCCLConfig, c10::intrusive_ptr<NCCLConfig>>(pg, "NCCLConfig")
      .def(py::init<>())
      .def_readwrite("blocking", &NCCLConfig::blocking)
      .def_readwrite("cga_cluster_size", &NCCLConfig::cga_cluster_size)
      .def_readwrite("min_ctas", &NCCLConfig::min_ctas)
      .def_readwrite("max_ctas", &NCCLConfig::max_ctas)
      .def_readwrite("net_name", &NCCLConfig::net_name)
      .def_readwrite("split_share", &NCCLConfig::split_share)
      .def_readwrite("cta_policy", &NCCLConfig::cta_policy);
  py::class_<Options, c10d::Backend::Options, c10::intrusive_ptr<Options>>(pg, "Options")
      .def(py::init<bool>(), py::arg("is_high_priority_stream") = false)
      .def_readwrite("is_high_priority_stream", &Options::is_high_priority_stream)
      .def_readwrite("config", &Options::config)
      .def_readwrite("split_from", &Options::split_from)
      .def_readwrite("split_color", &Options::split_color)
      .def("__copy__", [](const Options& self) { return c10::make_intrusive<Options>(self); })
      .def("__deepcopy__", [](const Options& self, py::dict) { return c10::make_intrusive<Options>(self); });
  pg.def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     c10::intrusive_ptr<Options> options) {
           return c10::make_intrusive<ProcessGroupNCCL>(store, rank, size, std::move(options));
         }),
         py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options") = c10::make_intrusive<Options>(),
         py::call_guard<py::gil_scoped_release>())
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             auto options = c10::make_intrusive<Options>();
             options->timeout = timeout;
             return c10::make_intrusive<ProcessGroupNCCL>(store, rank, size, std::move(options));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("options", &ProcessGroupNCCL::options)
      .def_property_readonly("uid", &ProcessGroupNCCL::uid)
      .def_property_readonly("_instance", &ProcessGroupNCCL::instance)
      .def("_add_ephemeral_timeout", &ProcessGroupNCCL::add_ephemeral_timeout)
      .def("_set_default_timeout", [](ProcessGroupNCCL& self, std::chrono::milliseconds t) { self.setTimeout(t); })
      .def("_group_start", [](ProcessGroupNCCL& self) { self.startCoalescing(); })
      .def("_group_end", [](ProcessGroupNCCL& self) { self.endCoalescing(); })
      .def("comm_split_count", [](ProcessGroupNCCL&) { return 0; })
      .def("_is_initialized", [](ProcessGroupNCCL&) { return true; })
      .def("perform_nocolor_split", [](ProcessGroupNCCL&, at::Device) {})
      .def("_verify_work_timeout", [](ProcessGroupNCCL&, const c10::intrusive_ptr<c10d::Work>&,
                                      std::chrono::milliseconds) { return false; })
      .def("_shutdown", [](ProcessGroupNCCL& self) { self.shutdown(); }, py::call_guard<py::gil_scoped_release>())
      .def_readonly_static("NCCL_CTA_POLICY_DEFAULT", &kCtaDefault)
      .def_readonly_static("NCCL_CTA_POLICY_EFFICIENCY", &kCtaEfficiency)
      .def_readonly_static("NCCL_CTA_POLICY_ZERO", &kCtaZero);
  py::class_<mirage::nccl::GlooOnDevice, c10d::Backend, NoGilHolder<mirage::nccl::GlooOnDevice>>(m, "GlooOnDevice")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& gloo) {
        return c10::make_intrusive<mirage::nccl::GlooOnDevice>(gloo);
      }));
  m.def("_set_session_fd", &ProcessGroupNCCL::set_session_fd);
  m.def("_set_nccl_version", [](const std::string& version) { mirage::nccl::nccl_version() = version; });
  m.def("_trace_pickle", [](bool include_collectives, bool only_active) {
    return py::bytes(mirage::nccl::trace_pickle(include_collectives, only_active));
  }, py::arg("include_collectives") = true, py::arg("only_active") = false);
}
