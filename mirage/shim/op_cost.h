// The cost model of clocked mode: how long a kernel, a copy or a collective takes on the
// profiled GPU. Every number comes from the profile's [timing] table (or the user's tuning
// file), handed over by the runtime in MIRAGE_TIMING_MODEL; mirage/profiles says where each
// comes from. The formulas:
//   kernel      max(FLOPs / (peak(dtype) x GEMM or attention efficiency),
//                   bytes / (HBM bandwidth x memory efficiency)) + fixed kernel cost;
//               a GEMM of known shape: its output tiles in whole waves over the compute units,
//               each wave its main loop (a tile's FLOPs at each unit's share of the efficiency's
//               rate) plus an epilogue (a share of the time one wave's output tiles take to
//               store at the HBM bandwidth), and a grid too small to fill the units split along
//               K (cuBLAS's split-K), no split shorter than gemm_split_k_min
//               FLOPs from torch.utils.flop_counter's formulas (matmul family, convolution,
//               attention and their backwards); bytes: the tensors the kernel reads and writes;
//               the memory efficiency a streaming kernel's, or, for a kernel without FLOPs whose
//               tensors are not all dense and of one size, the lower one of PyTorch's general
//               (non-vectorized) path (KernelTraffic)
//   copy        bytes / host-link bandwidth (host <-> device), else as a memory-bound kernel
//   collective  latency + bytes x NCCL's bus factor / achievable bus bandwidth (nccl-tests'
//               busbw) within a node, the faster of NCCL's protocols (Simple: full bandwidth
//               after a longer latency; LL: a short latency at a fraction of it); across nodes the hierarchical algorithm's slower phase:
//               the node's links, or each GPU's NIC carrying its 1/g share between the nodes.
#pragma once

#include "device_clock.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace mirage {

struct CostModel {
  int64_t launch_ns;              // host time per kernel launch
  double kernel_fixed_ns;         // a kernel's fixed cost (launch latency, ramp, tail)
  double memory_bytes_per_ns;     // achievable HBM bandwidth
  double general_bytes_per_ns;    // the same on PyTorch's general path (KernelTraffic::general)
  double host_link_bytes_per_ns;  // achievable host <-> device bandwidth
  double flops_per_ns_bf16, flops_per_ns_fp16, flops_per_ns_fp8, flops_per_ns_fp32, flops_per_ns_tf32;
  double gemm_efficiency;         // the fraction of peak large GEMMs reach
  double gemm_efficiency_fp8;     // the same for FP8 GEMMs (a smaller fraction of a larger peak)
  double attention_efficiency;    // the fraction of peak fused attention reaches (softmax between its GEMMs)
  double attention_backward_efficiency;  // the same for its backward kernel
  double attention_causal_factor; // a causal kernel's rate per block it computes, over a non-causal one's
  double attention_backward_causal_factor;  // the same for the backward kernel
  int64_t attention_block_rows;   // query rows a fused attention kernel computes together
  // Each block of query rows' fixed work (loading it, rescaling and writing its output), in steps
  // of attention_block_rows keys swept, forward and backward; and the work per score besides its
  // two matmuls (exponential, row maximum, rescaling), in head dims of matmul work.
  double attention_block_overhead, attention_backward_block_overhead, attention_softmax_head_dims;
  // PyTorch's own FlashAttention-2 build (SDPA's flash kernels) against flash-attn's, whose figures
  // the efficiencies above are: its non-causal and causal kernels' speed over that package's.
  double torch_flash_attention_rate, torch_flash_attention_causal_rate;
  int64_t tile_m, tile_n, compute_units;
  double gemm_epilogue_share;     // the part of a wave's output store not hidden behind its main loop
  int64_t gemm_split_k_min;       // the least K one split of a split-K GEMM takes
  // What the runtime reports as sharedMemPerBlock and warpSize: which of SoftMax.cu's kernels a
  // row fits (softmax_traffic).
  int64_t shared_memory_per_block, warp_size;
  // The compute units a running NCCL kernel holds (one per channel): a GEMM overlapped with a
  // collective gets the rest, in more waves (profile [timing] nccl_compute_units).
  int64_t nccl_compute_units;
  double bus_bytes_per_ns;        // achievable busbw within a node
  double nvls_bytes_per_ns;       // all_reduce's busbw with NVLink SHARP (0: the profile has none)
  double bus_latency_ns;          // a collective's fixed cost within a node (NCCL's Simple protocol)
  double ll_latency_ns;           // the same with NCCL's LL protocol (small messages)
  double ll_efficiency;           // the fraction of the bus bandwidth LL reaches
  double nic_bytes_per_ns;        // achievable busbw per GPU across nodes
  double nic_latency_ns;          // added per doubling of nodes
  double p2p_bytes_per_ns;        // one direction of one GPU's links (send/recv)
  // Faults on purpose (--fault slow-gpu / slow-link): this process's GPU runs its kernels this
  // many times slower (a straggler: thermal throttling, a bad part), and the links between
  // pairs of emulated nodes carry this many times less (a degraded link).
  double gpu_slowdown = 1.0;
  struct SlowLink {
    int64_t a, b;
    double factor;
  };
  std::vector<SlowLink> slow_links;
};
const CostModel& cost_model();

