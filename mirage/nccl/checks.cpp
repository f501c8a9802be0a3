// The checks NCCL makes (checks.h): of a call's arguments, as ProcessGroupNCCL makes them before
// a kernel launch, and at a communicator's first collective, of its ranks' GPUs.

#include "checks.h"

#include "clock.h"
#include "process_group.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>

namespace mirage::nccl {
namespace {

using Op = c10d::ReduceOp::RedOpType;

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

}  // namespace

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

// ProcessGroupNCCL's checkSingleTensor.
void check_tensor(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cuda() && !t.is_sparse(), "Tensors must be CUDA and dense");
  TORCH_CHECK_VALUE(t.is_contiguous(t.suggest_memory_format()), "Tensors must be contiguous");
  TORCH_CHECK_TYPE(nccl_has(t.scalar_type()), "Input tensor data type is not supported for NCCL process group: ",
                   t.scalar_type());
}

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

const at::Tensor& ProcessGroupNCCL::single(std::vector<at::Tensor>& tensors) const {
  TORCH_CHECK_VALUE(tensors.size() == 1, "Expecting one tensor only but got multiple");
  check_tensor(tensors[0]);
  return tensors[0];
}

void ProcessGroupNCCL::check_list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* what) const {
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == size_, "Tensor list input to scatter/gather must match number "
                    "of collective participants but got ", list.size(), " ", what, "s for ", size_, " ranks");
  for (const auto& t : list) {
    check_tensor(t);
    TORCH_CHECK_VALUE(t.dtype() == like.dtype(), "Tensors must have identical type");
  }
}

void ProcessGroupNCCL::check_root(int root) const {
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "Invalid rootRank ", root, " for a group of ", size_);
}

// NCCL refuses a communicator with two ranks on one GPU at its first collective; so do we.
void ProcessGroupNCCL::check_distinct_gpus(const std::vector<at::Tensor>& tensors) {
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
  with_payload().all_gather(to, reinterpret_cast<const char*>(mine), 3, at::kLong, timing);
  std::vector<int64_t> hosts, nodes;
  // --stand-ins: a member of a stood-in replica is on a host of its own, a member stood in for on
  // its node is on its stand-in's host at the GPU as far from its stand-in's as its rank, and
  // every member's node is the full job's (its global rank's, torchrun numbering the ranks node by node)
  const std::vector<uint64_t> members = stand_ins_map_ ? group_ranks() : std::vector<uint64_t>{};
  const int64_t ranks_per_node = std::max(1, env_int("LOCAL_WORLD_SIZE", 1));
  for (int r = 0; r < size_; ++r) {
    if (stand_ins_map_) {
      if (const int replica = stand_ins_map_->node_replica[r]) {
        all[3 * r] = static_cast<int64_t>(std::hash<std::string>{}(std::to_string(all[3 * r]) + "/" +
                                                                     std::to_string(replica)));
      }
      all[3 * r + 1] += stand_ins_map_->local_offset[r];
      all[3 * r + 2] = static_cast<int64_t>(members[r]) / ranks_per_node;
    }
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

}  // namespace mirage::nccl
