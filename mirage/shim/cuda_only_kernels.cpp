// Operators a CUDA build has a CUDA kernel for and a CPU build has no kernel of its own for, which
// training code reaches: record_stream, the SyncBatchNorm family (torch/nn/modules/_functions.py
// calls them on the device), and the fused LSTM / GRU cells that nn.LSTM / nn.GRU / nn.LSTMCell
// run on a CUDA device without cuDNN (aten/src/ATen/native/cuda/RNN.cu), and the fused RMSNorm
// that F.rms_norm (nn.RMSNorm, torchtitan's and transformers' norms) calls on a CUDA device. Each follows its CUDA definition (aten/src/ATen/native/cuda/Normalization.cu):
// statistics in the accumulate type (float for half and bfloat16 inputs), biased variance
// inside invstd = 1 / sqrt(var + eps), the running variance updated with the unbiased one. They
// are written with ATen ops on the device tensors, so each step runs the CPU kernel in place
// through the shim's fallback.

#include "as_one_kernel.h"
#include "op_path.h"
#include "race_checker.h"

#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace mirage {
namespace {

using at::Tensor;

// Every dimension but the channels (dim 1): what batch norm reduces over.
std::vector<int64_t> reduced_dims(const Tensor& input) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector shaped to broadcast against the input: [1, C, 1, ...].
Tensor per_channel(const Tensor& v, const Tensor& input) {
  std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
  shape[1] = v.numel();
  return v.view(shape);
}

at::ScalarType acc_type(const Tensor& input) { return at::toAccumulateType(input.scalar_type(), /*is_cuda=*/true); }

std::tuple<Tensor, Tensor> batch_norm_stats(const Tensor& input, double eps) {
  const Tensor x = input.to(acc_type(input));
  const auto dims = reduced_dims(input);
  Tensor mean = x.mean(dims);
  Tensor var = (x - per_channel(mean, x)).square().mean(dims);
  return {mean, (var + eps).rsqrt()};
}

// Combines per-rank statistics (rows of mean / invstd, with each rank's element count) into the
// group's, and updates the running statistics in place.
std::tuple<Tensor, Tensor> gather_stats(const Tensor& mean, const Tensor& invstd, const std::optional<Tensor>& running_mean,
                                        const std::optional<Tensor>& running_var, double momentum, double eps,
                                        const Tensor& counts) {
  const Tensor n = counts.to(mean.scalar_type()).view({-1, 1});
  const Tensor total = n.sum();
  Tensor global_mean = (mean * n).sum(0) / total;
  const Tensor var_each = (invstd.square().reciprocal() - eps);
  Tensor var = ((var_each + (mean - global_mean).square()) * n).sum(0) / total;
  if (running_mean && running_mean->defined()) {
    running_mean->copy_(running_mean->mul(1 - momentum).add(global_mean.to(running_mean->scalar_type()), momentum));
  }
  if (running_var && running_var->defined()) {
    const Tensor unbiased = var * total / (total - 1);
    running_var->copy_(running_var->mul(1 - momentum).add(unbiased.to(running_var->scalar_type()), momentum));
  }
  return {global_mean, (var + eps).rsqrt()};
}

std::tuple<Tensor, Tensor> batch_norm_gather_stats_with_counts(const Tensor&, const Tensor& mean, const Tensor& invstd,
                                                               const std::optional<Tensor>& running_mean,
                                                               const std::optional<Tensor>& running_var,
                                                               double momentum, double eps, const Tensor& counts) {
  return gather_stats(mean, invstd, running_mean, running_var, momentum, eps, counts);
}

std::tuple<Tensor, Tensor> batch_norm_gather_stats(const Tensor&, const Tensor& mean, const Tensor& invstd,
                                                   const std::optional<Tensor>& running_mean,
                                                   const std::optional<Tensor>& running_var, double momentum, double eps,
                                                   int64_t count) {
  return gather_stats(mean, invstd, running_mean, running_var, momentum, eps,
                      at::full({mean.size(0)}, static_cast<double>(count), mean.options()));
}

Tensor batch_norm_elemt(const Tensor& input, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                        const Tensor& mean, const Tensor& invstd, double) {
  const at::ScalarType acc = acc_type(input);
  Tensor out = (input.to(acc) - per_channel(mean.to(acc), input)) * per_channel(invstd.to(acc), input);
  if (weight && weight->defined()) out = out * per_channel(weight->to(acc), input);
  if (bias && bias->defined()) out = out + per_channel(bias->to(acc), input);
  return out.to(input.scalar_type()).contiguous(input.suggest_memory_format());
}

Tensor& batch_norm_elemt_out(const Tensor& input, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                             const Tensor& mean, const Tensor& invstd, double eps, Tensor& out) {
  out.copy_(mirage::batch_norm_elemt(input, weight, bias, mean, invstd, eps));
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_backward_reduce(const Tensor& grad_out, const Tensor& input,
                                                                      const Tensor& mean, const Tensor& invstd,
                                                                      const std::optional<Tensor>& weight, bool input_g,
                                                                      bool weight_g, bool bias_g) {
  const at::ScalarType acc = acc_type(input);
  const auto dims = reduced_dims(input);
  const Tensor dy = grad_out.to(acc);
  const Tensor xmu = input.to(acc) - per_channel(mean.to(acc), input);
  Tensor sum_dy, sum_dy_xmu, grad_weight, grad_bias;
  if (input_g || weight_g || bias_g) {
    sum_dy = dy.sum(dims);
    sum_dy_xmu = (dy * xmu).sum(dims);
  }
  const at::ScalarType param = weight && weight->defined() ? weight->scalar_type() : input.scalar_type();
  if (weight_g) grad_weight = (sum_dy_xmu * invstd.to(acc)).to(param);
  if (bias_g) grad_bias = sum_dy.to(param);
  if (!input_g) sum_dy = sum_dy_xmu = Tensor();
  return {sum_dy, sum_dy_xmu, grad_weight, grad_bias};
}

Tensor batch_norm_backward_elemt(const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& invstd,
                                 const std::optional<Tensor>& weight, const Tensor& sum_dy, const Tensor& sum_dy_xmu,
                                 const Tensor& count) {
  const at::ScalarType acc = acc_type(input);
  const Tensor total = count.to(acc).sum();
  const Tensor inv = per_channel(invstd.to(acc), input);
  const Tensor mean_dy = per_channel(sum_dy.to(acc) / total, input);
  const Tensor mean_dy_xmu = per_channel(sum_dy_xmu.to(acc) / total, input);
  const Tensor xmu = input.to(acc) - per_channel(mean.to(acc), input);
  Tensor grad = (grad_out.to(acc) - mean_dy - xmu * inv.square() * mean_dy_xmu) * inv;
  if (weight && weight->defined()) grad = grad * per_channel(weight->to(acc), input);
  return grad.to(input.scalar_type()).contiguous(input.suggest_memory_format());
}

// Tensor.record_stream (FSDP, ZeRO-3 prefetch, overlap schemes): on a GPU it tells the caching
// allocator not to reuse the block until the stream's queued work is done. Emulated work runs
// when it is issued, so that work is done by the time the block is freed; --check-races notes
// it, since a block freed without it may be reused while the stream still works on it.
void record_stream(Tensor& self, c10::Stream stream) {
  if (mirage::races::on()) mirage::races::record_stream(self, stream);
}

// The fused LSTM cell: gates = input_gates + hidden_gates (+ both biases), i f g o activated,
// cy = f*cx + i*g, hy = o*tanh(cy); the workspace keeps the activated gates for the backward.
// Computed in the accumulate type, as the CUDA kernel does.
std::tuple<Tensor, Tensor, Tensor> fused_lstm_cell(const Tensor& input_gates, const Tensor& hidden_gates,
                                                   const Tensor& cx, const std::optional<Tensor>& input_bias,
                                                   const std::optional<Tensor>& hidden_bias) {
  const auto acc = acc_type(input_gates);
  Tensor gates = input_gates.to(acc) + hidden_gates.to(acc);
  if (input_bias && input_bias->defined()) gates = gates + input_bias->to(acc) + hidden_bias->to(acc);
  const auto chunks = gates.chunk(4, 1);
  const Tensor i = chunks[0].sigmoid(), f = chunks[1].sigmoid(), g = chunks[2].tanh(), o = chunks[3].sigmoid();
  const Tensor cy = f * cx.to(acc) + i * g;
  const Tensor hy = o * cy.tanh();
  const auto type = input_gates.scalar_type();
  return {hy.to(type), cy.to(type), at::cat({i, f, g, o}, 1).to(type)};
}

std::tuple<Tensor, Tensor, Tensor> fused_lstm_cell_backward_impl(const std::optional<Tensor>& grad_hy,
    const std::optional<Tensor>& grad_cy, const Tensor& cx, const Tensor& cy, const Tensor& workspace, bool has_bias) {
  if (!(grad_hy && grad_hy->defined()) && !(grad_cy && grad_cy->defined())) return {Tensor(), Tensor(), Tensor()};
  const auto acc = acc_type(workspace);
  const auto gates = workspace.to(acc).chunk(4, 1);
  const Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  const Tensor tanh_cy = cy.to(acc).tanh();
  const Tensor ghy = grad_hy && grad_hy->defined() ? grad_hy->to(acc) : at::zeros_like(tanh_cy);
  Tensor gcy = ghy * o * (1 - tanh_cy * tanh_cy);
  if (grad_cy && grad_cy->defined()) gcy = gcy + grad_cy->to(acc);
  const Tensor grad_gates = at::cat({gcy * g * i * (1 - i), gcy * cx.to(acc) * f * (1 - f), gcy * i * (1 - g * g),
                                     ghy * tanh_cy * o * (1 - o)}, 1);
  const auto type = workspace.scalar_type();
  const Tensor grad_bias = has_bias ? grad_gates.sum(0).to(type) : Tensor();
  return {grad_gates.to(type), (gcy * f).to(type), grad_bias};
}

// The fused GRU cell: r = sigmoid(ir + hr), z = sigmoid(iz + hz), n = tanh(in + r * hn),
// hy = n + z * (hx - n); the workspace keeps r, z, n, hx and hn (with its bias).
std::tuple<Tensor, Tensor> fused_gru_cell(const Tensor& input_gates, const Tensor& hidden_gates, const Tensor& hx,
                                          const std::optional<Tensor>& input_bias,
                                          const std::optional<Tensor>& hidden_bias) {
  const auto acc = acc_type(input_gates);
  Tensor in_gates = input_gates.to(acc), h_gates = hidden_gates.to(acc);
  if (input_bias && input_bias->defined()) {
    in_gates = in_gates + input_bias->to(acc);
    h_gates = h_gates + hidden_bias->to(acc);
  }
  const auto ic = in_gates.chunk(3, 1), hc = h_gates.chunk(3, 1);
  const Tensor r = (ic[0] + hc[0]).sigmoid(), z = (ic[1] + hc[1]).sigmoid();
  const Tensor n = (ic[2] + r * hc[2]).tanh();
  const Tensor h = hx.to(acc);
  const Tensor hy = n + z * (h - n);
  const auto type = input_gates.scalar_type();
  return {hy.to(type), at::cat({r, z, n, h, hc[2]}, 1).to(type)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_gru_cell_backward(const Tensor& grad_hy,
                                                                           const Tensor& workspace, bool has_bias) {
  const auto acc = acc_type(workspace);
  const auto w = workspace.to(acc).chunk(5, 1);
  const Tensor &r = w[0], &z = w[1], &n = w[2], &hx = w[3], &hn = w[4];
  const Tensor go = grad_hy.to(acc);
  const Tensor gz = go * (hx - n) * (1 - z) * z;
  const Tensor gin = go * (1 - z) * (1 - n * n);
  const Tensor gr = gin * hn * (1 - r) * r;
  const auto type = workspace.scalar_type();
  const Tensor grad_input = at::cat({gr, gz, gin}, 1), grad_hidden = at::cat({gr, gz, gin * r}, 1);
  Tensor grad_input_bias, grad_hidden_bias;
  if (has_bias) {
    grad_input_bias = grad_input.sum(0).to(type);
    grad_hidden_bias = grad_hidden.sum(0).to(type);
  }
  return {grad_input.to(type), grad_hidden.to(type), (go * z).to(type), grad_input_bias, grad_hidden_bias};
}

// aten::_fused_rms_norm_backward(Tensor grad_out, Tensor input, int[] normalized_shape, Tensor rstd,
// Tensor? weight, bool[2] output_mask) -> (Tensor, Tensor), on CPU views: a CUDA build's kernel
// (aten/src/ATen/native/cuda/layer_norm_kernel.cu) computes in the accumulate type, with x_hat =
// x * rstd and g = grad_out * weight: grad_input = (g - x_hat * mean(x_hat * g)) * rstd over the
// normalized dimensions, grad_weight = the sum of grad_out * x_hat over the others.
void fused_rms_norm_backward(torch::jit::Stack* stack) {
  const c10::List<bool> mask = torch::jit::pop(*stack).toBoolList();
  const std::optional<Tensor> weight = torch::jit::pop(*stack).toOptional<Tensor>();
  const Tensor rstd = torch::jit::pop(*stack).toTensor();
  const std::vector<int64_t> normalized_shape = torch::jit::pop(*stack).toIntVector();
  const Tensor input = torch::jit::pop(*stack).toTensor();
  const Tensor grad_out = torch::jit::pop(*stack).toTensor();
  const int64_t axis = input.dim() - static_cast<int64_t>(normalized_shape.size());
  std::vector<int64_t> inner, outer, stat_shape(input.sizes().begin(), input.sizes().end());
  for (int64_t d = 0; d < input.dim(); ++d) {
    if (d < axis) {
      outer.push_back(d);
    } else {
      inner.push_back(d);
      stat_shape[static_cast<size_t>(d)] = 1;
    }
  }
  const Tensor x_hat = input.to(acc_type(input)) * rstd.to(acc_type(input)).reshape(stat_shape);
  const Tensor dy = grad_out.to(acc_type(input));
  const bool has_weight = weight.has_value() && weight->defined();
  const Tensor g = has_weight ? dy * weight->to(acc_type(input)) : dy;
  Tensor grad_input, grad_weight;
  if (mask[0]) grad_input = ((g - x_hat * (x_hat * g).mean(inner, /*keepdim=*/true)) * rstd.reshape(stat_shape)).to(input.scalar_type());
  if (mask[1] && has_weight) {
    const Tensor product = dy * x_hat;
    grad_weight = (outer.empty() ? product : product.sum(outer)).to(weight->scalar_type());
  }
  stack->emplace_back(std::move(grad_input));
  stack->emplace_back(std::move(grad_weight));
}

// The matmuls with an `out_dtype` (mm.dtype, bmm.dtype, addmm.dtype, baddbmm.dtype and their out=
// variants; F.linear_cross_entropy's chunks take mm.dtype_out): cuBLAS multiplies float16 or
// bfloat16 inputs accumulating in float and writes a float result (Blas.cpp: _mm_dtype_out_cuda
// and its kin, whose checks and words these keep), so the host multiplies the inputs widened to
// the result's dtype. The stack holds CPU views of the device tensors.
void check_out_dtype(const Tensor& input, at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == input.scalar_type() ||
                  (out_dtype == at::kFloat && (input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16)),
              "out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs");
}

void check_out_tensor(const Tensor& out, at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == out.scalar_type(), "out_dtype must be the same as the dtype of the provided out tensor");
}

// batch1 @ batch2's checks (baddbmm_bmm_out_dtype_checks), `self` for baddbmm.
void check_batched_out_dtype(const Tensor& batch1, const Tensor& batch2, at::ScalarType out_dtype, const Tensor* self) {
  TORCH_CHECK(batch1.dim() == 3, "batch1 must be a 3D tensor");
  TORCH_CHECK(batch2.dim() == 3, "batch2 must be a 3D tensor");
  const int64_t bs = batch1.size(0), contraction = batch1.size(2);
  TORCH_CHECK(batch2.size(0) == bs && batch2.size(1) == contraction, "Expected size for first two dimensions of batch2 "
              "tensor to be: [", bs, ", ", contraction, "] but got: [", batch2.size(0), ", ", batch2.size(1), "].");
  TORCH_CHECK(batch1.scalar_type() == batch2.scalar_type(), "batch1 and batch2 must have the same dtype");
  check_out_dtype(batch1, out_dtype);
  if (self != nullptr) {
    TORCH_CHECK(self->dim() == 3, "self must be a 3D tensor");
    TORCH_CHECK(self->sizes() == c10::IntArrayRef({bs, batch1.size(1), batch2.size(2)}),
                "self must have the same shape as the output");
  }
}

void check_matrices(const Tensor& mat1, const Tensor& mat2, const char* first) {
  TORCH_CHECK(mat1.dim() == 2, first, " must be a matrix, got ", mat1.dim(), "-D tensor");
  TORCH_CHECK(mat2.dim() == 2, "mat2 must be a matrix, got ", mat2.dim(), "-D tensor");
  TORCH_CHECK(mat1.size(1) == mat2.size(0), "mat1 and mat2 shapes cannot be multiplied (", mat1.size(0), "x",
              mat1.size(1), " and ", mat2.size(0), "x", mat2.size(1), ")");
}

// `result` (computed in out_dtype) into the out= tensor, or as the op's result.
void push_result(torch::jit::Stack* stack, Tensor result, const std::optional<Tensor>& out) {
  if (out) {
    out->resize_(result.sizes()).copy_(result);
    result = *out;
  }
  stack->emplace_back(std::move(result));
}

// The out= variant's `out` (the stack's last argument), or none for the functional one.
template <bool kOut>
std::optional<Tensor> pop_out(torch::jit::Stack* stack) {
  if constexpr (kOut) return torch::jit::pop(*stack).toTensor();
  return std::nullopt;
}

template <bool kOut>
void mm_out_dtype(torch::jit::Stack* stack) {
  const std::optional<Tensor> out = pop_out<kOut>(stack);
  const auto out_dtype = torch::jit::pop(*stack).toScalarType();
  const Tensor mat2 = torch::jit::pop(*stack).toTensor();
  const Tensor self = torch::jit::pop(*stack).toTensor();
  check_matrices(self, mat2, "self");
  if (out) check_out_tensor(*out, out_dtype);
  TORCH_CHECK(self.scalar_type() == mat2.scalar_type(), "input dtypes must be the same");
  check_out_dtype(self, out_dtype);
  push_result(stack, at::mm(self.to(out_dtype), mat2.to(out_dtype)), out);
}

template <bool kOut>
void bmm_out_dtype(torch::jit::Stack* stack) {
  const std::optional<Tensor> out = pop_out<kOut>(stack);
  const auto out_dtype = torch::jit::pop(*stack).toScalarType();
  const Tensor batch2 = torch::jit::pop(*stack).toTensor();
  const Tensor batch1 = torch::jit::pop(*stack).toTensor();
  check_batched_out_dtype(batch1, batch2, out_dtype, nullptr);
  push_result(stack, at::bmm(batch1.to(out_dtype), batch2.to(out_dtype)), out);
}

template <bool kOut>
void addmm_out_dtype(torch::jit::Stack* stack) {
  const std::optional<Tensor> out = pop_out<kOut>(stack);
  const c10::Scalar alpha = torch::jit::pop(*stack).toScalar(), beta = torch::jit::pop(*stack).toScalar();
  const auto out_dtype = torch::jit::pop(*stack).toScalarType();
  const Tensor mat2 = torch::jit::pop(*stack).toTensor();
  const Tensor mat1 = torch::jit::pop(*stack).toTensor();
  const Tensor self = torch::jit::pop(*stack).toTensor();
  TORCH_CHECK(self.scalar_type() == mat2.scalar_type(), "self and mat2 must have the same dtype, but got ",
              self.scalar_type(), " and ", mat2.scalar_type());
  TORCH_CHECK(mat1.scalar_type() == mat2.scalar_type(), "mat1 and mat2 must have the same dtype, but got ",
              mat1.scalar_type(), " and ", mat2.scalar_type());
  check_matrices(mat1, mat2, "mat1");
  if (out) check_out_tensor(*out, out_dtype);
  check_out_dtype(self, out_dtype);
  push_result(stack, at::addmm(self.to(out_dtype), mat1.to(out_dtype), mat2.to(out_dtype), beta, alpha), out);
}

template <bool kOut>
void baddbmm_out_dtype(torch::jit::Stack* stack) {
  const std::optional<Tensor> out = pop_out<kOut>(stack);
  const c10::Scalar alpha = torch::jit::pop(*stack).toScalar(), beta = torch::jit::pop(*stack).toScalar();
  const auto out_dtype = torch::jit::pop(*stack).toScalarType();
  const Tensor batch2 = torch::jit::pop(*stack).toTensor();
  const Tensor batch1 = torch::jit::pop(*stack).toTensor();
  const Tensor self = torch::jit::pop(*stack).toTensor();
  check_batched_out_dtype(batch1, batch2, out_dtype, &self);
  push_result(stack, at::baddbmm(self.to(out_dtype), batch1.to(out_dtype), batch2.to(out_dtype), beta, alpha), out);
}

// One GPU kernel that mirage's host side computes as a CPU composite (`host`, or the CPU build's
// composite where null): the op path times it as the one op it is, and the composite's own ops go
// unrecorded (a GPU's profiler shows no ops under it).
template <HostKernel host>
void one_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  at::DisableRecordFunctionGuard composite_unrecorded;
  fallback_on_host(op, keys, stack, host);
}

constexpr char kBatchNormStats[] = "aten::batch_norm_stats";
constexpr char kGatherStats[] = "aten::batch_norm_gather_stats";
constexpr char kGatherStatsWithCounts[] = "aten::batch_norm_gather_stats_with_counts";
constexpr char kBatchNormElemt[] = "aten::batch_norm_elemt";
constexpr char kBackwardReduce[] = "aten::batch_norm_backward_reduce";
constexpr char kBackwardElemt[] = "aten::batch_norm_backward_elemt";
constexpr char kLstmCell[] = "aten::_thnn_fused_lstm_cell";
constexpr char kLstmCellBackward[] = "aten::_thnn_fused_lstm_cell_backward_impl";
constexpr char kGruCell[] = "aten::_thnn_fused_gru_cell";
constexpr char kGruCellBackward[] = "aten::_thnn_fused_gru_cell_backward";

}  // namespace

}  // namespace mirage

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  // Each one kernel through the op path. The forward's host side is the CPU build's composite
  // (rms_norm_composite, what `_fused_rms_norm` is without a kernel); the backward's is above.
  m.impl("_fused_rms_norm", torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<nullptr>>());
  m.impl("_fused_rms_norm_backward",
         torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::fused_rms_norm_backward>>());
  using mirage::AsOneKernel;
  m.impl("_thnn_fused_lstm_cell", TORCH_FN((AsOneKernel<mirage::kLstmCell, &mirage::fused_lstm_cell>::call)));
  m.impl("_thnn_fused_lstm_cell_backward_impl",
         TORCH_FN((AsOneKernel<mirage::kLstmCellBackward, &mirage::fused_lstm_cell_backward_impl>::call)));
  m.impl("_thnn_fused_gru_cell", TORCH_FN((AsOneKernel<mirage::kGruCell, &mirage::fused_gru_cell>::call)));
  m.impl("_thnn_fused_gru_cell_backward",
         TORCH_FN((AsOneKernel<mirage::kGruCellBackward, &mirage::fused_gru_cell_backward>::call)));
  m.impl("record_stream", TORCH_FN(mirage::record_stream));
  m.impl("mm.dtype", torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::mm_out_dtype<false>>>());
  m.impl("mm.dtype_out", torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::mm_out_dtype<true>>>());
  m.impl("bmm.dtype", torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::bmm_out_dtype<false>>>());
  m.impl("bmm.dtype_out", torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::bmm_out_dtype<true>>>());
  m.impl("addmm.dtype", torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::addmm_out_dtype<false>>>());
  m.impl("addmm.dtype_out",
         torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::addmm_out_dtype<true>>>());
  m.impl("baddbmm.dtype",
         torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::baddbmm_out_dtype<false>>>());
  m.impl("baddbmm.dtype_out",
         torch::CppFunction::makeFromBoxedFunction<&mirage::one_kernel<&mirage::baddbmm_out_dtype<true>>>());
  m.impl("batch_norm_stats", TORCH_FN((AsOneKernel<mirage::kBatchNormStats, &mirage::batch_norm_stats>::call)));
  m.impl("batch_norm_gather_stats",
         TORCH_FN((AsOneKernel<mirage::kGatherStats, &mirage::batch_norm_gather_stats>::call)));
  m.impl("batch_norm_gather_stats_with_counts",
         TORCH_FN((AsOneKernel<mirage::kGatherStatsWithCounts, &mirage::batch_norm_gather_stats_with_counts>::call)));
  m.impl("batch_norm_elemt", TORCH_FN((AsOneKernel<mirage::kBatchNormElemt, &mirage::batch_norm_elemt>::call)));
  m.impl("batch_norm_elemt.out",
         TORCH_FN((AsOneKernel<mirage::kBatchNormElemt, &mirage::batch_norm_elemt_out>::call)));
  m.impl("batch_norm_backward_reduce",
         TORCH_FN((AsOneKernel<mirage::kBackwardReduce, &mirage::batch_norm_backward_reduce>::call)));
  m.impl("batch_norm_backward_elemt",
         TORCH_FN((AsOneKernel<mirage::kBackwardElemt, &mirage::batch_norm_backward_elemt>::call)));
}
