// What both transports share: the reductions, the call comparison, the failure reports.

#include "transport.h"

#include <algorithm>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <sstream>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <type_traits>

namespace mirage::nccl {

using Op = c10d::ReduceOp::RedOpType;

const char* kind_name(Kind kind) {
  static const char* const kNames[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                       "gather", "scatter", "all_to_all", "barrier"};
  auto i = static_cast<size_t>(kind);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "?";
}

const char* reduce_op_name(c10d::ReduceOp::RedOpType op) {
  static const char* const kNames[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  auto i = static_cast<size_t>(op);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "UNUSED";
}

namespace {

// acc = acc (op) x, elementwise. Plain loops (vectorised by the compiler), not ATen kernels:
// those would wake intra-op threads, and with more ranks than cores the peers need every core.
template <typename T>
void accumulate(T* __restrict acc, const T* __restrict x, int64_t n, Op op) {
  switch (op) {
    case Op::SUM:
    case Op::AVG:
    case Op::PREMUL_SUM:
      for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + x[i];
      return;
    case Op::PRODUCT:
      for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] * x[i];
      return;
    default:
      break;
  }
  if constexpr (!c10::is_complex<T>::value) {
    // NaN wins, as in torch.minimum / torch.maximum (a != a only for NaN).
    switch (op) {
      case Op::MIN:
        for (int64_t i = 0; i < n; ++i) acc[i] = (acc[i] != acc[i] || acc[i] < x[i]) ? acc[i] : x[i];
        return;
      case Op::MAX:
        for (int64_t i = 0; i < n; ++i) acc[i] = (acc[i] != acc[i] || acc[i] > x[i]) ? acc[i] : x[i];
        return;
      default:
        break;
    }
  }
  TORCH_CHECK_VALUE(false, "the emulated NCCL cannot apply this reduce op to ", c10::CppTypeToScalarType<T>::value);
}

// NCCL reduces bool as uint8 (ProcessGroupNCCL maps SUM to MAX and PRODUCT to MIN for it).
at::ScalarType reduced_as(at::ScalarType dtype) { return dtype == at::kBool ? at::kByte : dtype; }

std::string describe(const Call& c) {
  std::ostringstream text;
  text << kind_name(c.kind);
  if (c.kind == Kind::kBarrier) return text.str();
  text << " of ";
  if (c.numel >= 0) text << c.numel << " x ";
  text << c10::toString(static_cast<at::ScalarType>(c.dtype));
  switch (c.kind) {
    case Kind::kBroadcast: case Kind::kGather: case Kind::kScatter:
      text << ", root " << c.op_or_root;
      break;
    case Kind::kReduce:
      text << ", root " << (c.op_or_root >> 8) << ", op " << reduce_op_name(static_cast<Op>(c.op_or_root & 0xff));
      break;
    case Kind::kAllReduce: case Kind::kReduceScatter:
      text << ", op " << reduce_op_name(static_cast<Op>(c.op_or_root));
      break;
    default:
      break;
  }
  return text.str();
}

}  // namespace


void accumulate(at::ScalarType dtype, char* acc, const char* x, int64_t n, Op op) {
  AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND2(at::kHalf, at::kBFloat16, reduced_as(dtype), "mirage_nccl_reduce", [&] {
    accumulate(reinterpret_cast<scalar_t*>(acc), reinterpret_cast<const scalar_t*>(x), n, op);
  });
}

void scale(at::ScalarType dtype, char* data, int64_t n, const Reduction& reduction, int divisor) {
  AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND2(at::kHalf, at::kBFloat16, reduced_as(dtype), "mirage_nccl_scale", [&] {
    auto* d = reinterpret_cast<scalar_t*>(data);
    if (divisor) {
      const scalar_t by = static_cast<scalar_t>(divisor);
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] / by;
      return;
    }
    const scalar_t factor = reduction.factor_data ? *static_cast<const scalar_t*>(reduction.factor_data)
                                                  : static_cast<scalar_t>(reduction.factor);
    for (int64_t i = 0; i < n; ++i) d[i] = d[i] * factor;
  });
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void stream_copy(char* to, const char* from, size_t bytes) {
  const size_t head = (32 - reinterpret_cast<uintptr_t>(to) % 32) % 32;  // streaming stores want 32-byte alignment
  std::memcpy(to, from, head);
  size_t i = head;
  for (; i + 128 <= bytes; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i + 96), d);
  }
  _mm_sfence();  // the stores are visible before the copy is announced
  std::memcpy(to + i, from + i, bytes - i);
}
#endif

void copy_between_ranks(char* to, const char* from, size_t bytes) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && bytes >= kStreamingCopyBytes) return stream_copy(to, from, bytes);
#endif
  std::memcpy(to, from, bytes);
}