struct KernelCost {
  int64_t ns;
  WorkKind kind;
  Beside beside;  // the same kernel while a collective runs beside it
};
// What a kernel's FLOPs run at: a GEMM's efficiency, or fused attention's (lower: its softmax
// and rescaling sit between the two GEMMs on the critical path), whose backward kernel has an
// efficiency of its own (lower again: FlashAttention-2's backward on H100 reaches 214-322 TFLOP/s
// where its forward reaches 309-370, docs/validation.md).
enum class ComputeKind { kGemm, kAttention, kAttentionBackward };
// What a kernel reads and writes, and whether PyTorch's vectorized fast path could take it: an
// elementwise kernel over tensors that are all dense (contiguous, or permuted without gaps), of
// one size and laid out alike loads whole vectors (TensorIterator coalesces them to one dimension:
// TensorIteratorBase::is_contiguous, which gpu_kernel_impl asks); a broadcast, a strided view (a
// chunk, a slice), two dense tensors in different orders (a transposed view beside a contiguous
// one, a copy that transposes), a reduction or a gather goes through the general path, at a lower
// bandwidth (profile memory_efficiency_general: eager SwiGLU over torch.chunk halves, on H100).
// Tensors of a list argument (foreach and fused optimizers, cat) may differ in size:
// multi_tensor_apply vectorizes each.
struct KernelTraffic {
  int64_t bytes = 0;
  int64_t numel = -1;    // the size every tensor outside lists has so far (-1: none yet)
  bool general = false;  // some tensor is not dense, not of that size, or laid out otherwise
  void add(const at::Tensor& t, bool in_list = false) {
    bytes += static_cast<int64_t>(t.numel() * t.itemsize());
    if (general) return;
    if (!t.is_non_overlapping_and_dense()) {
      general = true;
    } else if (!in_list) {
      if (numel < 0) {
        numel = t.numel();
        sizes.assign(t.sizes().begin(), t.sizes().end());
        strides.assign(t.strides().begin(), t.strides().end());
      }
      general = t.numel() != numel || !laid_out_alike(t);
    }
  }

 private:
  c10::SmallVector<int64_t, 6> sizes, strides;  // the first tensor's, which the others' are held to
  // Whether `t` walks memory in the first tensor's order: its strides equal where the sizes are
  // one shape (a dimension of size 1 has any stride). Tensors of one size in different shapes
  // (a flat buffer beside its view) have no dimensions to compare and are taken as alike.
  bool laid_out_alike(const at::Tensor& t) const {
    if (!t.sizes().equals(sizes)) return true;
    for (size_t d = 0; d < sizes.size(); ++d)
      if (sizes[d] != 1 && t.strides()[d] != strides[d]) return false;
    return true;
  }
};

