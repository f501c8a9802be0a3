// The watchdog's part (process_group.h): each operation's deadline and description, what a
// failed or timed-out operation does (NCCL's messages; the process taken down unless the caller
// asked for the error: TORCH_NCCL_BLOCKING_WAIT, TORCH_NCCL_ASYNC_ERROR_HANDLING), the flight
// recorder's dump on the first timeout, and faults on purpose (--fault) at each collective.

#include "process_group.h"

#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>

#include <dlfcn.h>

#include <ctime>
#include <iostream>
#include <sstream>
#include <thread>

namespace mirage::nccl {

using c10d::OpType;

std::chrono::milliseconds ProcessGroupNCCL::timeout_for(std::chrono::milliseconds asked) const {
  auto t = asked == c10d::kUnsetTimeout ? options_->timeout + ephemeral_timeout_ : asked;
  return std::min<std::chrono::milliseconds>(t, std::chrono::hours(24 * 365));  // timedelta.max: forever enough
}

std::string ProcessGroupNCCL::describe_work(const Record& r) const {
  std::ostringstream text;
  text << "WorkNCCL(SeqNum=" << r.seq << ", OpType=" << op_type_name(r.type) << ", NumelIn=" << r.numel_in
       << ", NumelOut=" << r.numel_out << ", Timeout(ms)=" << r.timeout.count() << ")";
  return text.str();
}

std::string ProcessGroupNCCL::log_prefix() const {
  return "[PG ID " + std::to_string(uid_) + " PG GUID " + group_name() + "(" + getGroupDesc() + ") Rank " +
         std::to_string(rank_) + "] ";
}

// What the watchdog does with a failed operation: NCCL's timeout message, or for a
// communicator error (ncclRemoteError: a peer died or aborted; ncclUnhandledCudaError: this
// rank's GPU was lost) the watchdog's exception; then, unless the user asked for errors in the
// caller (TORCH_NCCL_BLOCKING_WAIT=1, or async error handling off), the process is taken down
// as ProcessGroupNCCL's watchdog takes it down.
std::exception_ptr ProcessGroupNCCL::on_failure(const Record& r, const c10::Error& e, bool timed_out) {
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
bool ProcessGroupNCCL::device_lost() {
  static const auto lost = reinterpret_cast<bool (*)()>(dlsym(RTLD_DEFAULT, "mirage_device_lost"));
  return lost && lost();
}

// TORCH_NCCL_DUMP_ON_TIMEOUT (on by default, with a trace buffer): the first timeout of the
// process writes the flight recorder, pickled, where ProcessGroupNCCL's writes it (torch's
// own DebugInfoWriter: TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE, else
// ~/.cache/torch/comm_lib_trace_rank_<global rank>), for torch's fr_trace analyser.
void ProcessGroupNCCL::dump_trace_once() {
  static std::atomic<bool> dumped{false};
  if (!env_flag("TORCH_NCCL_DUMP_ON_TIMEOUT", true) || trace().capacity == 0 || dumped.exchange(true)) return;
  c10d::DebugInfoWriter::getWriter(my_global_rank()).write(trace_pickle(true, false));
}

bool ProcessGroupNCCL::timed_out(const c10::Error& e) {
  return std::string(e.what_without_backtrace()).find("before timing out") != std::string::npos;
}

// Faults on purpose (mirage/shim/faults.h): the shim counts this process's collectives and kills
// it at a kill fault's; a stall holds the collective here, on the communicator's stream, so the
// peers wait inside theirs until their timeout, as behind a rank stuck in NCCL. On a lost GPU
// (a lose-gpu fault, here or at an earlier op) the collective fails as NCCL's does when its
// kernels cannot launch: ncclUnhandledCudaError.
void ProcessGroupNCCL::inject_fault(const Record& r) {
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

}  // namespace mirage::nccl