void Communicator::exchange_pieces(const Call& asked, const std::vector<Piece>& send, const std::vector<Piece>& recv,
                                   const Timing& timing) {
  agree(asked, timing);
  std::vector<Transfer> transfers;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      copy_own_piece(send[r], recv[r]);
      continue;
    }
    if (send[r].first) transfers.push_back(Transfer{true, r, send[r].first, send[r].second, timing.deadline, timing.timeout});
    if (recv[r].first) transfers.push_back(Transfer{false, r, recv[r].first, recv[r].second, timing.deadline, timing.timeout});
  }
  transfer(transfers, 1, timing.what);
}

void Communicator::copy_own_piece(const Piece& send, const Piece& recv) {
  if (!send.first || !recv.first) return;
  TORCH_CHECK_VALUE(send.second == recv.second, "the piece this rank sends itself (", send.second,
                    " bytes) differs from the piece it receives (", recv.second, " bytes)");
  std::memmove(recv.first, send.first, send.second);
}

void Communicator::check_usable(const std::string& what) const {
  check_not_aborted(what);
  TORCH_CHECK_WITH(DistBackendError, !unusable_, what, ": an earlier collective of this communicator failed (a "
                   "timeout, a desync or a peer that died or aborted); the communicator is aborted and cannot be used again, as with NCCL. "
                   "Destroy the process group and create a new one.");
}

// NCCL would silently mix a desync's data (or hang); gloo fails on the size. Here every rank
// sees every peer's call before any data moves, so all of them stop with the same report.
void Communicator::check_calls_match(const Call* calls, const Call& asked, const std::string& what) {
  bool all_match = true;
  for (int r = 0; r < size_ && all_match; ++r) all_match = calls[r] == asked;
  agreed_ready_ns_ = 0;
  for (int r = 0; r < size_; ++r) agreed_ready_ns_ = std::max(agreed_ready_ns_, calls[r].ready_ns);
  if (all_match) return;
  std::ostringstream report;
  for (int r = 0; r < size_; ++r) report << "\n  group rank " << r << ": " << describe(calls[r]);
  unusable_ = true;
  TORCH_CHECK_WITH(DistBackendError, false, what, ": the ranks' calls do not match (a desync: "
                   "NCCL would mix or hang here):", report.str());
}

void Communicator::fail_timeout(const Timing& timing, const std::vector<int>& missing, const char* waiting_for) {
  std::ostringstream ranks;
  const char* sep = "";
  for (int r : missing) {
    ranks << sep << r;
    sep = ", ";
  }
  unusable_ = true;
  const auto ran = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - (timing.deadline - timing.timeout));
  TORCH_CHECK_WITH(DistBackendError, false, timing.what, " ran for ", ran.count(),
                   " milliseconds before timing out: group rank(s) ", ranks.str(), " never ", waiting_for,
                   " (a rank that hung, died, or called a different collective). Raise `timeout=` in "
                   "init_process_group/new_group if they are just slow.");
}


std::string& nccl_version() {
  static std::string version = "2.27.5";
  return version;
}

bool process_ended(int64_t pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* stat = std::fopen(path, "r");
  if (!stat) return errno == ENOENT;
  char line[512] = {0};
  const size_t n = std::fread(line, 1, sizeof line - 1, stat);
  std::fclose(stat);
  const char* name_end = std::strrchr(line, ')');  // "pid (comm) S ...": the state follows the name
  return n > 0 && name_end && (name_end[2] == 'Z' || name_end[2] == 'X');
}

void Communicator::fail_remote(const std::string& last_error) {
  unusable_ = true;
  remote_failed_ = true;
  TORCH_CHECK_WITH(DistBackendError, false, "NCCL error: remote process exited or there was a network error, NCCL "
                   "version ", nccl_version(), "\nncclRemoteError: A call failed possibly due to a network error or a "
                   "remote process exiting prematurely.\nLast error:\n", last_error);
}

void Communicator::check_not_aborted(const std::string& what) const {
  TORCH_CHECK_WITH(DistBackendError, !aborted_, what, ": NCCL communicator was aborted on rank ", rank_, ".");
}

void Communicator::fail_size(const Transfer& t, const std::string& what) {
  unusable_ = true;
  TORCH_CHECK_WITH(DistBackendError, t.send, what, ": a receive of ", t.bytes, " bytes from group rank ", t.peer,
                   " matched a send of ", t.header.length, " bytes (a send and its recv must have the same size, as with NCCL)");
  TORCH_CHECK_WITH(DistBackendError, false, what, ": the send of ", t.bytes, " bytes to group rank ", t.peer,
                   " matched a receive of another size there (a send and its recv must have the same size, as with "
                   "NCCL)");
}

}  // namespace mirage::nccl