// A GEMM's shape as the cost model needs it: its output tiles (over the batch) and its K.
// tiles == 0: not a GEMM, or one whose shape is not known (a compiled graph's matmul).
struct GemmShape {
  int64_t tiles = 0;
  int64_t k = 0;
};
// `gemm`: the kernel's GEMM shape (waves, epilogues, split-K). `general`: the kernel takes
// PyTorch's general path (KernelTraffic); only a kernel without FLOPs is slowed by it.
// `kernels`: how many kernels the operator launches back to back (each pays the fixed cost).
KernelCost kernel_cost(double flops, int64_t bytes, at::ScalarType dtype, GemmShape gemm,
                       ComputeKind compute = ComputeKind::kGemm, bool general = false, int kernels = 1);

// An operator whose CUDA implementation moves other bytes than its arguments and results, or
// runs more than one kernel over them: what it moves beyond them (negative where it leaves an
// argument unread) and its kernels beyond the first. LayerNorm's and RMSNorm's backward
// (aten/src/ATen/native/cuda/layer_norm_kernel.cu, LayerNormBackwardKernelImplInternal) compute
// the input's gradient in one kernel and the weight's (and bias's) in another, and each reads the
// output's gradient and the input. Softmax and log-softmax re-read long rows (softmax_traffic).
// NLL loss (aten/src/ATen/native/cuda/Loss.cu) reads the input only at the targets' classes, and
// its backward never reads it: it zeroes the input's gradient (a fill kernel) and writes the
// targets' entries.
struct ImplementationTraffic {
  int64_t bytes = 0;
  int kernels = 0;
  bool vectorized = false;  // its bulk is a vectorized kernel (a fill) whatever its arguments' shapes
};
// Whether `schema` is such an operator (read once per operator: the op path keeps it in its traits).
bool has_implementation_traffic(const c10::FunctionSchema& schema);
// Its traffic for one call (a norm's: none when the call asks for no weight or bias gradient).
ImplementationTraffic implementation_traffic(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                                             const c10::IValue* results, size_t num_results);
// Softmax's and log-softmax's, forward and backward (`op` one of aten::_softmax, _log_softmax,
// _softmax_backward_data, _log_softmax_backward_data; `args` its arguments), as
// aten/src/ATen/native/cuda/SoftMax.cu runs them. Softmax's backward first multiplies the output's
// gradient by the output in a kernel of its own (softmax_backward_cuda_out; log-softmax's does
// not), then runs the backward kernel on that product and the output. A kernel whose row (along
// the last dim) fits neither the persistent warp kernel (2048 elements and 8 KiB; 1024 and 4 KiB
// for a widening forward or any backward), nor registers (a forward over at most 9 x 1024
// elements, not widening), nor a block's shared memory (sharedMemPerBlock) reads it from global
// memory once per pass: the forward its input three times (maximum, sum of exponentials,
// output: cunn_SoftMaxForward), the backward its gradient twice (sum, input's gradient:
// cunn_SoftMaxBackward); so does the spatial kernel (softmax over any other dim) always.
ImplementationTraffic softmax_traffic(const std::string& op, const c10::IValue* args);
// A copy within device memory (read and write: a memory-bound kernel). `general`: one PyTorch
// cannot do as one memcpy or vectorized kernel (a strided side, a broadcast source).
KernelCost device_copy_cost(int64_t bytes, bool general = false);
// The same, or over the host link when `crosses_host`.
int64_t copy_cost_ns(int64_t bytes, bool crosses_host, bool general = false);
// The share of the HBM bandwidth a collective of `kind` (mirage::nccl::Kind) over `bytes` among
// `ranks` takes while it runs for `cost_ns` (Beside): twice what its links carry each way.
double collective_hbm_share(int kind, int64_t bytes, int ranks, int64_t cost_ns);

// torch.utils.flop_counter's count for one call of `op` (its registry, through the Python
// operator mirage::flop_count the runtime implements); cached per operator and argument shapes.
bool has_flop_formula(const c10::FunctionSchema& schema);
double flop_count(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                  const c10::IValue* results, size_t num_results);
// A GEMM operator's shape (its output tiles and K); {} for other operators.
GemmShape gemm_shape(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                     const c10::IValue* results, size_t num_results);

// The share of a full (non-causal) attention's time a causal fused kernel takes over `seq_q` x
// `seq_k`: it skips the blocks above the diagonal but computes whole the blocks of
// attention_block_rows query rows the diagonal crosses, (r + 1) / 2r of the work for r blocks of
// rows (FlashAttention-2's 128-row blocks: 5/8 at 512 tokens, 129/256 at 16k; queries and keys of
// different lengths: 1/2), and computes them at attention_causal_factor (the backward kernel's,
// for kind kAttentionBackward) of a non-causal kernel's rate (the diagonal blocks' masking, query
// blocks of unequal work).
double causal_share(int64_t seq_q, int64_t seq_k, ComputeKind kind);

// The time of a fused attention kernel over `seq_q` x `seq_k` at `head_dim`, as a multiple of its
// non-causal FLOPs' time at the efficiency of `kind` (measured at head dim 128 on long sequences):
// causal_share for a causal kernel; (n + overhead) / n for its blocks of query rows, which sweep n
// steps of attention_block_rows keys on average and pay a fixed share each
// (attention_block_overhead, or the backward's); and (1 + s / d) / (1 + s / 128) for its scores'
// work besides their matmuls, s = attention_softmax_head_dims, d the head dim (at most 128: no
// figure above it was used).
double attention_time_factor(int64_t seq_q, int64_t seq_k, int64_t head_dim, bool causal, ComputeKind kind);
// The last two of those for a kernel whose blocks of query rows sweep `keys_swept` keys on average
// (FlexAttention's, by the blocks its BlockMask lists).
double attention_block_factor(double keys_swept, int64_t head_dim, ComputeKind kind);

// An SDPA attention kernel's speed against flash-attn's FlashAttention-2, whose figures the
// efficiencies are: the profile's torch_flash_attention_rate (or its causal one) for PyTorch's own
// flash kernels, 1 for the others (the memory-efficient ones: no measurement of them is used), or
// a benchmark's stand-in rate while attention_rate_begin holds.
double fused_attention_rate(bool pytorch_flash, bool causal);

// A fused kernel written over ATen (flash attention): its place on the timeline as one kernel,
// FLOPs from `op`'s formula over its leading tensor arguments, halved for causal attention (the
// fused kernels skip the masked half; torch's formula counts it), its time those FLOPs' at the
// efficiency of `kind` times attention_time_factor over `seq_q` query and `seq_k` key positions at
// the head dim of its first input, over fused_attention_rate. Call with a KernelScope held around
// the kernel's ATen work, and only when that scope is the outermost.
void clock_fused_kernel(const char* op, std::initializer_list<at::Tensor> inputs,
                        std::initializer_list<at::Tensor> outputs, bool causal, int64_t seq_q, int64_t seq_k,
                        ComputeKind kind);

// A kernel without FLOPs that mirage computes as several ops (CUDA's fused dropout, a widening
// softmax, SyncBatchNorm's kernels, an extension's kernel a workload stands in for): its place
// on the timeline as one kernel named `name` moving `bytes` (or `kernels` back to back, each
// paying a kernel's fixed cost). Call with a KernelScope held around its ops, and only when that
// scope is the outermost. `name` must outlive the process's trace.
void clock_memory_kernel(const char* name, DeviceIndex dev, int64_t bytes, at::ScalarType dtype, int kernels = 1);

}  // namespace mirage
